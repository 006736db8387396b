"""Option types, with torch FSDP1's names and meanings.

flatshard's enums and dataclasses mirror torch's, and `normalize_*` accepts
either flatshard's or torch's objects (matched by member name / field), so an
existing torch FSDP script keeps its option objects."""
import enum
from dataclasses import dataclass, fields
from typing import Optional, Sequence, Type

import torch
import torch.distributed.fsdp as tfsdp
from torch.nn.modules.batchnorm import _BatchNorm

from .errors import bad_type, bad_value


class ShardingStrategy(enum.Enum):
    """What is sharded. Values match torch's ShardingStrategy (SHARD_OPTIM,
    which torch does not have, comes after its values). One strategy per
    ZeRO stage:

    NO_SHARD      DDP: nothing sharded; gradients all-reduced.
    SHARD_OPTIM   ZeRO-1: only the optimizer state (and the fp32 master shard
                  it updates) is sharded. Parameters stay whole on every rank
                  at all times and gradients are whole too: they are
                  all-reduced, and each rank's optimizer updates its own shard
                  (its .grad is a view of its slice of the whole gradient).
                  The updated shards are all-gathered back into the whole
                  parameters right after optimizer.step() (an optimizer
                  step post-hook: the parameters are never stale).
    SHARD_GRAD_OP ZeRO-2: gradients and optimizer state sharded; parameters
                  stay gathered from forward to the end of backward.
    FULL_SHARD    ZeRO-3: parameters, gradients and optimizer state sharded;
                  parameters gathered for each unit's forward and backward.
    HYBRID_SHARD, _HYBRID_SHARD_ZERO2: sharding inside a node, replication
                  across nodes (not built yet: rejected with an error).
    """
    FULL_SHARD = 1
    SHARD_GRAD_OP = 2
    NO_SHARD = 3
    HYBRID_SHARD = 4
    _HYBRID_SHARD_ZERO2 = 5
    SHARD_OPTIM = 6


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is issued during backward.

    BACKWARD_PRE  before the current unit's gradient computation.
    BACKWARD_POST after it, before the current unit's gradient reduction.
    """
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
    """What FSDP.state_dict returns (flatshard.fsdp.state_dict): whole parameters
    under the plain model's keys, each rank's flat shards, or DTensors."""
    FULL_STATE_DICT = enum.auto()
    LOCAL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


class OptimStateKeyType(enum.Enum):
    """What keys an optimizer state dict's "state" (and its param_groups'
    "params") by, for FSDP.rekey_optim_state_dict: parameter names (what
    FSDP.full_optim_state_dict gives) or parameter IDs (what
    torch.optim.Optimizer.state_dict gives: positions in its param_groups)."""
    PARAM_NAME = enum.auto()
    PARAM_ID = enum.auto()


# [Note: torch's option classes] The dataclasses below are torch FSDP1's, field
# for field: the same names, order and defaults, mutable as torch's are
# (frameworks assign to them: accelerate sets state_dict_config.offload_to_cpu
# before each save), compared and printed as dataclasses compare and print,
# so repr() reads as torch's. Being mutable, they are checked where they are
# read, not when built: MixedPrecision and CPUOffload when FSDP(...) takes
# them (fsdp/config.py; a copy is kept, as later assignments would not reach
# modules already wrapped), the state-dict configs at each state dict call
# (fsdp/state_dict.py), each error naming the field.


@dataclass
class MixedPrecision:
    """torch FSDP1's MixedPrecision fields: param_dtype (forward and backward
    compute), reduce_dtype (gradient reduction; default param_dtype),
    buffer_dtype (floating-point buffers), cast_forward_inputs (at every
    unit), cast_root_forward_inputs (at the root). keep_low_precision_grads
    is not built (only False). _module_classes_to_ignore: torch's classes of
    modules it wraps on their own and runs in full precision under an
    auto_wrap_policy (default: batch norms); flatshard does not build that:
    where a model wrapped with a policy holds one, FSDP raises NotBuiltError
    (pass _module_classes_to_ignore=() to run them in param_dtype)."""
    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    _module_classes_to_ignore: Sequence[Type[torch.nn.Module]] = (_BatchNorm,)


@dataclass
class CPUOffload:
    """offload_params=True keeps the sharded parameters and their gradients
    in host memory and runs the optimizer step there (torch FSDP1's
    meaning). On CPU devices they already are, so only torch's rule comes
    with it: gradients cannot be accumulated across backwards outside
    no_sync() (refused with an error, as torch does)."""
    offload_params: bool = False


@dataclass
class StateDictConfig:
    """offload_to_cpu: torch's flag (whole values in host memory; on CPU
    devices they are)."""
    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """offload_to_cpu as StateDictConfig's; rank0_only: only rank 0 gets the
    values, the others get {}."""
    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """offload_to_cpu as StateDictConfig's; _use_dtensor: torch's private
    flag (flatshard's sharded values are always DTensors)."""
    _use_dtensor: bool = False


@dataclass
class OptimStateDictConfig:
    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


# Quantized collectives: flatshard's own option (torch has none), frozen.
_QUANT_WEIGHTS = (None, "int8")
_QUANT_GRADS = (None, "int8", "int4")
_QUANT_BITS = {None: 0, "int8": 8, "int4": 4}
QUANT_BLOCK_MULTIPLE, QUANT_BLOCK_MAX = 32, 4096  # csrc/core/quant.h


@dataclass(frozen=True)
class CommQuant:
    """Quantized collectives (docs/comm_quant.md): what the engine's gathers
    and gradient reductions move, for links where bandwidth bounds the step
    (several hosts). Off unless asked for, field by field.

    weights     None (gathers move param_dtype) or "int8": each rank quantizes
                its shard of the gathered copy block-wise, the all-gather moves
                int8 codes and one float32 scale per block, and every rank
                dequantizes into the unsharded parameters (param_dtype). The
                master shard, the optimizer and state dicts stay exact.
    grads       None, "int8" or "int4": each rank quantizes the gradient
                block it sends to each rank once; an all-to-all moves them and
                the owning rank sums them in float32 (qgZ), then the usual
                divides apply. Needs a reduce-scatter (not NO_SHARD/ZERO1).
    block_size  values per float32 scale: a positive multiple of 32 up to
                4096 (the kernels' SIMD step; int4 blocks start on a byte).
                256 by default (benchmarks/results/network.md, "Quantized
                collectives": bytes and error).

    Host memory only (shm, or a torch process group over CPU tensors); a
    CUDA device is refused."""
    weights: Optional[str] = None
    grads: Optional[str] = None
    block_size: int = 256

    def __post_init__(self):
        if self.weights not in _QUANT_WEIGHTS:
            raise bad_value("CommQuant.weights", self.weights, "expected None or 'int8'")
        if self.grads not in _QUANT_GRADS:
            raise bad_value("CommQuant.grads", self.grads, "expected None, 'int8' or 'int4'")
        b = self.block_size
        if isinstance(b, bool) or not isinstance(b, int):
            raise bad_type("CommQuant.block_size", b, "an int")
        if b <= 0 or b % QUANT_BLOCK_MULTIPLE or b > QUANT_BLOCK_MAX:
            raise bad_value("CommQuant.block_size", b,
                            f"expected a positive multiple of {QUANT_BLOCK_MULTIPLE} up to "
                            f"{QUANT_BLOCK_MAX}")

    @property
    def engine_args(self):
        """(weight_bits, grad_bits, block) as the engine's set_comm_quant takes them."""
        return _QUANT_BITS[self.weights], _QUANT_BITS[self.grads], self.block_size


def normalize_comm_quant(arg, value):
    """comm_quant= of either API: a CommQuant or None."""
    if value is None or isinstance(value, CommQuant):
        return value
    raise bad_type(arg, value, "flatshard.CommQuant or None")


def quant_engine_args(value):
    """(weight_bits, grad_bits, block) for the engine; zeros for None."""
    return (0, 0, 256) if value is None else value.engine_args


# torch's own classes of torch.distributed.fsdp's names, taken when flatshard
# is imported: flatshard.use_for_torch_fsdp() later puts flatshard's classes
# at those names, and torch's objects built before it must still be accepted.
_TORCH_FSDP = {n: v for n, v in vars(tfsdp).items() if not n.startswith("_")}


def _torch_enum(name):
    return _TORCH_FSDP.get(name)


def normalize_enum(arg, value, ours, torch_name, allow_none=False):
    """flatshard's or torch's enum member -> flatshard's member."""
    if value is None and allow_none:
        return None
    if isinstance(value, ours):
        return value
    theirs = _torch_enum(torch_name)
    if theirs is not None and isinstance(value, theirs) and value.name in ours.__members__:
        return ours[value.name]
    names = ", ".join(f"{ours.__name__}.{m}" for m in ours.__members__)
    raise bad_type(arg, value, f"one of {names}" + (" or None" if allow_none else ""),
                   f"use flatshard.{ours.__name__} or torch.distributed.fsdp.{torch_name}")


def normalize_dataclass(arg, value, ours, torch_name, keep=False):
    """flatshard's or torch's dataclass instance -> flatshard's (or None);
    with `keep`, torch's instance itself (an object read where it is used,
    shared with the caller as torch shares it)."""
    if value is None or isinstance(value, ours):
        return value
    theirs = _torch_enum(torch_name)
    if theirs is not None and isinstance(value, theirs):
        if keep:
            return value
        return ours(**{f.name: getattr(value, f.name) for f in fields(ours)
                       if hasattr(value, f.name)})
    raise bad_type(arg, value, f"flatshard.{ours.__name__}, torch's {torch_name}, or None")
