"""SHARD_OPTIM (ZeRO-1): whole parameters and gradients, sharded optimizer.

A ZeRO-1 unit is laid out like a sharded one (the shard is the rank's slice
of the flat buffer and the only Parameter the optimizer sees), but its full
buffer is gathered once at construction and never freed. What differs from
the sharded strategies, and lives here:

  gradients  the engine (SHARD_OPTIM, csrc/engine/unit_reduce.c) averages
             the unit's whole local gradient over the ranks into the group's
             whole gradient, in the parameters' dtype; the shard's .grad is
             a view of this rank's slice of it (no copy, nothing
             shard-sized extra). A second backward before zero_grad() adds
             its average to it (averages are linear: same sum as DDP).
             fsdp/unit.py plans the reduction like the other strategies'.
  parameters after optimizer.step() updates the shards, an optimizer step
             post-hook all-gathers them back into the whole buffers (in
             place, no reallocation), so the
             parameters are never stale, whoever reads them. The hook is
             torch's global one (every torch.optim.Optimizer, flatshard.optim
             included); it is registered when the first ZeRO-1 unit is built
             and gathers, in construction order (the same on every rank),
             the units whose shards the stepping optimizer holds.

Memory per rank: whole parameters + whole gradients + 1/world of the
optimizer state (and the fp32 master shard it updates). Under mixed
precision the whole parameters are the low-precision compute buffer (the
fp32 full buffer is gathered only for state dicts and summon_full_params).
"""
import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook


_UNITS = []        # weakrefs to ZeRO-1 UnitRuntimes, in construction order
_HOOK = None


def register(unit):
    """Track a ZeRO-1 unit and make sure the step hook is installed."""
    global _HOOK
    _UNITS.append(weakref.ref(unit))
    if _HOOK is None:
        _HOOK = register_optimizer_step_post_hook(_after_step)


def _after_step(optimizer, args, kwargs):
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    alive = []
    for ref in _UNITS:
        unit = ref()
        if unit is None:
            continue
        alive.append(ref)
        if any(id(t) in held for g in unit.groups for t in [g.shard] + list(g.params)):
            refresh(unit)
    _UNITS[:] = alive


def refresh(unit):
    """All-gather the (updated) shards into the whole buffers, over the old
    values in the same storage (no reallocation), so every view of it (the
    modules' parameters) stays valid."""
    unit.c.regather()


def holds_grad(unit, g):
    if unit.use_orig_params:
        return any(p.grad is not None for p in g.params)
    return g.shard.grad is not None


def is_slice_of(t, whole, rank):
    return (t.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() and
            t.storage_offset() == whole.storage_offset() + rank * t.numel())
