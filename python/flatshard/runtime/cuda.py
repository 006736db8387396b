"""CUDA kernels for device tensors (csrc/cuda/, extension flatshard._C_cuda).

The CUDA side of the C core: cast, copy-in/copy-out of a unit's parameters in
one launch (`pack`/`unpack`), scaled accumulation, fused Adam/AdamW/SGD over
one fp32 shard per launch, and one-pass partial norms. Each call checks its
tensors, then enqueues on the current stream (or `stream=`): no host
synchronisation, no allocation except the result of `norm_partial`.

`_C_cuda` is built only where nvcc was found; `built()` says whether it was,
`available()` whether it can run here (a GPU that torch sees). Calls without
it raise NotBuiltError. The NCCL backend is in cuda_nccl.py.
"""
import torch

from ..errors import bad_type, bad_value, not_built
from ..tensors import dtype_code

try:
    from .. import _C_cuda
except ImportError:  # built without nvcc
    _C_cuda = None

__all__ = ["built", "available", "runtime_info", "cast_", "pack", "unpack", "scale_accumulate_",
           "norm_partial", "adam_step_", "sgd_step_"]


def built():
    """Whether this installation has the CUDA kernels (nvcc was found)."""
    return _C_cuda is not None


def available():
    """Whether the CUDA kernels can run here: built, and torch sees a GPU."""
    return _C_cuda is not None and torch.cuda.is_available()


def runtime_info():
    """dict of runtime_version, driver_version, device_count, error (or None
    when not built); never raises for a missing GPU or driver."""
    return _C_cuda.runtime_info() if _C_cuda is not None else None


def _need(what):
    if _C_cuda is None:
        raise not_built(what, "cuda", "flatshard was built without nvcc; reinstall with a CUDA "
                        "toolkit on PATH (or CUDA_HOME set)")


def _dev(what, t, dtypes=None, device=None):
    if not torch.is_tensor(t) or t.device.type != "cuda" or not t.is_contiguous():
        desc = f"{t.dtype} on {t.device}" if torch.is_tensor(t) else type(t).__name__
        raise bad_type(what, desc, "a contiguous CUDA tensor")
    if dtypes is not None and t.dtype not in dtypes:
        raise bad_type(what, t.dtype, f"one of {', '.join(map(str, dtypes))}")
    if device is not None and t.device != device:
        raise bad_value(what, str(t.device), f"expected a tensor on {device} (one device per call)")
    if device is None and t.device.index != torch.cuda.current_device():
        # kernels launch on the current device; another device's memory would fault
        raise bad_value(what, str(t.device), f"the current CUDA device is "
                        f"{torch.cuda.current_device()}",
                        f"call it inside `with torch.cuda.device({t.device.index}):`")
    return t


def stream_handle(stream=None, device=None):
    """torch's stream (the current one by default) as the int the kernels take."""
    if stream is None:
        stream = torch.cuda.current_stream(device)
    return stream.cuda_stream


FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def cast_(dst, src, stream=None):
    """dst.copy_(src) with a dtype cast (round to nearest even), one launch."""
    _need("cast_")
    _dev("cast_: dst", dst)
    _dev("cast_: src", src, device=dst.device)
    if dst.numel() != src.numel():
        raise bad_value("cast_: src", tuple(src.shape), f"expected {dst.numel()} elements")
    if dst.dtype != src.dtype and (dst.dtype not in FLOATS or src.dtype not in FLOATS):
        raise bad_type("cast_: src", src.dtype, f"{dst.dtype}, or both floating point")
    _C_cuda.cast(dst.data_ptr(), dtype_code(dst.dtype), src.data_ptr(), dtype_code(src.dtype),
                 dst.numel(), stream_handle(stream, dst.device))
    return dst


def _segments(flat, tensors, offsets, what):
    _dev(f"{what}: flat", flat)
    if offsets is None:
        offsets, at = [], 0
        for t in tensors:
            offsets.append(at)
            at += t if isinstance(t, int) else t.numel()
    if len(offsets) != len(tensors):
        raise bad_value(f"{what}: offsets", len(offsets), f"expected {len(tensors)} offsets")
    segs = []
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        if isinstance(t, int):  # a run of zeros of this length (padding)
            segs.append((0, 0, off, t, dtype_code(flat.dtype)))
            n = t
        else:
            _dev(f"{what}: tensor {i}", t, device=flat.device)
            if t.dtype != flat.dtype and (t.dtype not in FLOATS or flat.dtype not in FLOATS):
                raise bad_type(f"{what}: tensor {i}", t.dtype, f"{flat.dtype} or floating point")
            segs.append((t.data_ptr(), 0, off, t.numel(), dtype_code(t.dtype)))
            n = t.numel()
        if off < 0 or off + n > flat.numel():
            raise bad_value(f"{what}: offset {i}", off, f"segment of {n} elements must fit in "
                            f"the flat buffer of {flat.numel()}")
    return segs


def pack(flat, tensors, offsets=None, stream=None):
    """Copy-in: flat[off_i : off_i + numel_i] = tensors[i] (cast to flat's
    dtype), every tensor in one launch (per 64). An int in `tensors` writes
    that many zeros (padding). offsets default to back-to-back."""
    _need("pack")
    segs = _segments(flat, tensors, offsets, "pack")
    _C_cuda.pack(flat.data_ptr(), dtype_code(flat.dtype), segs, stream_handle(stream, flat.device))
    return flat


def unpack(flat, tensors, offsets=None, stream=None):
    """Copy-out: tensors[i] = flat[off_i : off_i + numel_i] (cast), one launch."""
    _need("unpack")
    if any(isinstance(t, int) for t in tensors):
        raise bad_type("unpack: tensors", "int", "tensors only (padding is not copied out)")
    segs = _segments(flat, tensors, offsets, "unpack")
    _C_cuda.unpack(flat.data_ptr(), dtype_code(flat.dtype), segs,
                   stream_handle(stream, flat.device))


def scale_accumulate_(dst, src, scale=1.0, accumulate=True, stream=None):
    """dst = (dst if accumulate else 0) + scale * src, f32 math (f64 for f64)."""
    _need("scale_accumulate_")
    _dev("scale_accumulate_: dst", dst, FLOATS)
    _dev("scale_accumulate_: src", src, FLOATS, device=dst.device)
    if dst.numel() != src.numel():
        raise bad_value("scale_accumulate_: src", tuple(src.shape),
                        f"expected {dst.numel()} elements")
    _C_cuda.scale_accumulate(dst.data_ptr(), dtype_code(dst.dtype), src.data_ptr(),
                             dtype_code(src.dtype), dst.numel(), float(scale), bool(accumulate),
                             stream_handle(stream, dst.device))
    return dst


def norm_partial(x, norm_type=2.0, stream=None):
    """This shard's part of a gradient norm, as a float64 device scalar:
    sum of squares for norm_type 2, max |x| for inf. No host synchronisation."""
    _need("norm_partial")
    _dev("norm_partial: x", x, FLOATS)
    if norm_type not in (2, 2.0, float("inf")):
        raise bad_value("norm_type", norm_type, "expected 2.0 or inf")
    out = torch.empty((), dtype=torch.float64, device=x.device)
    _C_cuda.norm_partial(x.data_ptr(), dtype_code(x.dtype), x.numel(), norm_type != 2,
                         out.data_ptr(), stream_handle(stream, x.device))
    return out


def _scalar_ptr(what, t, device):
    if t is None:
        return 0
    _dev(what, t, (torch.float32,), device=device)
    if t.numel() != 1:
        raise bad_value(what, tuple(t.shape), "expected a one-element float32 tensor")
    return t.data_ptr()


def _opt_buffers(owner, param, named):
    n = param.numel()
    _dev(f"{owner}: param", param, (torch.float32,))
    for name, t in named:
        if t is not None:
            _dev(f"{owner}: {name}", t, (torch.float32,), device=param.device)
            if t.numel() != n:
                raise bad_value(f"{owner}: {name}", tuple(t.shape), f"expected {n} elements")


def _copy_arg(owner, copy, param):
    if copy is None:
        return 0, dtype_code(torch.bfloat16)
    _dev(f"{owner}: copy", copy, (torch.bfloat16, torch.float16), device=param.device)
    if copy.numel() != param.numel():
        raise bad_value(f"{owner}: copy", tuple(copy.shape), f"expected {param.numel()} elements")
    return copy.data_ptr(), dtype_code(copy.dtype)


def adam_step_(param, grad, exp_avg, exp_avg_sq, step, *, lr, betas=(0.9, 0.999), eps=1e-8,
               weight_decay=1e-2, decoupled=True, maximize=False, max_exp_avg_sq=None,
               copy=None, found_inf=None, grad_scale=None, stream=None):
    """One fused Adam (decoupled=False) / AdamW step over one fp32 shard.

    step: the step number after this update (int >= 1), or torch's fused
    state: a float32 device tensor already incremented, read on the device.
    found_inf (float32 device scalar): nonzero skips the update (the caller
    then takes back its step increment, as torch's fused optimizers do).
    grad_scale: gradients are divided by it. copy: a bf16/fp16 tensor that
    receives the updated parameters in the same pass."""
    _need("adam_step_")
    _opt_buffers("adam_step_", param, (("grad", grad), ("exp_avg", exp_avg),
                                       ("exp_avg_sq", exp_avg_sq),
                                       ("max_exp_avg_sq", max_exp_avg_sq)))
    step_ptr, step_int = 0, 1
    if torch.is_tensor(step):
        step_ptr = _scalar_ptr("adam_step_: step", step, param.device)
    elif isinstance(step, int) and not isinstance(step, bool) and step >= 1:
        step_int = step
    else:
        raise bad_value("adam_step_: step", step, "expected an int >= 1 or a float32 device "
                        "tensor")
    copy_ptr, copy_code = _copy_arg("adam_step_", copy, param)
    _C_cuda.adam_step(
        param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
        max_exp_avg_sq.data_ptr() if max_exp_avg_sq is not None else 0, copy_ptr, copy_code,
        param.numel(), lr=float(lr), beta1=float(betas[0]), beta2=float(betas[1]),
        eps=float(eps), weight_decay=float(weight_decay), step=step_int,
        decoupled=bool(decoupled), maximize=bool(maximize), step_ptr=step_ptr,
        found_inf=_scalar_ptr("found_inf", found_inf, param.device),
        grad_scale=_scalar_ptr("grad_scale", grad_scale, param.device),
        stream=stream_handle(stream, param.device))


def sgd_step_(param, grad, momentum_buf=None, *, lr, momentum=0.0, dampening=0.0,
              weight_decay=0.0, nesterov=False, maximize=False, first_step=False, copy=None,
              found_inf=None, grad_scale=None, stream=None):
    """One fused SGD step over one fp32 shard (torch's rule; first_step sets
    the momentum buffer to the gradient)."""
    _need("sgd_step_")
    _opt_buffers("sgd_step_", param, (("grad", grad), ("momentum_buf", momentum_buf)))
    if momentum != 0 and momentum_buf is None:
        raise bad_value("sgd_step_: momentum_buf", None, "momentum != 0 needs a buffer")
    copy_ptr, copy_code = _copy_arg("sgd_step_", copy, param)
    _C_cuda.sgd_step(
        param.data_ptr(), grad.data_ptr(), momentum_buf.data_ptr() if momentum != 0 else 0,
        copy_ptr, copy_code, param.numel(), lr=float(lr), momentum=float(momentum),
        dampening=float(dampening), weight_decay=float(weight_decay), nesterov=bool(nesterov),
        maximize=bool(maximize), first_step=bool(first_step),
        found_inf=_scalar_ptr("found_inf", found_inf, param.device),
        grad_scale=_scalar_ptr("grad_scale", grad_scale, param.device),
        stream=stream_handle(stream, param.device))
