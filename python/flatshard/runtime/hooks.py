"""What flatshard._C.Hook's lanes call (csrc/glue/py_hooks.h), handed to
the C side once, and the switch that keeps every hook event in Python.

Both wrappers' hooks are _C.Hook objects: the common case of an event runs
in C, every other case is the Python hook ([Note: hook lane] in
fsdp2/state.py, [Note: unit hook lane] in fsdp/unit.py). The lanes call
torch's and flatshard's functions given here, never a Python function of
the wrappers' beyond the fallbacks and these.

Imports: torch, _C, envvars, options, tensors, and runtime's observe,
grad_hooks, heap and trees.
"""
import torch

from .. import _C, envvars
from ..options import BackwardPrefetch
from ..tensors import DTYPE_CODES
from . import observe
from .grad_hooks import run_hooks
from .heap import HEAP
from .trees import hook_before_backward

ENV = "FLATSHARD_C_HOOKS"
_like = []  # fully_shard's, once given


def give_tools(like=None):
    """Hand the C lanes what they call (again: each call gives them all).
    like: fully_shard's sharded-gradient DTensor maker (fsdp2.param._like),
    given by fsdp2/state.py; until then fully_shard's post-backward lane is
    closed, and the FSDP1 wrapper needs none."""
    if like is not None and not _like:
        _like.append(like)
    _C.set_hook_tools(
        profiling=observe.profiling,
        stack_len=getattr(torch._C, "_len_torch_dispatch_stack", None),
        grad_enabled=torch.is_grad_enabled, set_grad=torch._C._set_grad_enabled,
        tensor_type=torch.Tensor, hook_outputs=hook_before_backward, dtype_codes=DTYPE_CODES,
        empty=torch.empty, empty_like=torch.empty_like, contiguous=torch.contiguous_format,
        split=torch.split_with_sizes, like=_like[0] if _like else None, run_hooks=run_hooks,
        heap_freed=HEAP.freed, backward_pre=BackwardPrefetch.BACKWARD_PRE)


def c_hooks_on():
    """FLATSHARD_C_HOOKS: whether the lanes may open (1, the default)."""
    return envvars.read_flag(ENV, True)
