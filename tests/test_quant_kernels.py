"""Block-wise quantization kernels (csrc/core/quant.c) against an
independent float64 reference of [Note: quantization rule] on awkward
sizes, scalar and AVX2 paths bit for bit, and exact round trips of values a
block can represent."""
import math

import pytest
import torch

from flatshard import _C
from flatshard.tensors import dtype_code

BLOCKS = [32, 64, 256]
SIMDS = ["scalar"] + (["avx2"] if _C.simd_level() != "scalar" else [])


def sizes(block):
    return sorted({0, 1, 2, 7, block - 1, block, block + 1, 2 * block + 3, 3 * block, 101, 257,
                   1009})


def payload(n, bits, block):
    return torch.zeros(max(_C.quant_payload_bytes(n, bits, block), 8), dtype=torch.uint8)


def quantize(x, bits, block, simd="auto"):
    p = payload(x.numel(), bits, block)
    _C.quantize(p.data_ptr(), x.data_ptr(), dtype_code(x.dtype), x.numel(), bits, block, simd)
    return p


def dequantize(p, n, bits, block, dtype=torch.float32, simd="auto", into=None):
    out = torch.zeros(n, dtype=dtype) if into is None else into
    _C.dequantize(out.data_ptr(), dtype_code(out.dtype), p.data_ptr(), n, bits, block,
                  into is not None, simd)
    return out


def reference(x, bits, block):
    """float64 model of the rule: (scales, codes, values as float32)."""
    qmax = 127 if bits == 8 else 7
    x = x.double().float().tolist()  # widened exactly to float32 values
    scales, codes, values = [], [], []
    for lo in range(0, len(x), block):
        blk = x[lo:lo + block]
        if any(not math.isfinite(v) for v in blk):
            scales.append(float("nan"))
            codes += [0] * len(blk)
            values += [float("nan")] * len(blk)
            continue
        amax = max(abs(v) for v in blk)
        s = torch.tensor(amax, dtype=torch.float32) / qmax  # float32 arithmetic, as C
        inv = (1.0 / s) if s > 0 else torch.tensor(0.0)
        if not (s > 0) or not math.isfinite(float(inv)):
            s, inv = torch.tensor(0.0), torch.tensor(0.0)
        scales.append(float(s))
        for v in blk:
            r = torch.round(torch.tensor(v, dtype=torch.float32) * inv.float())  # half to even
            q = int(min(max(float(r), -qmax), qmax))
            codes.append(q)
            values.append(float(torch.tensor(q, dtype=torch.float32) * s.float()))
    return scales, codes, values


def unpack(p, n, bits, block):
    nb = -(-n // block)
    scales = p[:4 * nb].view(torch.float32).tolist() if nb else []
    raw = p[4 * nb:]
    if bits == 8:
        codes = raw[:n].view(torch.int8).tolist()
    else:
        b = raw[:(n + 1) // 2].to(torch.int32)
        lo, hi = b & 0xF, b >> 4
        codes = torch.stack([lo, hi], 1).reshape(-1)[:n]
        codes = ((codes ^ 8) - 8).tolist()
    return scales, codes


def test_payload_bytes():
    assert _C.quant_payload_bytes(0, 8, 256) == 0
    assert _C.quant_payload_bytes(1, 8, 256) == 8
    assert _C.quant_payload_bytes(256, 8, 256) == 260 + 4  # padded to 8
    assert _C.quant_payload_bytes(512, 4, 256) == 8 + 256
    for bad in [(10, 8, 0), (10, 8, 48), (10, 2, 256), (10, 8, 8192)]:
        with pytest.raises(ValueError, match="multiple of 32"):
            _C.quant_payload_bytes(*bad)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_matches_reference(bits, block, dtype):
    g = torch.Generator().manual_seed(bits * 1000 + block)
    for n in sizes(block):
        x = (torch.randn(n, generator=g) * torch.rand(n, generator=g) * 3).to(dtype)
        if n > 5:
            x[3] = 0.5 * x[3]  # a value exactly halfway once scaled is rare; rounding is rint
        want_s, want_c, want_v = reference(x, bits, block)
        for simd in SIMDS:
            p = quantize(x, bits, block, simd)
            got_s, got_c = unpack(p, n, bits, block)
            assert got_s == want_s, (n, simd)
            assert got_c == want_c, (n, simd)
            for dt in (torch.float32, torch.bfloat16):
                v = dequantize(p, n, bits, block, dt, simd)
                assert torch.equal(v, torch.tensor(want_v, dtype=torch.float32).to(dt)), (n, dt)


@pytest.mark.parametrize("bits", [8, 4])
def test_accumulate_adds_in_float32(bits):
    n, block = 1009, 64
    g = torch.Generator().manual_seed(5)
    x, acc0 = torch.randn(n, generator=g), torch.randn(n, generator=g)
    p = quantize(x, bits, block)
    v = dequantize(p, n, bits, block)
    for simd in SIMDS:
        acc = acc0.clone()
        dequantize(p, n, bits, block, simd=simd, into=acc)
        assert torch.equal(acc, acc0 + v)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_values_round_trip(bits, dtype):
    """k * 2^e, |k| <= qmax, in a block whose absmax is qmax * 2^e, come back
    exactly (in bf16 too: qmax fits its mantissa)."""
    qmax, block = (127 if bits == 8 else 7), 32
    g = torch.Generator().manual_seed(bits)
    for n in (1, 31, 32, 33, 97):
        e = torch.randint(-8, 8, (-(-n // block),), generator=g)
        k = torch.randint(-qmax, qmax + 1, (n,), generator=g)
        k[::block] = qmax  # each block's absmax is qmax * 2^e
        x = k.double() * torch.pow(2.0, e.double().repeat_interleave(block)[:n])
        x = x.to(dtype)
        for simd in SIMDS:
            assert torch.equal(dequantize(quantize(x, bits, block, simd), n, bits, block, dtype,
                                          simd), x)


def test_zero_and_nonfinite_blocks():
    block = 32
    x = torch.zeros(3 * block + 5)
    x[block + 3] = float("inf")
    x[2 * block + 1] = float("nan")
    x[3 * block + 2] = 1.5
    for bits in (8, 4):
        for simd in SIMDS:
            v = dequantize(quantize(x, bits, block, simd), x.numel(), bits, block, simd=simd)
            assert torch.equal(v[:block], torch.zeros(block))
            assert torch.isnan(v[block:3 * block]).all()  # the overflow stays visible
            assert v[3 * block + 2] == 1.5 and v[3 * block:].count_nonzero() == 1
            p = quantize(x, bits, block, simd)
            nb = -(-x.numel() // block)
            codes = p[4 * nb:4 * nb + (x.numel() if bits == 8 else (x.numel() + 1) // 2)]
            per = block if bits == 8 else block // 2
            assert not codes[per:3 * per].any()  # a non-finite block's codes are zeros


def test_error_bound():
    """|x - value| <= scale / 2 per block."""
    block, n = 256, 4099
    x = torch.randn(n, generator=torch.Generator().manual_seed(9))
    for bits, qmax in ((8, 127), (4, 7)):
        v = dequantize(quantize(x, bits, block), n, bits, block)
        for lo in range(0, n, block):
            s = x[lo:lo + block].abs().max() / qmax
            assert (x[lo:lo + block] - v[lo:lo + block]).abs().max() <= s / 2 * (1 + 1e-6)
