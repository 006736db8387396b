"""A mixed-precision policy that casts nothing: every dtype it names is the
one the parameters (gradients, buffers, outputs) have already, so the model
trains in full precision while the script says bfloat16 (typically
param_dtype=torch.float32 with float32 parameters, or a model already
cast to bfloat16 and then given param_dtype=torch.bfloat16: no master
weights in float32 then, which is rarely what was meant).

  fsdp1(plans, buffers)        FSDP1's MixedPrecision, per unit, at wrap time
  fully_shard(label, mp, ps)   fully_shard's MixedPrecisionPolicy, at its call
  output(state, dtype, out)    fully_shard's output_dtype at a state's first
                               forward: whether it changed any output

Imports: torch; this package.
"""
import weakref

import torch
from torch.utils._pytree import tree_leaves

from . import class_name, say


def _changes(want, have):
    """Whether casting tensors of dtypes `have` to `want` (None: no cast)
    changes any."""
    return want is not None and any(d != want for d in have)


def fsdp1(plans, buffers):
    """`plans`: the wrapper's UnitPlans (fsdp/unit_plan.py); `buffers`: the
    model's buffers. Warns when some unit has a MixedPrecision and no unit's
    changes a dtype: its parameters' (param_dtype), its gradients'
    (reduce_dtype against the dtype they would reduce in) or a buffer's."""
    floats = [b.dtype for b in buffers if b.is_floating_point()]
    given = None
    for up in plans:
        mp = up.cfg.mixed_precision
        if mp is None:
            continue
        given = given or mp
        dtypes = {key[0] for key, _ in up.groups}
        compute = mp.param_dtype
        if _changes(compute, dtypes) or _changes(mp.buffer_dtype, floats) or \
                _changes(mp.reduce_dtype, {compute} if compute else dtypes):
            return
    if given is not None:
        have = sorted({str(key[0]) for up in plans for key, _ in up.groups})
        say("mixed_precision", f"mixed_precision={given} changes no dtype: the parameters are "
            f"{', '.join(have)} already (and the buffers and gradients in the dtypes it "
            "names), so the model computes and reduces as without it. Give param_dtype the "
            "dtype to compute in (e.g. torch.bfloat16) with the parameters in float32, or "
            "pass mixed_precision=None")


def fully_shard(label, mp, params):
    """fully_shard's `mp` over `params` (of the modules `label`): warns when
    it names a param_dtype or reduce_dtype and neither changes a dtype, and no
    param_dtype_override_fn is given. output_dtype is judged at the first
    forward (output())."""
    if mp.param_dtype is None and mp.reduce_dtype is None:
        return
    if getattr(mp, "param_dtype_override_fn", None) is not None:
        return
    dtypes = {p.dtype for p in params}
    compute = mp.param_dtype
    if _changes(compute, dtypes) or _changes(mp.reduce_dtype, {compute} if compute else dtypes):
        return
    say("mp_policy", f"fully_shard({label}, mp_policy={mp}) changes no dtype: the parameters "
        f"are {', '.join(sorted(map(str, dtypes)))} already, so the group computes and reduces "
        "as without it. Give param_dtype the dtype to compute in (e.g. torch.bfloat16) with "
        "the parameters in float32, or leave mp_policy out")


_SEEN = weakref.WeakSet()  # states whose first forward's outputs were looked at


def output(state, dtype, out):
    """At `state`'s first forward only: warns when its output_dtype=`dtype`
    cast no floating output (they came out in `dtype`)."""
    if state in _SEEN:
        return
    _SEEN.add(state)
    floats = [t.dtype for t in tree_leaves(out)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if floats and not _changes(dtype, floats):
        say("output_dtype", f"MixedPrecisionPolicy(output_dtype={dtype}) of the fully_shard "
            f"module {class_name(state.modules[0])}{state.label} changed no output: its "
            f"forward returned {dtype} already. Leave output_dtype out, or name the dtype the "
            "caller needs (e.g. torch.float32 after a bfloat16 forward)")
