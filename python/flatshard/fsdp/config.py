"""Validation of FullyShardedDataParallel's arguments, before any collective.

`resolve()` checks every argument's type, value and combination and returns
one frozen `UnitConfig`; anything flatshard cannot honour raises a
ConfigError (ValueError) or ConfigTypeError (TypeError) naming the argument.
Options whose feature is not built yet raise NotBuiltError: never ignored.
"""
import dataclasses
import enum
import inspect
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import ConfigError, bad_type, bad_value, not_built
from ..options import (BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy,
                       normalize_comm_quant, normalize_dataclass, normalize_enum)
from ..runtime import cuda
from ..runtime.comm import backend_for_device, requested_backend, shm_slot_bytes
from ..runtime.timeout import comm_timeout_s

# Options a wrap policy (CustomPolicy) may override per unit.
PER_UNIT_KEYS = frozenset({"sharding_strategy", "backward_prefetch", "forward_prefetch",
                           "limit_all_gathers", "mixed_precision", "cpu_offload",
                           "comm_quant"})


@dataclass(frozen=True)
class UnitConfig:
    strategy: ShardingStrategy
    backward_prefetch: Optional[BackwardPrefetch]
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool
    device: torch.device
    group: object  # torch ProcessGroup
    comm_backend: str  # "auto", "shm" or "torch" (runtime/comm.py); "nccl" on a CUDA device
    mixed_precision: Optional[MixedPrecision] = None
    offload_params: bool = False  # CPUOffload(offload_params=True)
    # HYBRID_SHARD (strategy is then FULL_SHARD or SHARD_GRAD_OP inside the
    # shard group): (shard group, replicate group, 2-D DeviceMesh or None),
    # or the ranks per host (LOCAL_WORLD_SIZE) when the groups are made at
    # wrap time (groups.py).
    hybrid: object = None
    comm_quant: object = None  # a CommQuant (options.py) or None


# torch's hybrid strategies: how each shards inside its shard group.
HYBRID = {ShardingStrategy.HYBRID_SHARD: ShardingStrategy.FULL_SHARD,
          ShardingStrategy._HYBRID_SHARD_ZERO2: ShardingStrategy.SHARD_GRAD_OP}


def _bool(name, value):
    if not isinstance(value, bool):
        raise bad_type(name, value, "True or False")
    return value


def _device(device_id):
    if device_id is None:
        return torch.device("cpu")
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        device = torch.device("cuda", device_id)
    elif isinstance(device_id, (str, torch.device)):
        try:
            device = torch.device(device_id)
        except RuntimeError:
            raise bad_value("device_id", device_id, "expected a torch.device such as "
                            "torch.device('cpu') or torch.device('cuda', local_rank)") from None
    else:
        raise bad_type("device_id", device_id, "torch.device, int, str or None")
    if device.type == "cuda":
        return _cuda_device(device_id, device)
    if device.type != "cpu":
        raise not_built("device_id", device_id, f"{device.type} devices are not supported; "
                        "use torch.device('cpu') or a CUDA device")
    return device


def _cuda_device(device_id, device):
    if not cuda.built():
        raise not_built("device_id", device_id, "flatshard was built without nvcc, so it has "
                        "no CUDA kernels", "reinstall with a CUDA toolkit found (CUDA_HOME or "
                        "nvcc on PATH), or use torch.device('cpu')")
    if not torch.cuda.is_available():
        raise bad_value("device_id", device_id, "torch sees no CUDA device on this machine",
                        "use torch.device('cpu')")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not 0 <= index < torch.cuda.device_count():
        raise bad_value("device_id", device_id, f"this machine has {torch.cuda.device_count()} "
                        "CUDA device(s)")
    return torch.device("cuda", index)


def _group(process_group, device_mesh, device):
    if isinstance(process_group, enum.Enum):
        raise bad_type("process_group", process_group, "a torch.distributed ProcessGroup or None",
                       "the second positional argument of FSDP is process_group: pass "
                       f"{type(process_group).__name__} options by keyword "
                       "(e.g. sharding_strategy=...)")
    if not dist.is_available() or not dist.is_initialized():
        raise bad_value("process_group", process_group,
                        "torch.distributed is not initialized",
                        "Call torch.distributed.init_process_group('gloo') first, or launch "
                        "with torchrun")
    if process_group is not None and device_mesh is not None:
        raise bad_value("device_mesh", device_mesh, "process_group and device_mesh are mutually "
                        "exclusive", "pass only one of them")
    if isinstance(process_group, tuple):
        raise bad_value("process_group", process_group, "a (shard, replicate) pair means hybrid "
                        "sharding", "pass sharding_strategy=ShardingStrategy.HYBRID_SHARD with it")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise bad_type("process_group", process_group, "a torch.distributed ProcessGroup or None",
                       "create one with torch.distributed.new_group(backend='gloo')")
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise bad_type("device_mesh", device_mesh, "a 1-D torch.distributed DeviceMesh or None")
    if device_mesh is not None:
        if getattr(device_mesh, "ndim", None) != 1:
            raise bad_value("device_mesh", device_mesh, "a 2-D mesh means hybrid sharding; "
                            "other strategies take a 1-D mesh",
                            "pass sharding_strategy=ShardingStrategy.HYBRID_SHARD with it")
        group = device_mesh.get_group()
    else:
        group = process_group if process_group is not None else dist.group.WORLD
    try:
        backend = str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError) as e:
        raise bad_type("process_group", process_group, "a torch.distributed ProcessGroup this "
                       f"rank belongs to ({e})") from None
    # On a CUDA device flatshard's own NCCL communicator moves the data: the
    # group only names the ranks (and its store passes NCCL's id).
    if device.type == "cpu" and "gloo" not in backend and "fake" not in backend:
        raise bad_value("process_group", f"<ProcessGroup backend={backend}>",
                        "CPU tensors need a process group that can run them (gloo)",
                        "create one with torch.distributed.new_group(backend='gloo')")
    return group


def _hybrid(process_group, device_mesh, device):
    """HYBRID_SHARD's groups -> (the group the ranks agree over, the spec
    UnitConfig.hybrid keeps). No collective: groups made from
    LOCAL_WORLD_SIZE are created after the ranks agreed (groups.py)."""
    if not dist.is_available() or not dist.is_initialized():
        _group(None, None, device)  # raises: not initialized
    if process_group is not None and device_mesh is not None:
        raise bad_value("device_mesh", device_mesh, "process_group and device_mesh are mutually "
                        "exclusive", "pass only one of them")
    if isinstance(process_group, tuple):
        if len(process_group) != 2 or not all(isinstance(g, dist.ProcessGroup)
                                              for g in process_group):
            raise bad_type("process_group", process_group, "a (shard group, replicate group) "
                           "pair of torch.distributed ProcessGroups")
        shard, replicate = (_group(g, None, device) for g in process_group)
        return shard, (shard, replicate, None)
    if device_mesh is not None:
        if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 2:
            raise bad_value("device_mesh", device_mesh, "HYBRID_SHARD takes a 2-D mesh "
                            "(replicate on dim 0, shard on dim 1)")
        shard, replicate = device_mesh.get_group(1), device_mesh.get_group(0)
        return shard, (shard, replicate, device_mesh)
    if process_group is not None:
        raise bad_value("process_group", process_group, "HYBRID_SHARD needs two groups",
                        "pass process_group=(shard_group, replicate_group), a 2-D device_mesh, "
                        "or None under torchrun (ranks per host from LOCAL_WORLD_SIZE)")
    world = _group(None, None, device)
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    size = dist.get_world_size(world)
    if raw is None or not raw.isdigit() or int(raw) < 1 or size % int(raw):
        raise bad_value("LOCAL_WORLD_SIZE", raw, f"HYBRID_SHARD with process_group=None shards "
                        f"over each host's ranks: a positive divisor of the world size {size}",
                        "launch with torchrun, or pass process_group=(shard_group, "
                        "replicate_group)")
    return world, int(raw)


def resolve(kw):
    """kw: the constructor's keyword arguments -> UnitConfig."""
    strategy = normalize_enum("sharding_strategy", kw["sharding_strategy"], ShardingStrategy,
                              "ShardingStrategy", allow_none=True) or ShardingStrategy.FULL_SHARD
    prefetch = normalize_enum("backward_prefetch", kw["backward_prefetch"], BackwardPrefetch,
                              "BackwardPrefetch", allow_none=True)
    mp = normalize_dataclass("mixed_precision", kw["mixed_precision"], MixedPrecision,
                             "MixedPrecision")
    mp = _mixed_precision(mp, strategy)
    offload = normalize_dataclass("cpu_offload", kw["cpu_offload"], CPUOffload, "CPUOffload")
    if offload is not None:
        offload = CPUOffload(_bool("cpu_offload.offload_params", offload.offload_params))
    use_orig = _bool("use_orig_params", kw["use_orig_params"])
    device = _device(kw["device_id"])
    backend = backend_for_device(requested_backend(kw.get("comm_backend")), device)
    if device.type == "cuda":
        _cuda_limits(strategy, offload)
    hybrid = None
    if strategy in HYBRID:
        if offload is not None and offload.offload_params and device.type == "cuda":
            raise not_built("cpu_offload", offload, f"parameter offload with {strategy.name} on "
                            "a CUDA device is not built yet", "use FULL_SHARD with it")
        group, hybrid = _hybrid(kw["process_group"], kw["device_mesh"], device)
        strategy = HYBRID[strategy]
    else:
        group = _group(kw["process_group"], kw["device_mesh"], device)
    # Read only when the shm backend is set up, which is a collective: a bad
    # value must fail here, on every rank alike, not halfway through it.
    comm_timeout_s()
    shm_slot_bytes()
    quant = _comm_quant(kw.get("comm_quant"), strategy, device)
    return UnitConfig(
        strategy=strategy,
        backward_prefetch=prefetch,
        forward_prefetch=_bool("forward_prefetch", kw["forward_prefetch"]),
        limit_all_gathers=_bool("limit_all_gathers", kw["limit_all_gathers"]),
        use_orig_params=use_orig,
        device=device,
        group=group,
        comm_backend=backend,
        mixed_precision=mp,
        offload_params=bool(offload is not None and offload.offload_params),
        hybrid=hybrid,
        comm_quant=quant,
    )


def _comm_quant(value, strategy, device):
    """comm_quant, checked against what the engine builds
    (docs/comm_quant.md); None when it asks for nothing."""
    q = normalize_comm_quant("comm_quant", value)
    if q is None or (q.weights is None and q.grads is None):
        return None
    if device.type == "cuda":
        raise not_built("comm_quant", q, "quantized collectives run on host memory (shm, "
                        "a torch process group over CPU tensors), not yet on CUDA devices",
                        "pass comm_quant=None on a CUDA device")
    if q.grads is not None and strategy in (ShardingStrategy.NO_SHARD,
                                            ShardingStrategy.SHARD_OPTIM):
        raise bad_value("comm_quant.grads", q.grads, f"{strategy.name} all-reduces whole "
                        "gradients; quantized reductions need a reduce-scatter (FULL_SHARD, "
                        "SHARD_GRAD_OP or a hybrid strategy)", "pass grads=None")
    return q


def _cuda_limits(strategy, offload):
    """What the CUDA path does not do yet, refused by name."""
    if offload is not None and offload.offload_params and strategy in (
            ShardingStrategy.NO_SHARD, ShardingStrategy.SHARD_OPTIM):
        raise not_built("cpu_offload", offload, f"parameter offload with {strategy.name} on a "
                        "CUDA device is not built yet", "use FULL_SHARD or SHARD_GRAD_OP with it")


_LOW = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _mixed_precision(mp, strategy):
    """Validated MixedPrecision, or None when it changes nothing. A copy:
    the object is mutable, and what was checked is what the units keep
    ([Note: torch's option classes] in options.py)."""
    if mp is None:
        return None
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        v = getattr(mp, field)
        if v is not None and v not in _LOW:
            raise bad_value(f"mixed_precision.{field}", v, "expected None or one of "
                            "torch.float16, torch.bfloat16, torch.float32, torch.float64")
    for field in ("keep_low_precision_grads", "cast_forward_inputs", "cast_root_forward_inputs"):
        _bool(f"mixed_precision.{field}", getattr(mp, field))
    classes = mp._module_classes_to_ignore
    if not isinstance(classes, (tuple, list, set, frozenset)) or not all(
            isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        raise bad_type("mixed_precision._module_classes_to_ignore", classes,
                       "a sequence of nn.Module classes")
    if mp.keep_low_precision_grads:
        raise not_built("mixed_precision.keep_low_precision_grads", True, "gradients are "
                        "always accumulated into the full-precision shard; pass False")
    if mp == MixedPrecision():
        return None
    return dataclasses.replace(mp, _module_classes_to_ignore=tuple(classes))


def check_overrides(module_name, overrides):
    bad = set(overrides) - PER_UNIT_KEYS
    if bad:
        raise bad_value(f"auto_wrap_policy (kwargs for {module_name})", sorted(bad),
                        f"a policy may override only {', '.join(sorted(PER_UNIT_KEYS))}")


def resolve_override(module_name, root_kw, overrides):
    """A policy's per-unit overrides -> that unit's UnitConfig; errors name the unit."""
    check_overrides(module_name, overrides)
    try:
        return resolve({**root_kw, **overrides})
    except ConfigError as e:
        raise type(e)(f"{e} (in the options auto_wrap_policy returned for {module_name}: "
                      f"{overrides!r})") from None


def _accepts(fn, *args, **kwargs):
    """None if fn can be called with these arguments, else why not. Callables
    whose signature Python cannot read (some builtins) are given the benefit
    of the doubt."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError as e:
        return str(e)
    except ValueError:
        pass
    return None


def check_param_init_fn(fn):
    if fn is None:
        return
    if not callable(fn):
        raise bad_type("param_init_fn", fn, "a callable taking an nn.Module")
    why = _accepts(fn, None)
    if why:
        raise bad_type("param_init_fn", fn, f"a callable taking one nn.Module ({why})",
                       "FSDP calls param_init_fn(module) once per module on the meta device")


_POLICY_FIX = "e.g. auto_wrap_policy=ModuleWrapPolicy({Block})"


def checked_policy(policy):
    """Check auto_wrap_policy before it runs; returns the policy to run (a
    `_run_policy` policy is wrapped so that what it returns is checked too)."""
    if policy is None:
        return None
    if isinstance(policy, (set, frozenset, list, tuple)):
        raise bad_type("auto_wrap_policy", policy, "a policy object or function, not a "
                       "collection", f"wrap module classes in ModuleWrapPolicy: {_POLICY_FIX}")
    if isinstance(policy, type):
        raise bad_type("auto_wrap_policy", policy, "a policy object or function, not a class",
                       f"to wrap every {policy.__name__}, pass "
                       f"ModuleWrapPolicy({{{policy.__name__}}})")
    if hasattr(policy, "_run_policy"):
        classes = getattr(policy, "_module_classes", ())
        for c in classes:
            if not (isinstance(c, type) and issubclass(c, nn.Module)):
                raise bad_type("auto_wrap_policy", policy, "ModuleWrapPolicy of nn.Module "
                               f"subclasses, but it holds {c!r}", _POLICY_FIX)
        fn = getattr(policy, "_lambda_fn", None)
        if fn is not None:
            why = _accepts(fn, None) if callable(fn) else "it is not callable"
            if why:
                raise bad_type("auto_wrap_policy", policy, "CustomPolicy(lambda_fn) with "
                               f"lambda_fn taking one nn.Module ({why})")
        return _CheckedPolicy(policy)
    if not callable(policy):
        raise bad_type("auto_wrap_policy", policy, "a policy object (ModuleWrapPolicy, "
                       "CustomPolicy, torch's or flatshard's) or a callable "
                       "fn(module, recurse, nonwrapped_numel)", _POLICY_FIX)
    why = _accepts(policy, module=None, recurse=True, nonwrapped_numel=0)
    if why:
        raise bad_type("auto_wrap_policy", policy, "a callable fn(module, recurse, "
                       f"nonwrapped_numel) ({why})", "functools.partial the policy's own "
                       "arguments, e.g. partial(transformer_auto_wrap_policy, "
                       "transformer_layer_cls={Block})")
    return policy


class _CheckedPolicy:
    """A `_run_policy` policy whose result is checked: a dict keyed by
    submodules of the root, and no options for the root itself (the root's
    options are FSDP's own arguments: overrides there would be ignored)."""

    def __init__(self, policy):
        self.policy = policy

    def __repr__(self):  # errors show the user's policy
        return repr(self.policy)

    def _run_policy(self, root, ignored_modules, root_kwargs):
        out = self.policy._run_policy(root, ignored_modules, root_kwargs)
        if not isinstance(out, dict):
            raise bad_type("auto_wrap_policy", self.policy, "a policy whose _run_policy returns "
                           f"a dict of module -> options, not {type(out).__name__}")
        inside = set(root.modules())
        for m in out:
            if m not in inside:
                raise bad_value("auto_wrap_policy", self.policy, f"it selected {type(m).__name__} "
                                "that is not a submodule of the wrapped module")
        over = {k: v for k, v in (out.get(root) or {}).items()
                if k not in root_kwargs or root_kwargs[k] is not v}
        if over:
            raise bad_value("auto_wrap_policy", self.policy, f"it returned options {over!r} for "
                            "the root module, which always takes FSDP's own arguments",
                            "pass those options to FSDP(...) itself")
        return out
