"""Every environment variable flatshard reads, with its default and effect.

This table is the documentation (docs/reference.md is generated from it) and
tests/test_reference.py checks that every FLATSHARD_* name in the sources
(and setup.py) is here, so a new variable cannot go undocumented. Arguments always win over the
environment; a malformed value is a ConfigError naming the variable.
"""
import os

from .errors import bad_value

ENV = {
    "FLATSHARD_COMM_BACKEND": (
        "auto",
        "Collective backend when the wrapper's `comm_backend` argument is not given: 'auto' "
        "(shared memory when every rank of the group is on this host, else the process "
        "group), 'shm', 'torch' or 'nccl'."),
    "FLATSHARD_COMM_TIMEOUT": (
        "300",
        "Seconds any rank waits in a collective of the shm backend (and in the wrap-time "
        "agreement) before it reports which rank did not arrive and where that rank was, and "
        "raises. From 1 to 604800 (a week); the process group's own timeout, where shorter, "
        "caps it. On the torch backend a collective waits for the process group's timeout "
        "(init_process_group(timeout=...)) instead."),
    "FLATSHARD_SHM_SLOT_BYTES": (
        "8388608",
        "Bytes of staging each rank owns in the shared-memory segment (four sections used "
        "in turn; larger transfers go in chunks of at most a quarter of a slot, less where "
        "the CPU's last-level cache is smaller than the slots of all ranks). At least 4096."),
    "FLATSHARD_SHM_STAGING": (
        "auto",
        "How each rank writes its staging slot: 'auto' (the group times plain and streaming "
        "stores as it runs, one collective in 16 of each kind and size with the other one, "
        "and keeps the faster: which is faster depends on whether the ranks' CPUs share a "
        "cache), 'cached' (plain stores) or 'streamed' (streaming stores). Results are the "
        "same bits either way."),
    "FLATSHARD_REDUCE_BUCKET_BYTES": (
        "(backend)",
        "On a host Comm (fully_shard and the FSDP1 wrapper): gradient reductions of "
        "consecutive groups go in one reduce-scatter until they hold this many bytes of "
        "gradients (groups larger than it reduce on their own; 0: every group on its own). "
        "The bucket is flushed at the end of backward, so gradients are in place when "
        "backward returns. Default: 1048576 on the torch backend, whose collectives cost "
        "about a millisecond each; 0 on shm, where a bucket costs more than it saves. Read "
        "when a model's root runs its first forward."),
    "FLATSHARD_GATHER_AHEAD_BYTES": (
        "(backend)",
        "On a host Comm (fully_shard and the FSDP1 wrapper): when a unit gathers its "
        "parameters, the units that ran right after it in the last forward (in backward: "
        "right before it) are gathered in the same all-gather while together they hold at "
        "most this many bytes (0: every unit gathers on its own). Default: 1048576 on the "
        "torch backend, whose collectives cost about a millisecond each; 0 on shm. Read when "
        "a model's root runs its first forward."),
    "FLATSHARD_NCCL_LIBRARY": (
        "(search)",
        "Path of libnccl.so.2 for the NCCL backend; by default the copy torch loaded, then the "
        "nvidia-nccl wheel's, then the loader's search path."),
    "FLATSHARD_MEMORY_REPORT": (
        "0",
        "1: `flatshard.plan.watch_from_env(model)` returns a watch, and the examples print "
        "each rank's predicted against measured memory after the first step."),
    "FLATSHARD_OPTIM_TUNE_CACHE": (
        "(user cache)",
        "File where the CPU optimizers (AdamW, Adam, SGD, adamw_step_) keep the loop variant "
        "they measured fastest per size class, CPU, instruction set, thread count and "
        "flatshard version, so that later processes reuse it instead of measuring; empty: "
        "no file (each process measures). Default: flatshard/optim_tune.txt under "
        "$XDG_CACHE_HOME or ~/.cache. Plain text; an unreadable or malformed file is "
        "ignored and rewritten."),
    "FLATSHARD_SNAPSHOT_BUDGET": (
        "0",
        "The most bytes of shared memory one rank's snapshot segment may hold "
        "(flatshard.Snapshots, when its `budget` argument is not given); 0: no bound. A "
        "snapshot that would pass it is refused with a ConfigError."),
    "FLATSHARD_SNAPSHOT_FAULT": (
        "(none)",
        "For tests: `copy:STEP[:RANK]` kills rank RANK (default 0) with SIGKILL half-way "
        "through the copy of step STEP's snapshot, `commit:STEP[:RANK]` right after it "
        "announced that it holds step STEP. Only in the first run of a torchrun job "
        "(TORCHELASTIC_RESTART_COUNT 0 or unset)."),
    "FLATSHARD_CHECK_OPTIMIZER": (
        "1",
        "0: an optimizer's first step() does not look for parameters that FSDP replaced when "
        "it wrapped their module (an optimizer built before wrapping: StaleOptimizerError). "
        "Read at each optimizer's first step."),
    "FLATSHARD_CHECK_INIT": (
        "1",
        "0: wrapping does not compare the ranks' initial parameter values (a CRC-32C of each "
        "parameter, through the store; InitDiffersWarning names the first that differs). "
        "Must be the same on every rank. Read at each wrap."),
    "FLATSHARD_CHECK_UNSYNCED": (
        "1",
        "0: optimizer.step() does not warn when the last backward of a unit whose parameters "
        "it holds ran with gradient sync off (no_sync(), set_requires_gradient_sync(False)): "
        "UnsyncedStepWarning. Read at each such step."),
    "FLATSHARD_CHECK_REPLICAS_EVERY": (
        "1000",
        "Every this many steps of an optimizer, the ranks that must hold equal parameter "
        "values (NO_SHARD, hybrid sharding's replicas) "
        "compare a CRC-32C of each (ReplicaDriftWarning names the first that differs); 0: "
        "never. The FSDP1 wrapper's `check_replicas_every` argument wins. Must be the same on every "
        "rank. Read at each wrap."),
    "FLATSHARD_SNAPSHOT_HOST_RANKS": (
        "(none)",
        "For tests: one machine seen by flatshard.Snapshots as several hosts, each N "
        "consecutive ranks one host (their buddy copies go to the next one, and a rank "
        "restores from the segments of its own simulated host only)."),
    # Read by setup.py when building:
    "FLATSHARD_NO_CUDA": (
        "0",
        "Build time. 1: do not compile the CUDA sources even when nvcc is found."),
    "FLATSHARD_CUDA_ARCHS": (
        "90",
        "Build time. GPU architectures for nvcc, separated by ';' or ',' (e.g. '80;90'); "
        "PTX for the newest is included so later GPUs can run it."),
}


def read(name):
    """The one place flatshard reads its environment: the raw value of a
    FLATSHARD_* variable listed in ENV, or None when it is unset. Read at
    each call (lazily), so a variable set after import still counts; its
    owner parses it and names it in any error."""
    if name not in ENV:
        raise KeyError(f"flatshard: {name} is not in envvars.ENV; document it there first")
    return os.environ.get(name)


def read_flag(name, default):
    """A 0/1 switch from FLATSHARD_* variable `name`: `default` when unset
    (a ConfigError naming the variable for anything else)."""
    raw = read(name)
    if raw is None:
        return default
    if raw not in ("0", "1"):
        raise bad_value(name, raw, "expected 0 or 1")
    return raw == "1"


def read_bytes(name, default, zero):
    """A byte count from FLATSHARD_* variable `name`: `default` when unset,
    else a whole number (a ConfigError naming the variable otherwise).
    zero: what 0 means, for the message."""
    raw = read(name)
    if raw is None:
        return default
    if not raw.isdigit():
        raise bad_value(name, raw, f"expected a whole number of bytes (0: {zero})")
    return int(raw)
