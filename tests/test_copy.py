"""csrc/core/copy.c casts and accumulation against torch's casts and float64."""
import pytest
import torch

from flatshard import _C
from flatshard.tensors import dtype_code

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 31, 1023]


def special_values(dtype):
    """Values that stress rounding: ties, subnormals, overflow, inf, nan."""
    gen = torch.Generator().manual_seed(0)
    v = [0.0, -0.0, 1.0, -1.0, 65504.0, 65519.0, 65520.0, 1e5, -1e5, 6e-8, 3e-8, 2.9e-8, 1e-40,
         5.96e-8, 6.1e-5, 1.0009765625, 1.00048828125, 1.000732421875, 3.0e38, float("inf"),
         float("-inf")]
    base = torch.tensor(v, dtype=torch.float64)
    rand = torch.randn(4000, generator=gen, dtype=torch.float64) * torch.logspace(
        -12, 12, 4000, dtype=torch.float64)
    return torch.cat([base, rand]).to(dtype)


@pytest.mark.parametrize("src_t", FLOATS)
@pytest.mark.parametrize("dst_t", FLOATS)
def test_cast_matches_torch(src_t, dst_t):
    src = special_values(src_t)
    want = src.to(dst_t)
    got = torch.empty_like(want)
    _C.cast(got.data_ptr(), dtype_code(dst_t), src.data_ptr(), dtype_code(src_t), src.numel())
    if src_t in (torch.float16, torch.bfloat16) and dst_t in (torch.float16, torch.bfloat16) \
            and src_t != dst_t:
        # Through f32 (exact for both), as torch does.
        want = src.float().to(dst_t)
    assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8)) or \
        torch.equal(got, want)


def test_cast_nan_stays_nan():
    src = torch.tensor([float("nan"), -float("nan")])
    for t in (torch.float16, torch.bfloat16):
        out = torch.empty(2, dtype=t)
        _C.cast(out.data_ptr(), dtype_code(t), src.data_ptr(), _C.F32, 2)
        assert torch.isnan(out).all()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("accumulate", [False, True])
def test_scale_accumulate_against_float64(n, dtype, accumulate):
    gen = torch.Generator().manual_seed(n)
    dst = torch.randn(n, generator=gen).to(dtype)
    src = torch.randn(n, generator=gen).to(dtype)
    scale = 1.0 / 3.0
    want = (dst.double() if accumulate else 0) + scale * src.double()
    _C.scale_accumulate(dst.data_ptr(), dtype_code(dtype), src.data_ptr(), dtype_code(dtype), n,
                        scale, accumulate)
    tol = {torch.float64: 1e-15, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
    assert torch.allclose(dst.double(), want.to(dtype).double() if n else want, rtol=tol[dtype],
                          atol=tol[dtype])


def test_gather_pieces_rejects_out_of_order_and_out_of_range():
    src = torch.arange(4.0)
    dst = torch.empty(8)
    with pytest.raises(_C.CoreError):
        _C.gather_pieces(dst.data_ptr(), _C.F32, 8, [(src.data_ptr(), _C.F32, 0, 4, 4),
                                                     (src.data_ptr(), _C.F32, 0, 0, 4)])
    with pytest.raises(_C.CoreError):
        _C.gather_pieces(dst.data_ptr(), _C.F32, 8, [(src.data_ptr(), _C.F32, 0, 6, 4)])


def test_integer_casts_are_refused():
    a = torch.zeros(2, dtype=torch.int64)
    b = torch.zeros(2)
    with pytest.raises(_C.CoreError, match="unsupported"):
        _C.cast(b.data_ptr(), _C.F32, a.data_ptr(), _C.I64, 2)
