"""Errors flatshard raises. Every configuration error names the argument, the
value given, what is allowed and, where there is one, the fix."""
from ._C import CoreError, StateError

__all__ = ["ConfigError", "ConfigTypeError", "CoreError", "StateError", "NotBuiltError",
           "StateDictError", "UnsafeFileError", "CheckpointDamaged", "MetaDeviceError",
           "StaleOptimizerError",
           "MistakeWarning", "InitDiffersWarning", "UnsyncedStepWarning", "ReplicaDriftWarning"]


class ConfigError(ValueError):
    """A constructor argument or option has a value flatshard cannot use."""


class ConfigTypeError(ConfigError, TypeError):
    """A constructor argument or option has the wrong type."""


class ConfigAssertionError(ConfigError, AssertionError):
    """A ConfigError where torch raises AssertionError for the same call
    (fully_shard's 2-D mesh without mesh_dim_names, fully_shard applied to a
    module twice, copy.deepcopy of a sharded module), so code written
    against either keeps catching it."""


class MetaDeviceError(ConfigError, RuntimeError):
    """Parameters still on the meta device at their first gather: a
    ConfigError that is also the RuntimeError torch's fully_shard raises
    there, so code written against either keeps catching it."""


class RootError(ConfigError, RuntimeError):
    """fully_shard's root refused at its lazy init (the first forward, or
    _lazy_init), as torch's fully_shard refuses it with a RuntimeError: a
    root made of several modules (fully_shard([a, b]) with no fully_shard
    module above them), or an FSDP module below it whose own first forward
    ran before the root's. A ConfigError that is also that RuntimeError, so
    code written against either keeps catching it."""


class NotBuiltError(ConfigError):
    """An option asks for a feature this version of flatshard does not have.

    Raised instead of silently ignoring the option."""


class ReductionCheckError(ConfigError, RuntimeError):
    """A Comm's reductions gave a wrong result on the known-answer check
    made when the Comm is built (runtime/comm_check.py): a backend that sums
    where it should average, or worse. Raised on every rank, before any
    gradient is reduced through it."""


class NoEffectWarning(UserWarning):
    """A setting that changes nothing where it was given (a mixed-precision
    policy that casts nothing, a wrap policy that wraps nothing or leaves one
    unit with almost every parameter, reshard_after_forward given to the root
    only): flatshard/noop/. Each kind is said once per process; silence them
    with warnings.filterwarnings("ignore", category=NoEffectWarning)."""


class OutsideForwardError(ConfigError, RuntimeError):
    """A fully_shard module's parameters were read outside its forward while
    resharded (a method other than forward: fsdp2/outside_forward.py): names
    the module, the method and the fix. A RuntimeError, as torch's DTensor
    error it replaces."""


class OutOfMemoryError(MemoryError):
    """An allocation inside flatshard failed on this rank. The message carries
    the rank's memory breakdown and the options that would lower it; on the
    shm backend the other ranks are told and fail with the same cause."""


def bad_value(arg, value, allowed, fix=None):
    msg = f"flatshard: {arg}={value!r} is not allowed; {allowed}"
    if fix:
        msg += f". {fix}"
    return ConfigError(msg)


def bad_type(arg, value, allowed, fix=None):
    msg = f"flatshard: {arg} got {type(value).__name__} {value!r}; expected {allowed}"
    if fix:
        msg += f". {fix}"
    return ConfigTypeError(msg)


def not_built(arg, value, why, fix=None):
    msg = f"flatshard: {arg}={value!r} is not supported by this version: {why}"
    if fix:
        msg += f". {fix}"
    return NotBuiltError(msg)


def is_alloc_failure(e):
    """Whether `e` is this rank's own allocation failure: a MemoryError (the
    engine's, the pool's), or torch's allocator's RuntimeError. Not the
    engine's CoreError of a collective another rank aborted, whose text
    quotes that rank's allocation failure."""
    if isinstance(e, MemoryError):
        return True
    if isinstance(e, CoreError) or not isinstance(e, RuntimeError):
        return False
    text = str(e).lower()
    return "not enough memory" in text or "can't allocate memory" in text or \
        "out of memory" in text


class StateDictError(RuntimeError):
    """A state dict or checkpoint does not match the model: names the first
    missing, unexpected or mismatching keys. A RuntimeError, as torch's
    load_state_dict raises."""


class UnsafeFileError(ConfigError):
    """A file flatshard reads (a checkpoint's metadata or one of its entries,
    a LATEST file, a state dict's file name) holds what flatshard does not
    load from a file someone else may have written: a pickled object other
    than plain data, or a name that leads out of its directory. Names the
    file or key and why; nothing in it was run or read."""


class CheckpointDamaged(ConfigError):
    """A checkpoint's files are not what was saved: a file missing, truncated
    or grown, its bytes changed (its CRC-32C differs from the manifest's), a
    file the metadata names that the manifest lacks, the manifest missing or
    malformed, or torch.distributed.checkpoint failing to read a file. Names
    the checkpoint, each file, which rank's part it is and what is wrong.
    Found by the manifest check, it is raised on every rank before anything
    is loaded; a failure of torch's own read later (a file changed after the
    check, or no manifest to check by) may leave part of the checkpoint in
    the model. An Exception, unlike DCP's CheckpointException."""


# ----------------------------------------------------------------------
# Mistakes that train wrong without an error under torch's FSDP
# (python/flatshard/checks/): each message names the rank, the parameter or
# unit, what happened and the fix, and points to its docs/troubleshooting.md
# entry.


class StaleOptimizerError(ConfigError):
    """An optimizer's first step() found parameters that FSDP replaced when
    it wrapped their module (the optimizer was built before wrapping): its
    steps would update tensors the model no longer uses."""


class MistakeWarning(UserWarning):
    """A mistake that trains wrong without an error under torch's FSDP,
    where a script may rely on torch's behaviour: flatshard warns, naming
    the rank, the parameter or unit, and the fix. Each subclass has an
    environment variable that turns its check off (envvars.py)."""


class InitDiffersWarning(MistakeWarning):
    """The ranks wrapped different initial values of a parameter: each
    shards its own, and the model trained is a patchwork of them."""


class UnsyncedStepWarning(MistakeWarning):
    """optimizer.step() after backward passes that all ran with gradient
    sync off (no_sync(), set_requires_gradient_sync(False)): the gradients
    were never reduced across ranks, and the step does not use them."""


class ReplicaDriftWarning(MistakeWarning):
    """Ranks that must hold equal values of a parameter (NO_SHARD, hybrid
    sharding's replicas) hold different ones."""
