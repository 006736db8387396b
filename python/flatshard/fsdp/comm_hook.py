"""FSDP.register_comm_hook: torch's default FSDP communication hooks, honoured
through the engine's own gradient reduction.

The engine reduces every unit's gradient itself (csrc/engine/unit_reduce.c)
and calls no Python in between, so a hook is accepted only where the engine
does what the hook would do. torch's default hooks
(torch.distributed.algorithms._comm_hooks.default_hooks) are those:

  allreduce_hook(DefaultState, grad)              NO_SHARD units: the
      gradient all-reduced and averaged, which is the engine's reduction.
  reduce_scatter_hook(DefaultState, grad, output) sharded units: the
      gradient reduce-scattered and averaged, the engine's reduction.
  fp16_compress_hook / bf16_compress_hook(LowPrecisionState, grad, output=None)
      either: the gradient cast to float16 / bfloat16, reduced in that dtype,
      averaged and cast back to the parameters' dtype: the engine's
      reduction with that reduce dtype (it replaces MixedPrecision's
      reduce_dtype, as the hook does in torch).

As in torch, the averaging divides by the group's size, split in two
(before and after the sum, gradient_predivide_factor x
gradient_postdivide_factor); the engine splits it by the same rule
(csrc/core/reduce_rule.c), so its values are the hook's. A state with other
factors (a sum scaled some other way), a state over another process group,
and any other hook are refused with a NotBuiltError naming the argument: they would
need the engine to call Python between its collectives.
"""
import torch
import torch.distributed as dist

from .. import _C
from ..errors import ConfigAssertionError, bad_type, bad_value, not_built
from ..options import ShardingStrategy
from ..tensors import dtype_code

_ALLOWED = ("torch's default hooks from torch.distributed.algorithms._comm_hooks.default_hooks: "
            "allreduce_hook (NO_SHARD), reduce_scatter_hook (sharded strategies), "
            "fp16_compress_hook and bf16_compress_hook (either)")


def _default_hooks():
    from torch.distributed.algorithms._comm_hooks import default_hooks
    return default_hooks


def _name(hook):
    return getattr(hook, "__qualname__", None) or type(hook).__name__


def plan(units, state, hook):
    """Check `hook` and `state` for every unit ((FSDP module, UnitRuntime)
    pairs: the root's tree); -> the reduce dtype the engine uses from now on
    (None: unchanged). Raises before anything changes."""
    dh = _default_hooks()
    if not callable(hook):
        raise bad_type("hook", hook, "a callable (one of " + _ALLOWED + ")")
    low = {dh.fp16_compress_hook: torch.float16, dh.bf16_compress_hook: torch.bfloat16}
    known = (dh.allreduce_hook, dh.reduce_scatter_hook) + tuple(low)
    if hook not in known:
        raise not_built("hook", _name(hook), "flatshard's engine reduces gradients itself and "
                        "calls no Python communication hook", "use " + _ALLOWED)
    for fs in units:
        strategy = fs._cfg.strategy
        if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
            raise ConfigAssertionError(f"flatshard: communication hook is not supported for "
                                       f"hybrid strategies: {strategy} (as in torch)")
        if strategy is ShardingStrategy.SHARD_OPTIM:
            raise not_built("hook", _name(hook), "SHARD_OPTIM is flatshard's own strategy, for "
                            "which torch defines no communication hook")
        if fs.__dict__.get("_flatshard_comm_hook") is not None:
            raise ConfigAssertionError("flatshard: a communication hook is already registered")
    want = dh.LowPrecisionState if hook in low else dh.DefaultState
    if not isinstance(state, want):
        raise bad_type("state", state, f"a {want.__module__}.{want.__name__} for {_name(hook)}")
    for fs in units:
        u = fs._unit
        if hook is dh.allreduce_hook and not u.no_shard:
            raise bad_value("hook", "allreduce_hook", f"unit {u.name!r} is sharded "
                            f"({fs._cfg.strategy.name}); allreduce_hook reduces a whole "
                            "gradient (NO_SHARD units only)", "use reduce_scatter_hook")
        if hook is dh.reduce_scatter_hook and u.no_shard:
            raise bad_value("hook", "reduce_scatter_hook", f"unit {u.name!r} keeps whole "
                            "gradients (NO_SHARD, or one rank); reduce_scatter_hook needs a "
                            "sharded strategy", "use allreduce_hook")
        world = u.c.comm.world_size
        ranks = dist.get_process_group_ranks(fs._cfg.group)
        if dist.get_process_group_ranks(state.process_group) != ranks:
            raise not_built("state", f"{type(state).__name__}(process_group=<ranks "
                            f"{dist.get_process_group_ranks(state.process_group)}>)",
                            f"unit {u.name!r} reduces over ranks {ranks}; the engine reduces "
                            "over the unit's own process group only",
                            "pass DefaultState(process_group) with the model's process group")
        pre, post = state.gradient_predivide_factor, state.gradient_postdivide_factor
        rule = _C.grad_divide("fsdp1", dtype_code(torch.float32), world)
        if (pre, post) != (rule["pre"], rule["post"]):
            raise not_built("state", f"{type(state).__name__}(gradient_predivide_factor={pre}, "
                            f"gradient_postdivide_factor={post})", "the engine averages over "
                            f"the group ({world} ranks), dividing by {rule['pre']:g} before "
                            f"the sum and {rule['post']:g} after, as torch's DefaultState "
                            "does; other factors scale the sum otherwise",
                            "leave the factors DefaultState computes")
        if hook in low:
            for g in u.groups:
                if g.dtype.is_floating_point and g.dtype != state.parameter_type:
                    raise bad_value("state", f"LowPrecisionState(parameter_type="
                                    f"{state.parameter_type})", f"unit {u.name!r} has {g.dtype} "
                                    "parameters, and the hook casts their reduced gradients to "
                                    "parameter_type", f"pass parameter_type={g.dtype}")
    return low.get(hook)
