"""SHARD_OPTIM (ZeRO-1): whole parameters and gradients, sharded optimizer.

A ZeRO-1 unit is laid out like a sharded one (the shard is the rank's slice
of the flat buffer and the only Parameter the optimizer sees), but its full
buffer is gathered once at construction and never freed. What differs from
the sharded strategies, and lives here:

  gradients  the unit's whole local gradient (autograd's, in the full
             buffer's layout) is all-reduced in place, averaged; it is kept
             as the group's whole gradient, and the shard's .grad is a view
             of this rank's slice of it (no copy, nothing shard-sized extra).
             A second backward before zero_grad() all-reduces its own
             gradient and adds it (averages are linear: same sum as DDP).
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

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..runtime.comm import all_reduce_

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


@torch.no_grad()
def reduce(unit, g, grad):
    """Average the unit's whole local gradient `grad` (padded_numel, the
    full buffer's layout, in the compute dtype) over the ranks, in the reduce
    dtype, and hand this rank's slice to the optimizer in the parameters'
    dtype, accumulating onto a gradient it already holds.

    Without mixed precision the slice is a view of the whole gradient; with
    it, the whole gradient stays in the reduce dtype and the shard's is a
    full-precision copy of its slice ([Note: mixed precision] in
    csrc/py_unit.c: accumulation happens in full precision)."""
    comm = unit.c.comm
    if unit.offload_params and holds_grad(unit, g):
        unit.refuse_accumulation()
    red = grad.to(g.reduce_dtype) if grad.dtype != g.reduce_dtype else grad
    if not red.is_contiguous():
        red = red.contiguous()
    if red.dtype == torch.float16:  # divided first: an fp16 sum could overflow
        red.div_(comm.world_size)
        all_reduce_(comm, red, average=False, tag=unit.name)
    else:
        all_reduce_(comm, red, average=True, tag=unit.name)
    mine = red.narrow(0, comm.rank * g.shard_numel, g.shard_numel)
    same = red.dtype == g.dtype
    if not unit.use_orig_params:
        cur = g.shard.grad
        if cur is None:
            g.whole_grad = red
            g.shard.grad = mine if same else mine.to(g.dtype)
        elif same and g.whole_grad is not None and _is_slice_of(cur, g.whole_grad, comm.rank):
            g.whole_grad.add_(red)
        else:  # a copy, or a gradient the user set: add our slice to it
            cur.add_(mine)
        return
    current = [p.grad for p in g.params]
    if g.grad_buf is not None and all(c is v for c, v in zip(current, g.grad_views)):
        if same:
            g.whole_grad.add_(red)
        else:
            g.grad_buf.add_(mine)
        return
    out = mine if same else mine.to(g.dtype)
    views = [g.piece(out, i, False) for i in range(len(g.params))]
    for v, c in zip(views, current):  # gradients the user set or kept
        if c is not None:
            v.add_(c.reshape(v.shape))
    for p, v in zip(g.params, views):
        p.grad = v
    g.whole_grad, g.grad_buf, g.grad_views = red, out, views


def holds_grad(unit, g):
    if unit.use_orig_params:
        return any(p.grad is not None for p in g.params)
    return g.shard.grad is not None


def _is_slice_of(t, whole, rank):
    return (t.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr() and
            t.storage_offset() == whole.storage_offset() + rank * t.numel())
