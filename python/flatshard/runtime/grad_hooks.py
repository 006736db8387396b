"""The post-accumulate-grad hooks of sharded parameters, for both wrappers.

`param.register_post_accumulate_grad_hook(hook)` on a parameter the user sees
(fully_shard's DTensor shard, the FSDP1 wrapper's original parameter with
use_orig_params=True) puts the hook in the tensor's
`_post_accumulate_grad_hooks`. Autograd never runs it: the modules compute on
the unsharded parameters, not on these. torch's fully_shard runs them itself
once a reduction has written the sharded gradient (foreach_reduce: per
parameter, in the group's order, right after its .grad is set or added to),
which is what optimizer-in-backward needs (one optimizer per parameter,
stepped from its hook). Both wrappers do the same at the point where a
reduction's values are in place: at once on the host, when a bucket is
flushed (runtime/bucket.py), when a deferred device reduction is landed
(runtime/inflight.py). A backward without gradient sync reduces nothing and
runs no hook, as in torch; the sync backward after it runs each hook once.

Hooks run with autograd off, as torch's reduction does.

[Note: hooks hold their state weakly] A tensor's post-accumulate-grad hooks
are held by the tensor's C++ side as well as by its Python dict, so the
collector cannot see them: a hook that holds, even indirectly, the object
that holds the tensor (a fully_shard state holds its group, which holds the
unsharded parameters; an FSDP1 unit holds its flat buffer; overlap_offload's
pipeline holds the model) keeps the whole model alive after the user drops
it. Every hook flatshard registers on a parameter therefore holds its state
through a weak reference (fsdp2/state.py's arrival, fsdp/unit.py's
post-backward, offload_pipeline.py's landing); tests/test_lifetime.py frees
wrapped models as torch's are freed.

Imports: torch only.
"""
import torch


def run_hooks(params):
    """Each of `params`' hooks, parameter by parameter in order: hook(param).
    Nothing to do (no parameter has a hook) costs one attribute read each."""
    due = [p for p in params if getattr(p, "_post_accumulate_grad_hooks", None)]
    if not due:
        return
    with torch.no_grad():
        for p in due:
            for hook in tuple(p._post_accumulate_grad_hooks.values()):
                hook(p)
