"""What a tensor must be before its data pointer reaches the C core.

The C core reads and writes raw memory: it trusts that a pointer is the
start of `numel` elements of a known dtype, laid out densely. A tensor
subclass breaks that silently. A wrapper subclass (torch's TwoTensor,
float8 or NF4 weights, DTensor) has no storage of its own and reports a null
data pointer; another subclass may keep its data elsewhere. So every API
entry point checks its tensors here first and refuses the rest with an error
that names the tensor, instead of letting C crash the process.

Beside the check: the one dtype table of the C core, the alignment of flat
buffers, and the bytes a set of tensors really holds (storage_bytes). A leaf:
imports nothing of flatshard's but _C and errors.
"""
import torch
import torch.nn as nn

from . import _C
from .errors import ConfigTypeError, NotBuiltError

PLAIN_TYPES = (torch.Tensor, nn.Parameter)

# Every parameter in a flat buffer starts at a multiple of this many bytes, and
# every shard is a multiple of it: the rule is layout.h's (_C.align_numel).
ALIGN_BYTES = _C.ALIGN_BYTES

# The one table of dtypes the C core moves and computes on (csrc/core/fs_dtype.h).
DTYPE_CODES = {
    torch.float32: _C.F32, torch.float16: _C.F16, torch.bfloat16: _C.BF16,
    torch.float64: _C.F64, torch.uint8: _C.U8, torch.int32: _C.I32, torch.int64: _C.I64,
}


def dtype_code(dtype):
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"flatshard: dtype {dtype} is not supported by the C core; "
                        f"supported: {', '.join(str(d) for d in DTYPE_CODES)}") from None


_CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def compute_dtype(param_dtype, dtype, override=None):
    """The dtype a parameter of `dtype` is gathered and computed in: the
    policy's param_dtype (None: its own dtype) for a floating parameter, its
    own for any other. override: torch 2.15's param_dtype_override_fn's
    answer for it (None, param_dtype, or its own dtype to keep it), which
    replaces param_dtype when given."""
    if not dtype.is_floating_point:
        return dtype
    return (override if override is not None else param_dtype) or dtype


def reduce_dtype(rule, set_dtype, compute, accumulate=()):
    """The dtype gradients are reduced in ([Note: reduce dtype rule] in
    csrc/core/reduce_rule.h, the rule's one implementation): set_dtype (the
    policy's reduce_dtype) when given; else by `rule`: "param_dtype" (FSDP1;
    fully_shard up to torch 2.14) the compute dtype, "grad_dtype" (fully_shard
    from torch 2.15, torch_facts.reduce_dtype_rule) the parameters'
    accumulation dtypes `accumulate`, promoted."""
    code = _C.reduce_dtype(rule, None if set_dtype is None else dtype_code(set_dtype),
                           dtype_code(compute), [dtype_code(d) for d in accumulate])
    return _CODE_DTYPES[code]


def check_plain(t, what, api):
    """Raise NotBuiltError unless `t` is a plain strided tensor on the CPU, a
    CUDA device or the meta device (shapes only), and ConfigTypeError unless
    its dtype is one the C core knows.

    what: how the user names it ("parameter 'layers.0.weight'");
    api: the entry point refusing it ("fully_shard")."""
    kind = type(t)
    if kind not in PLAIN_TYPES:
        raise NotBuiltError(
            f"flatshard: {api}: {what} is a {kind.__module__}.{kind.__qualname__} (a tensor "
            f"subclass); flatshard moves plain torch.Tensor / nn.Parameter data only, except "
            f"that fully_shard runs a subclass that defines torch's all-gather extension "
            f"(fsdp_pre_all_gather and fsdp_post_all_gather). Keep such modules out of the "
            f"wrap (ignored_params / ignored_states) or use plain parameters")
    if t.layout is not torch.strided:
        raise NotBuiltError(f"flatshard: {api}: {what} has layout {t.layout}; only "
                            f"torch.strided (dense) tensors are supported")
    if t.dtype not in DTYPE_CODES:  # a TypeError too, as the C core's dtype table raises
        raise ConfigTypeError(f"flatshard: {api}: {what} has dtype {t.dtype}; supported: "
                              f"{', '.join(str(d) for d in DTYPE_CODES)}")
    if t.device.type not in ("cpu", "cuda", "meta"):
        raise NotBuiltError(f"flatshard: {api}: {what} is on {t.device}; supported: "
                            f"cpu, cuda")


def is_plain(t):
    """Whether t is a plain torch.Tensor or nn.Parameter (no subclass)."""
    return type(t) in PLAIN_TYPES


def to_plain(t):
    """A tensor subclass's values as a new plain tensor of its shape, dtype
    and device, written by the class's own copy_ (its __torch_dispatch__
    decides what it holds): what torch's fully_shard copy-ins write when
    they meet one (a TwoTensor writes both of its halves in turn, so the
    second one's values are kept)."""
    plain = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    with torch.no_grad():
        plain.copy_(t)
    return plain


def is_dense(t, dtype, devices):
    """Whether `t` is a plain, strided, contiguous tensor of `dtype` on one of
    `devices` (device type names): check_plain's rule and more, as a bool,
    with no message built. The fast path of checks made on every step; when
    it says no, the full check says what is wrong."""
    return type(t) in PLAIN_TYPES and t.layout is torch.strided and t.dtype is dtype and \
        (t.is_cpu and "cpu" in devices or t.is_cuda and "cuda" in devices) and \
        t.is_contiguous()


def storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors`, each storage counted
    once (views share one); None, non-tensors and empty storages add nothing.
    A DTensor (fully_shard's shards) counts its local tensor's."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        s = getattr(t, "_local_tensor", t).untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total
