"""Validation of FullyShardedDataParallel's arguments, before any collective.

`resolve()` checks every argument's type, value and combination and returns
one frozen `UnitConfig`; anything flatshard cannot honour raises a
ConfigError (ValueError) or ConfigTypeError (TypeError) naming the argument.
Options whose feature is not built yet raise NotBuiltError: never ignored.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .comm import requested_backend
from .errors import bad_type, bad_value, not_built
from .options import (BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy,
                      normalize_dataclass, normalize_enum)

# Options a wrap policy (CustomPolicy) may override per unit.
PER_UNIT_KEYS = frozenset({"sharding_strategy", "backward_prefetch", "forward_prefetch",
                           "limit_all_gathers", "mixed_precision", "cpu_offload"})


@dataclass(frozen=True)
class UnitConfig:
    strategy: ShardingStrategy
    backward_prefetch: Optional[BackwardPrefetch]
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool
    device: torch.device
    group: object  # torch ProcessGroup
    comm_backend: str  # "auto", "shm" or "torch" (comm.py)


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
                            "torch.device('cpu')") from None
    else:
        raise bad_type("device_id", device_id, "torch.device, int, str or None")
    if device.type != "cpu":
        raise not_built("device_id", device_id, "this build runs on CPU devices only "
                        "(the CUDA path is a separate feature); use device_id=torch.device('cpu')")
    return device


def _group(process_group, device_mesh):
    if not dist.is_available() or not dist.is_initialized():
        raise bad_value("process_group", process_group,
                        "torch.distributed is not initialized",
                        "Call torch.distributed.init_process_group('gloo') first, or launch "
                        "with torchrun")
    if process_group is not None and device_mesh is not None:
        raise bad_value("device_mesh", device_mesh, "process_group and device_mesh are mutually "
                        "exclusive", "pass only one of them")
    if isinstance(process_group, tuple):
        raise not_built("process_group", process_group, "a (shard, replicate) tuple means hybrid "
                        "sharding, which is not built yet")
    if device_mesh is not None:
        if getattr(device_mesh, "ndim", None) != 1:
            raise not_built("device_mesh", device_mesh, "only 1-D meshes are supported (a 2-D "
                            "mesh means hybrid sharding)")
        group = device_mesh.get_group()
    else:
        group = process_group if process_group is not None else dist.group.WORLD
    try:
        backend = str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError) as e:
        raise bad_type("process_group", process_group, "a torch.distributed ProcessGroup this "
                       f"rank belongs to ({e})") from None
    if "gloo" not in backend and "fake" not in backend:
        raise bad_value("process_group", f"<ProcessGroup backend={backend}>",
                        "CPU tensors need a process group that can run them (gloo)",
                        "create one with torch.distributed.new_group(backend='gloo')")
    return group


def resolve(kw):
    """kw: the constructor's keyword arguments -> UnitConfig."""
    strategy = normalize_enum("sharding_strategy", kw["sharding_strategy"], ShardingStrategy,
                              "ShardingStrategy", allow_none=True) or ShardingStrategy.FULL_SHARD
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        raise not_built("sharding_strategy", strategy, "hybrid sharding is not built yet; use "
                        "FULL_SHARD, SHARD_GRAD_OP or NO_SHARD")
    prefetch = normalize_enum("backward_prefetch", kw["backward_prefetch"], BackwardPrefetch,
                              "BackwardPrefetch", allow_none=True)
    mp = normalize_dataclass("mixed_precision", kw["mixed_precision"], MixedPrecision,
                             "MixedPrecision")
    if mp is not None and mp != MixedPrecision():
        raise not_built("mixed_precision", mp, "mixed precision is not built yet; pass None "
                        "(parameters, gradients and reductions stay in the parameters' dtype)")
    offload = normalize_dataclass("cpu_offload", kw["cpu_offload"], CPUOffload, "CPUOffload")
    if offload is not None and offload.offload_params:
        raise not_built("cpu_offload", offload, "parameter offload is not built yet; pass None "
                        "or CPUOffload(offload_params=False)")
    use_orig = _bool("use_orig_params", kw["use_orig_params"])
    return UnitConfig(
        strategy=strategy,
        backward_prefetch=prefetch,
        forward_prefetch=_bool("forward_prefetch", kw["forward_prefetch"]),
        limit_all_gathers=_bool("limit_all_gathers", kw["limit_all_gathers"]),
        use_orig_params=use_orig,
        device=_device(kw["device_id"]),
        group=_group(kw["process_group"], kw["device_mesh"]),
        comm_backend=requested_backend(kw.get("comm_backend")),
    )


def check_overrides(module_name, overrides):
    bad = set(overrides) - PER_UNIT_KEYS
    if bad:
        raise bad_value(f"auto_wrap_policy (kwargs for {module_name})", sorted(bad),
                        f"a policy may override only {', '.join(sorted(PER_UNIT_KEYS))}")
