"""torch 2.15's manual backward finalization for fully_shard:
FSDPModule.set_manual_backward_finalization(enabled),
FSDPModule.finalize_backward(*, async_op=False) and the
GradientReductionHandle it returns with async_op=True. FSDPModule has these
only where the installed torch has them (torch_facts.VERSIONED; module.py).

[Note: manual finalization] By default the root's end-of-backward callback
(FSDPState._finalize) finishes every group's post-backward, flushes the
reduction bucket and lands the reduction in flight, so the sharded gradients
are in place when backward returns. With manual finalization on (set on the
root, before backward) that callback only does what the end of a backward
needs: a group with gradient sync on whose post-backward has not run (not
every trainable parameter got a gradient, or gradients kept from backwards
without sync) is left pending, and every other group ends its backward as
usual (no sync: its gradients accumulated; resharded). The caller then calls
finalize_backward() on the root at a point of its choosing: each pending
group reduces, every group resharded as reshard_after_backward says, and
(async_op=False) what the bucket holds and the reduction in flight land.
With async_op=True that last step waits for GradientReductionHandle.wait();
until then the gradients may not be in place, and the root's next forward or
another finalize_backward raises, as in torch. Several backwards with
gradient sync off before one finalization accumulate, and the finalization
(sync on again) reduces their sum once. torch's no-op cases hold: before the
root's first forward, finalize_backward does nothing (async_op=True: a
handle whose wait() does nothing); after a backward that reached no FSDP
parameter it only reshards.

The mode and the pending flags live on the root's FSDPState (its
manual_finalization, manual_active, reduction and each state's
post_backward_pending); this file is their only writer besides
reset_iter_state.

Imports: torch, errors and runtime/observe; the states it is given are
fsdp2/state.py's (not imported here: state.py imports this file).
"""
import torch
import torch.distributed.fsdp as _tfsdp

from ..errors import bad_type
from ..runtime import observe

__all__ = ["GradientReductionHandle", "set_manual_backward_finalization", "finalize_backward"]

_TorchHandle = getattr(_tfsdp, "GradientReductionHandle", object)


class GradientReductionHandle(_TorchHandle):
    """What finalize_backward(async_op=True) returns: wait() lands the
    reductions the finalization left (the bucket's, the one in flight) and
    ends the backward iteration; after reset_iter_state a RuntimeError, as
    in torch. A handle from before the first forward waits for nothing."""

    _root = None       # the root FSDPState whose reduction this is
    _reduction = None  # the token it was given (the root's `reduction` until landed)

    def wait(self):
        root, token = self._root, self._reduction
        if root is None:
            return None
        if root.reduction is not token:
            raise RuntimeError("This gradient reduction handle was invalidated")
        _land(root)
        root.reduction = None
        self._root = self._reduction = None
        return None


def set_manual_backward_finalization(self, enabled):
    """Set whether the caller finalizes backward (torch 2.15): on the root
    FSDP module, before backward. When enabled, call finalize_backward()
    after all backward passes of the logical backward and before reading or
    clearing gradients; gradient sync and resharding follow their settings
    then ([Note: manual finalization] in fsdp2/finalize.py). The mode cannot
    change during a backward, nor after one started until it is finalized
    (or reset_iter_state): a RuntimeError, as in torch. `enabled`: a bool."""
    _check_bool("enabled", enabled)
    st = self._fsdp_state()
    if st.is_root is False:
        raise not_on_root("set_manual_backward_finalization")
    if enabled != st.manual_finalization and torch._C._current_graph_task_id() != -1:
        raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
    if st.manual_active is not None and enabled != st.manual_active:
        raise RuntimeError("set_manual_backward_finalization cannot change mode after backward "
                           "starts")
    st.manual_finalization = enabled


def finalize_backward(self, *, async_op=False):
    """Finalize backward on the calling thread (torch 2.15), on the root
    after the backward passes of one logical backward, under manual
    finalization: pending gradient reductions run and the groups reshard
    according to the current settings. async_op=True returns a
    GradientReductionHandle whose wait() the caller calls before using the
    gradients or running this model again; False waits before returning.
    Before the root's first forward: a no-op. After a backward that reached
    no FSDP-managed parameter: safe (it reshards). Do not call it between
    forward and backward. HSDP's partial reductions
    (set_requires_all_reduce(False)) are refused, as in torch: enable the
    all-reduce before finalization. [Note: manual finalization]"""
    _check_bool("async_op", async_op)
    st = self._fsdp_state()
    if st.is_root is None:
        return GradientReductionHandle() if async_op else None
    root = st.root
    if root.reduction is not None:
        raise RuntimeError("The previous gradient reduction must be waited on before "
                           "finalizing backward again")
    _validate(st)
    with observe.span("FSDP::finalize_backward"):
        _finalize_groups(root)
        if not async_op:
            _land(root)
            return None
    handle = GradientReductionHandle()
    handle._root, handle._reduction = root, object()
    root.reduction = handle._reduction
    return handle


# ----------------------------------------------------------------------
# what the root's callback and the other hooks call


def end_of_backward(root):
    """The root's end-of-backward callback under manual finalization:
    groups with gradient sync on and gradients not yet reduced are left for
    finalize_backward; the others end their backward now (no sync: the
    gradients accumulated; resharded). Nothing is landed."""
    root.manual_active = True
    for st in root.states or [root]:
        g = st.group
        if g is not None and st.requires_gradient_sync and (g.c.arrived or g.has_unsharded_grads()):
            st.forget_held_reshard()
            st.post_backward_pending = True
        else:
            st._end_backward()


def check_forward(root):
    """The root's pre-forward: an asynchronous finalization not waited for
    refuses it, as in torch."""
    if root.reduction is not None:
        raise RuntimeError("The previous gradient reduction must be waited on before forward")


def reset(root):
    """reset_iter_state: the mode chosen for this backward, the pending
    groups and an outstanding handle (its wait() raises from now on) go."""
    root.manual_active = None
    root.reduction = None
    for st in root.states or [root]:
        st.post_backward_pending = False


def not_on_root(method):
    return RuntimeError(f"{method} must be called on the root FSDP module")


# ----------------------------------------------------------------------


def _validate(st):
    """torch's checks, with its words, before anything changes."""
    root = st.root
    if st is not root:
        raise not_on_root("finalize_backward")
    manual = root.manual_active if root.manual_active is not None else root.manual_finalization
    if not manual:
        raise RuntimeError("FSDP finalize_backward requires manual backward finalization. Call "
                           "set_manual_backward_finalization(True) before forward")
    if root.tree.final_queued:
        raise RuntimeError("FSDP finalize_backward must be called after backward completes")
    for s in root.states:
        g = s.group
        if g is None or g.replicate_comm is None:
            continue
        name = s.fqn or "<root>"
        if g.c.has_partial:
            raise RuntimeError(f"FSDP manual backward finalization does not support partial "
                               f"gradient reductions for parameter group {name!r}. Use "
                               "automatic backward finalization for this configuration")
        if s.post_backward_pending and s.requires_gradient_sync and not g.all_reduce:
            raise RuntimeError(f"FSDP manual backward finalization requires all-reduce for "
                               f"parameter group {name!r}. Call set_requires_all_reduce(True) "
                               "before finalization")


def _finalize_groups(root):
    """Each state, last first (as torch): a pending group, or one holding
    gradients while gradient sync is on, runs its post-backward (reduce,
    reshard as set); any other group reshards if reshard_after_backward."""
    for st in reversed(root.states):
        g = st.group
        if g is None:
            continue
        if st.post_backward_pending or (st.requires_gradient_sync and g.has_unsharded_grads()):
            st.post_backward_pending = False
            g.c.post_backward()  # its sequence: [Note: post-backward sequence]
        elif st.reshard_after_backward:
            st.forget_held_reshard()
            g.reshard()


def _land(root):
    """The reductions the finalization issued land: the bucket's, then the
    one in flight; the backward iteration ends."""
    root.tree.bucket.flush()
    root.finish_reducing()
    root.tree.reduced = False
    root.manual_active = None


def _check_bool(arg, value):
    if not isinstance(value, bool):
        raise bad_type(arg, value, "True or False")
