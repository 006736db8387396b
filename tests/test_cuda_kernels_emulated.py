"""flatshard's CUDA kernels (csrc/cuda/*.cu), run without a GPU.

The same sources are compiled by the host C++ compiler against
tests/cuda_emu/ (CUDA's runtime and device builtins over host memory, each
block's threads run as fibers so barriers and warp shuffles keep their
meaning; tests/cuda_emu/emu_build.py) and called through their C entry
points with CPU tensors on the NULL stream, which runs work at once. Grids
are a few blocks, so every grid-stride loop goes round several times.

References are independent of the kernels: torch's casts and optimizers,
float64 sums, and the CPU core's scalar optimizer path. Each output buffer
has guard elements on both sides that must come back untouched. On a GPU,
tests/test_cuda.py runs the same kernels on the device."""
import ctypes
import sys
from pathlib import Path

import pytest
import torch

from flatshard import _C

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emu"))
import emu_build  # noqa: E402

CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3,
         torch.uint8: 4, torch.int32: 5, torch.int64: 6}
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SIZES = (1, 3, 4, 5, 255, 256, 257, 1031, 4099)  # odd, SIMD width +/- 1, > one grid pass
GUARD = 32  # elements: keeps 16-byte alignment, so the optimizer's vector path runs
INVALID = 1  # cudaErrorInvalidValue


class Segment(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("ptr_offset", ctypes.c_int64),
                ("flat_offset", ctypes.c_int64), ("numel", ctypes.c_int64),
                ("dtype", ctypes.c_int32)]


class AdamArgs(ctypes.Structure):
    _fields_ = [("param", ctypes.c_void_p), ("grad", ctypes.c_void_p),
                ("exp_avg", ctypes.c_void_p), ("exp_avg_sq", ctypes.c_void_p),
                ("max_exp_avg_sq", ctypes.c_void_p), ("copy", ctypes.c_void_p),
                ("copy_dtype", ctypes.c_int), ("n", ctypes.c_int64),
                ("lr", ctypes.c_float), ("beta1", ctypes.c_float), ("beta2", ctypes.c_float),
                ("eps", ctypes.c_float), ("weight_decay", ctypes.c_float),
                ("step", ctypes.c_int64), ("step_dev", ctypes.c_void_p),
                ("decoupled", ctypes.c_int), ("maximize", ctypes.c_int),
                ("found_inf", ctypes.c_void_p), ("grad_scale", ctypes.c_void_p)]


class SgdArgs(ctypes.Structure):
    _fields_ = [("param", ctypes.c_void_p), ("grad", ctypes.c_void_p),
                ("momentum_buf", ctypes.c_void_p), ("copy", ctypes.c_void_p),
                ("copy_dtype", ctypes.c_int), ("n", ctypes.c_int64),
                ("lr", ctypes.c_float), ("momentum", ctypes.c_float),
                ("dampening", ctypes.c_float), ("weight_decay", ctypes.c_float),
                ("nesterov", ctypes.c_int), ("maximize", ctypes.c_int),
                ("first_step", ctypes.c_int), ("found_inf", ctypes.c_void_p),
                ("grad_scale", ctypes.c_void_p)]


@pytest.fixture(scope="module")
def lib():
    if not emu_build.available():
        pytest.skip("needs gcc/g++ and the csrc/ sources")
    so = ctypes.CDLL(str(emu_build.build() / "libfs_cuda_kernels.so"))
    p, i, i64, d = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double
    sigs = {"fs_cuda_cast": [p, i, p, i, i64, p],
            "fs_cuda_cast2d": [p, i64, i, p, i64, i, i64, i64, p],
            "fs_cuda_scale_accumulate": [p, i, p, i, i64, d, i, p],
            "fs_cuda_pack": [p, i, p, i, p], "fs_cuda_unpack": [p, i, p, i, p],
            "fs_cuda_adam_step": [p, p], "fs_cuda_sgd_step": [p, p],
            "fs_cuda_norm_partial": [p, i, i64, i, p, p],
            "fs_cuda_quantize": [p, p, i, i64, i, i64, p],
            "fs_cuda_dequantize": [p, i, p, i64, i, i64, i, p]}
    for name, argtypes in sigs.items():
        fn = getattr(so, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return so


def guarded(t):
    """t's values inside a larger buffer whose edges hold a fixed pattern."""
    whole = torch.empty(t.numel() + 2 * GUARD, dtype=t.dtype)
    if t.dtype.is_floating_point:
        whole.fill_(-12345.0 if t.dtype != torch.float16 else -1234.0)
    else:
        whole.fill_(77)
    body = whole[GUARD:GUARD + t.numel()]
    body.copy_(t.reshape(-1))
    return whole, body


def guards_intact(whole):
    edge = torch.cat([whole[:GUARD], whole[-GUARD:]])
    want = -12345.0 if whole.dtype.is_floating_point and whole.dtype != torch.float16 else \
        -1234.0 if whole.dtype == torch.float16 else 77
    return bool((edge == want).all())


def awkward_values(n, dtype, seed):
    """Normal values with some zeros, negative zeros, tiny and huge ones."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 3
    if n >= 8:
        x[0], x[1], x[2] = 0.0, -0.0, 1e-30
        x[3], x[4] = 7e4, -1e5  # beyond float16's range
        x[5] = 6.1e-5  # near float16's smallest normal
    return x.to(dtype)


def same_bits(a, b):
    if a.dtype in (torch.float16, torch.bfloat16):
        a, b = a.view(torch.int16), b.view(torch.int16)
    elif a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    elif a.dtype == torch.float64:
        a, b = a.view(torch.int64), b.view(torch.int64)
    return torch.equal(a, b)


# ---------------------------------------------------------------------------
# cast, scale_accumulate

@pytest.mark.parametrize("src_t", FLOATS)
@pytest.mark.parametrize("dst_t", FLOATS)
def test_cast_matches_torch_bit_for_bit(lib, src_t, dst_t):
    for n in SIZES:
        src = awkward_values(n, src_t, n)
        whole, dst = guarded(torch.zeros(n, dtype=dst_t))
        assert lib.fs_cuda_cast(dst.data_ptr(), CODES[dst_t], src.data_ptr(), CODES[src_t],
                                n, None) == 0
        want = src.to(dst_t) if not (src_t == torch.float64 and dst_t in
                                     (torch.float16, torch.bfloat16)) else \
            src.to(torch.float32).to(dst_t)  # documented: f64 narrows through f32
        assert same_bits(dst, want), (src_t, dst_t, n)
        assert guards_intact(whole)


@pytest.mark.parametrize("src_t,dst_t", [(torch.float32, torch.float32),
                                         (torch.bfloat16, torch.float32),
                                         (torch.float32, torch.bfloat16),
                                         (torch.float64, torch.float16)])
@pytest.mark.parametrize("height,width", [(1, 7), (3, 5), (17, 1), (4, 0), (0, 3)])
def test_cast2d_matches_torch_on_strided_rows(lib, src_t, dst_t, height, width):
    """A parameter sharded on a later dim: `height` runs of `width` elements,
    read at one pitch and written at another; nothing between runs written."""
    src_pitch, dst_pitch = width + 3, width + 5
    src = awkward_values(max(height * src_pitch, 1), src_t, height * 31 + width)
    whole, dst = guarded(torch.zeros(max(height * dst_pitch, 1), dtype=dst_t))
    before = dst.clone()
    assert lib.fs_cuda_cast2d(dst.data_ptr(), dst_pitch, CODES[dst_t], src.data_ptr(),
                              src_pitch, CODES[src_t], width, height, None) == 0
    narrow = src_t == torch.float64 and dst_t in (torch.float16, torch.bfloat16)
    for j in range(height):
        run = src[j * src_pitch:j * src_pitch + width]
        want = (run.to(torch.float32) if narrow else run).to(dst_t)
        assert same_bits(dst[j * dst_pitch:j * dst_pitch + width], want), (j, src_t, dst_t)
        gap = slice(j * dst_pitch + width, (j + 1) * dst_pitch)
        assert same_bits(dst[gap], before[gap])
    assert guards_intact(whole)
    x = torch.zeros(8)
    assert lib.fs_cuda_cast2d(x.data_ptr(), 2, 0, x.data_ptr(), 4, 0, 3, 2, None) == INVALID


def test_cast_refuses_bad_arguments(lib):
    x = torch.zeros(4)
    assert lib.fs_cuda_cast(x.data_ptr(), 0, x.data_ptr(), 0, -1, None) == INVALID
    assert lib.fs_cuda_cast(x.data_ptr(), 99, x.data_ptr(), 0, 4, None) == INVALID
    assert lib.fs_cuda_cast(None, 0, x.data_ptr(), 0, 4, None) == INVALID
    assert lib.fs_cuda_cast(None, 0, None, 0, 0, None) == 0  # nothing to do


@pytest.mark.parametrize("src_t", FLOATS)
@pytest.mark.parametrize("dst_t", FLOATS)
@pytest.mark.parametrize("accumulate", [0, 1])
def test_scale_accumulate_matches_float32_math(lib, src_t, dst_t, accumulate):
    scale = 1.0 / 3.0
    for n in (1, 5, 257, 4099):
        src = awkward_values(n, src_t, 1 + n).clamp(-1e4, 1e4)
        before = awkward_values(n, dst_t, 2 + n).clamp(-1e4, 1e4)
        whole, dst = guarded(before)
        assert lib.fs_cuda_scale_accumulate(dst.data_ptr(), CODES[dst_t], src.data_ptr(),
                                            CODES[src_t], n, scale, accumulate, None) == 0
        if src_t == dst_t == torch.float64:
            want = scale * src + before if accumulate else scale * src
        else:
            want = torch.tensor(scale, dtype=torch.float32) * src.float()
            if accumulate:
                want = want + before.float()
            want = want.to(dst_t)
        assert same_bits(dst, want), (src_t, dst_t, accumulate, n)
        assert guards_intact(whole)


# ---------------------------------------------------------------------------
# pack / unpack: every parameter of a unit in one launch

def segment_table(tensors, offsets, flat_t, padding):
    """Segments for `tensors` (each read from element offsets[k] on) laid out
    back to back in a flat buffer, with `padding` zero-filled elements
    (ptr NULL) after every fifth one."""
    segs, layout, pos = [], [], 0
    for k, (t, off) in enumerate(zip(tensors, offsets)):
        numel = t.numel() - off
        segs.append(Segment(t.data_ptr(), off, pos, numel, CODES[t.dtype]))
        layout.append((pos, t, off, numel))
        pos += numel
        if k % 5 == 4:
            segs.append(Segment(None, 0, pos, padding, CODES[flat_t]))
            pos += padding
    return (Segment * len(segs))(*segs), len(segs), pos, layout


@pytest.mark.parametrize("flat_t", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("count", [1, 63, 64, 65, 150])  # segments: one launch holds 64
def test_pack_then_unpack_against_torch(lib, flat_t, count):
    g = torch.Generator().manual_seed(count)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
    sizes = [int(s) for s in torch.randint(0, 300, (count,), generator=g)]
    sizes[0] = max(sizes[0], 2)
    tensors = [torch.randn(s, generator=g).to(dtypes[k % 4]) for k, s in enumerate(sizes)]
    offsets = [1 if t.numel() > 1 and k % 3 == 0 else 0 for k, t in enumerate(tensors)]
    table, n, total, layout = segment_table(tensors, offsets, flat_t, padding=7)
    whole, flat = guarded(torch.full((total,), 99.0, dtype=flat_t))
    assert lib.fs_cuda_pack(flat.data_ptr(), CODES[flat_t], table, n, None) == 0
    want = torch.zeros(total, dtype=flat_t)
    for pos, t, off, numel in layout:
        want[pos:pos + numel] = t[off:].to(flat_t)
    assert same_bits(flat, want)
    assert guards_intact(whole)

    # unpack into fresh tensors: each gets its flat range back, cast to its dtype
    outs = [torch.full_like(t, 5.0) for t in tensors]
    guards = [guarded(o) for o in outs]
    segs = [Segment(body.data_ptr(), off, pos, numel, CODES[t.dtype])
            for (pos, t, off, numel), (_, body) in zip(layout, guards)]
    table2 = (Segment * len(segs))(*segs)
    assert lib.fs_cuda_unpack(flat.data_ptr(), CODES[flat_t], table2, len(segs), None) == 0
    for (pos, t, off, numel), (whole_o, body) in zip(layout, guards):
        assert same_bits(body[off:], flat[pos:pos + numel].to(t.dtype))
        if off:  # elements before the segment are left alone
            assert body[0].item() == 5.0
        assert guards_intact(whole_o)


def test_pack_copies_raw_bits_for_equal_non_float_dtypes(lib):
    a = torch.arange(-50, 250, dtype=torch.int32)
    whole, flat = guarded(torch.zeros(300, dtype=torch.int32))
    table = (Segment * 1)(Segment(a.data_ptr(), 0, 0, 300, CODES[torch.int32]))
    assert lib.fs_cuda_pack(flat.data_ptr(), CODES[torch.int32], table, 1, None) == 0
    assert torch.equal(flat, a) and guards_intact(whole)


def test_pack_refuses_bad_segments(lib):
    x, i = torch.zeros(8), torch.zeros(8, dtype=torch.int32)
    bad = [Segment(x.data_ptr(), 0, 0, -1, 0),  # negative count
           Segment(x.data_ptr(), -1, 0, 4, 0),  # negative offset
           Segment(i.data_ptr(), 0, 0, 4, CODES[torch.int32]),  # int into a float buffer
           Segment(x.data_ptr(), 0, 0, 4, 42)]  # no such dtype
    for s in bad:
        assert lib.fs_cuda_pack(x.data_ptr(), 0, (Segment * 1)(s), 1, None) == INVALID
    # unpack to nowhere is refused; packing from nowhere means zeros
    assert lib.fs_cuda_unpack(x.data_ptr(), 0, (Segment * 1)(Segment(None, 0, 0, 4, 0)), 1,
                              None) == INVALID
    assert lib.fs_cuda_pack(x.data_ptr(), 0, None, -1, None) == INVALID


# ---------------------------------------------------------------------------
# optimizers

def ptr(t):
    return t.data_ptr() if t is not None else None


def cpu_adam(p, g, m, v, mx, copy, *, step, lr, betas, eps, wd, decoupled, maximize):
    _C.adam_step(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
                 mx.data_ptr() if mx is not None else 0, copy.data_ptr() if copy is not None
                 else 0, CODES[copy.dtype] if copy is not None else _C.BF16, p.numel(), lr=lr,
                 beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd, step=step,
                 decoupled=decoupled, maximize=maximize, simd="scalar")


def kernel_adam(lib, p, g, m, v, mx, copy, *, step, lr, betas, eps, wd, decoupled, maximize,
                step_dev=None, found_inf=None, grad_scale=None):
    a = AdamArgs(ptr(p), ptr(g), ptr(m), ptr(v), ptr(mx), ptr(copy),
                 CODES[copy.dtype] if copy is not None else 0, p.numel(), lr, betas[0], betas[1],
                 eps, wd, step, ptr(step_dev), decoupled, maximize, ptr(found_inf),
                 ptr(grad_scale))
    return lib.fs_cuda_adam_step(ctypes.byref(a), None)


def adam_state(n, seed, misalign, amsgrad, copy_t):
    """(param, grad, m, v, max) views, each `misalign` elements into its own
    guarded buffer (1 defeats the kernel's 16-byte path), and a copy."""
    g = torch.Generator().manual_seed(seed)
    made = []
    for k in range(5 if amsgrad else 4):
        base = torch.randn(n + misalign, generator=g)
        if k >= 2:
            base = base.abs() * 0.1
        whole, body = guarded(base)
        made.append((whole, body[misalign:]))
        assert (made[-1][1].data_ptr() % 16 == 0) == (misalign == 0)
    if not amsgrad:
        made.append((None, None))
    copy = guarded(torch.zeros(n, dtype=copy_t)) if copy_t else (None, None)
    return made, copy


@pytest.mark.parametrize("n", [1, 3, 4, 5, 17, 1031, 4099])
@pytest.mark.parametrize("misalign", [0, 1])
@pytest.mark.parametrize("variant", ["adamw", "adam_l2", "amsgrad_bf16", "maximize_f16"])
def test_adam_matches_the_cpu_scalar_path_bit_for_bit(lib, n, misalign, variant):
    amsgrad = variant == "amsgrad_bf16"
    copy_t = {"amsgrad_bf16": torch.bfloat16, "maximize_f16": torch.float16}.get(variant)
    hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, wd=0.1,
              decoupled=variant != "adam_l2", maximize=variant == "maximize_f16")
    made, (cwhole, copy) = adam_state(n, n, misalign, amsgrad, copy_t)
    ref = [None if b is None else b.clone() for _, b in made]
    ref_copy = None if copy is None else copy.clone()
    for step in (1, 2, 3):
        assert kernel_adam(lib, *[b for _, b in made], copy, step=step, **hp) == 0
        cpu_adam(*ref, ref_copy, step=step, **hp)
        for (whole, body), want in zip(made, ref):
            if body is not None:
                assert same_bits(body, want), (variant, n, misalign, step)
                assert guards_intact(whole)
        if copy is not None:
            assert same_bits(copy, ref_copy) and guards_intact(cwhole)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_matches_torch_over_many_steps(lib, amsgrad):
    n, steps = 1000, 40
    torch.manual_seed(0)
    p = torch.randn(n)
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05,
                            amsgrad=amsgrad)
    m, v = torch.zeros(n), torch.zeros(n)
    mx = torch.zeros(n) if amsgrad else None
    for step in range(1, steps + 1):
        g = torch.randn(n)
        ref.grad = g.clone()
        opt.step()
        assert kernel_adam(lib, p, g, m, v, mx, None, step=step, lr=1e-2, betas=(0.9, 0.95),
                           eps=1e-8, wd=0.05, decoupled=1, maximize=0) == 0
    torch.testing.assert_close(p, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-5, atol=1e-7)


def test_adam_reads_step_scale_and_found_inf_from_the_device(lib):
    n = 1031
    torch.manual_seed(1)
    p, g = torch.randn(n), torch.randn(n)
    m, v = torch.randn(n) * 0.1, torch.rand(n) * 0.1
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.01, decoupled=1, maximize=0)
    # step from a device scalar (torch's fused-optimizer state['step'])
    want = [t.clone() for t in (p, g, m, v)]
    cpu_adam(*want, None, None, step=7, **hp)
    got = [t.clone() for t in (p, g, m, v)]
    step_dev = torch.tensor(7.0)
    assert kernel_adam(lib, *got, None, None, step=0, step_dev=step_dev, **hp) == 0
    assert all(same_bits(a, b) for a, b in zip(got, want))
    # a gradient scale (a power of two: dividing is exact) and found_inf == 0
    scale, found = torch.tensor(1024.0), torch.tensor(0.0)
    got = [p.clone(), g * 1024.0, m.clone(), v.clone()]
    assert kernel_adam(lib, *got, None, None, step=7, grad_scale=scale, found_inf=found,
                       **hp) == 0
    assert all(same_bits(a, b) for a, b in zip([got[0], got[2], got[3]],
                                               [want[0], want[2], want[3]]))
    # found_inf != 0: nothing moves
    got = [t.clone() for t in (p, g, m, v)]
    assert kernel_adam(lib, *got, None, None, step=7, found_inf=torch.tensor(1.0), **hp) == 0
    assert all(torch.equal(a, b) for a, b in zip(got, (p, g, m, v)))


def test_adam_refuses_bad_arguments(lib):
    x = torch.zeros(8)
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, wd=0.0, decoupled=1, maximize=0)
    assert kernel_adam(lib, x, x, x, x, None, None, step=0, **hp) == INVALID  # step < 1
    assert kernel_adam(lib, x, x, x, x, None, torch.zeros(8, dtype=torch.float64), step=1,
                       **hp) == INVALID  # copy must be bf16/f16
    a = AdamArgs(None, None, None, None, None, None, 0, 8, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1)
    assert lib.fs_cuda_adam_step(ctypes.byref(a), None) == INVALID
    a.n = 0
    assert lib.fs_cuda_adam_step(ctypes.byref(a), None) == 0


@pytest.mark.parametrize("n", [1, 5, 257, 4099])
@pytest.mark.parametrize("momentum,nesterov,dampening", [(0.0, 0, 0.0), (0.9, 0, 0.1),
                                                         (0.9, 1, 0.0)])
@pytest.mark.parametrize("maximize", [0, 1])
def test_sgd_matches_torch_and_the_cpu_path(lib, n, momentum, nesterov, dampening, maximize):
    torch.manual_seed(n)
    p = torch.randn(n)
    ref = p.clone().requires_grad_()
    opt = torch.optim.SGD([ref], lr=0.05, momentum=momentum, dampening=dampening,
                          weight_decay=0.01, nesterov=bool(nesterov), maximize=bool(maximize))
    cpu_p = p.clone()
    cpu_buf = torch.zeros(n)
    pw, pb = guarded(p)
    bw, buf = guarded(torch.zeros(n))
    cw, copy = guarded(torch.zeros(n, dtype=torch.bfloat16))
    for step in range(4):
        g = torch.randn(n)
        ref.grad = g.clone()
        opt.step()
        a = SgdArgs(pb.data_ptr(), g.data_ptr(), buf.data_ptr() if momentum else None,
                    copy.data_ptr(), CODES[torch.bfloat16], n, 0.05, momentum, dampening, 0.01,
                    nesterov, maximize, step == 0)
        assert lib.fs_cuda_sgd_step(ctypes.byref(a), None) == 0
        _C.sgd_step(cpu_p.data_ptr(), g.data_ptr(), cpu_buf.data_ptr() if momentum else 0, 0,
                    _C.BF16, n, lr=0.05, momentum=momentum, dampening=dampening,
                    weight_decay=0.01, nesterov=bool(nesterov), maximize=bool(maximize),
                    first_step=step == 0)
    assert same_bits(pb, cpu_p)
    torch.testing.assert_close(pb, ref.detach(), rtol=1e-6, atol=1e-7)
    assert same_bits(copy, pb.to(torch.bfloat16))
    assert guards_intact(pw) and guards_intact(bw) and guards_intact(cw)


# ---------------------------------------------------------------------------
# norms: block reduction with warp shuffles and atomics

def kernel_norm(lib, x, inf):
    out = torch.tensor([123.0], dtype=torch.float64)
    assert lib.fs_cuda_norm_partial(x.data_ptr() if x.numel() else None, CODES[x.dtype],
                                    x.numel(), inf, out.data_ptr(), None) == 0
    return out.item()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [0, 1, 31, 33, 256, 257, 4099, 70001])
def test_norm_partial_against_float64(lib, dtype, n):
    x = (torch.randn(n, generator=torch.Generator().manual_seed(n)) * 4).to(dtype)
    x64 = x.double()
    squares = kernel_norm(lib, x, 0)
    assert squares == pytest.approx((x64 * x64).sum().item(), rel=1e-12, abs=0.0)
    assert kernel_norm(lib, x, 1) == (x64.abs().max().item() if n else 0.0)


@pytest.mark.parametrize("inf", [0, 1])
def test_norm_partial_propagates_nan_and_inf(lib, inf):
    for where in (0, 700, 4098):
        x = torch.randn(4099)
        x[where] = float("nan")
        assert kernel_norm(lib, x, inf) != kernel_norm(lib, x, inf)  # NaN
        x[where] = float("-inf")
        assert kernel_norm(lib, x, inf) == float("inf")


# ---------------------------------------------------------------------------
# quantization (quant.cu) against the CPU kernels, themselves held against a
# float64 model in tests/test_quant_kernels.py


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [32, 256])
@pytest.mark.parametrize("src_t", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_matches_the_cpu_kernels(lib, bits, block, src_t):
    g = torch.Generator().manual_seed(bits + block)
    for n in (0, 1, block - 1, block, block + 1, 3 * block + 7, 1031, 4099):
        x = (torch.randn(n, generator=g) * 4).to(src_t)
        if n > 40:
            x[block // 2] = float("inf")  # a non-finite block: NaN scale, zero codes
        nbytes = max(_C.quant_payload_bytes(n, bits, block), 8)
        want = torch.zeros(nbytes, dtype=torch.uint8)
        _C.quantize(want.data_ptr(), x.data_ptr(), CODES[src_t], n, bits, block)
        got = torch.zeros(nbytes + 2 * GUARD, dtype=torch.uint8)
        assert lib.fs_cuda_quantize(got[GUARD:].data_ptr(), x.data_ptr(), CODES[src_t], n, bits,
                                    block, None) == 0
        assert torch.equal(got[GUARD:GUARD + nbytes], want), n
        assert not got[:GUARD].any() and not got[GUARD + nbytes:].any()
        for dst_t in (torch.float32, torch.bfloat16):
            ref = torch.zeros(n, dtype=dst_t)
            _C.dequantize(ref.data_ptr(), CODES[dst_t], want.data_ptr(), n, bits, block, False)
            out = torch.full((n + 2 * GUARD,), 7.0, dtype=dst_t)
            assert lib.fs_cuda_dequantize(out[GUARD:].data_ptr(), CODES[dst_t], want.data_ptr(),
                                          n, bits, block, 0, None) == 0
            torch.testing.assert_close(out[GUARD:GUARD + n], ref, rtol=0, atol=0, equal_nan=True)
            assert (out[:GUARD] == 7).all() and (out[GUARD + n:] == 7).all()
        acc0 = torch.randn(n, generator=g)
        ref, acc = acc0.clone(), acc0.clone()
        _C.dequantize(ref.data_ptr(), 0, want.data_ptr(), n, bits, block, True)
        assert lib.fs_cuda_dequantize(acc.data_ptr(), 0, want.data_ptr(), n, bits, block, 1,
                                      None) == 0
        torch.testing.assert_close(acc, ref, rtol=0, atol=0, equal_nan=True)


def test_quantize_refuses_bad_arguments(lib):
    x = torch.zeros(64)
    p = torch.zeros(512, dtype=torch.uint8)
    assert lib.fs_cuda_quantize(p.data_ptr(), x.data_ptr(), 0, 64, 8, 48, None) == INVALID
    assert lib.fs_cuda_quantize(p.data_ptr(), x.data_ptr(), 0, 64, 2, 64, None) == INVALID
    assert lib.fs_cuda_dequantize(x.data_ptr(), 2, p.data_ptr(), 64, 8, 64, 1, None) == INVALID
    assert lib.fs_cuda_quantize(None, None, 0, 0, 8, 64, None) == 0
