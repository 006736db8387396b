"""Quantized collectives of the engine (csrc/engine/link_quant.c) and the
all-to-all they ride on (comm.h), on the shm and torch (gloo) backends at 2
and 4 ranks: each rank computes the expected result locally from every
rank's inputs, with the kernels' quantize-dequantize as the reference
(tests/test_quant_kernels.py holds the kernels against float64)."""
import pytest
import torch
import torch.distributed as dist

from flatshard import _C
from flatshard.tensors import dtype_code
from test_comm import comm

SIZES = [0, 1, 31, 33, 255, 257, 1009, 40_009]
BACKENDS = ["shm", "torch", "shm_small"]


def data(rank, n, dtype, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + 7 * n + salt)
    return (torch.randn(n, generator=g) * (1 + rank)).to(dtype)


def qdq(x, bits, block, dtype=torch.float32):
    """quantize-dequantize through the kernels: the values that travel"""
    n = x.numel()
    p = torch.zeros(max(_C.quant_payload_bytes(n, bits, block), 8), dtype=torch.uint8)
    _C.quantize(p.data_ptr(), x.data_ptr(), dtype_code(x.dtype), n, bits, block)
    out = torch.empty(n, dtype=dtype)
    _C.dequantize(out.data_ptr(), dtype_code(dtype), p.data_ptr(), n, bits, block, False)
    return out


def _all_to_all(backend):
    c = comm(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    ok = []
    for n in SIZES:
        send = torch.cat([torch.full((n,), 100 * rank + r, dtype=torch.int32) for r in range(world)])
        recv = torch.full_like(send, -1)
        c.all_to_all(send.data_ptr(), recv.data_ptr(), n, dtype_code(torch.int32), "a2a")
        want = torch.cat([torch.full((n,), 100 * r + rank, dtype=torch.int32)
                          for r in range(world)])
        ok.append(torch.equal(recv, want))
    return all(ok)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_all_to_all_against_local_results(dist_pool, backend, world):
    assert dist_pool(world).run(_all_to_all, backend) == [True] * world


def _quantized(backend, dtype, bits, block):
    c = comm(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = []
    for n in SIZES:
        # all-gather: every rank's shard, quantized once, lands everywhere
        send = data(rank, n, dtype)
        recv = torch.full((world * n,), float("nan"), dtype=dtype)
        c.quantized("all_gather", send.data_ptr(), recv.data_ptr(), n, dtype_code(dtype), 8,
                    block, "qag")
        want = torch.cat([qdq(data(r, n, dtype), 8, block, dtype) for r in range(world)])
        if not torch.equal(recv, want):
            bad.append(("all_gather", n))
        # reduce-scatter: rank r's block for this rank, dequantized, summed in
        # rank order in float32
        send = data(rank, world * n, dtype, salt=1)
        recv = torch.full((n,), float("nan"), dtype=dtype)
        c.quantized("reduce_scatter", send.data_ptr(), recv.data_ptr(), n, dtype_code(dtype),
                    bits, block, "qrs")
        acc = torch.zeros(n)
        for r in range(world):
            acc = acc + qdq(data(r, world * n, dtype, salt=1)[rank * n:(rank + 1) * n], bits, block)
        if not torch.equal(recv, acc.to(dtype)):
            bad.append(("reduce_scatter", n))
    return bad


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,bits,block", [(torch.float32, 8, 256), (torch.float32, 4, 32),
                                              (torch.bfloat16, 4, 256), (torch.float16, 8, 64)])
def test_quantized_collectives_against_local_results(dist_pool, backend, world, dtype, bits,
                                                     block):
    assert dist_pool(world).run(_quantized, backend, dtype, bits, block) == [[]] * world


def _bad_arguments():
    c = comm("shm")
    x = torch.zeros(64)
    out = []
    for args in [("all_gather", 8, 48), ("reduce_scatter", 2, 256), ("gather", 8, 256)]:
        try:
            c.quantized(args[0], x.data_ptr(), x.data_ptr(), 16, 0, args[1], args[2])
            out.append(None)
        except (ValueError, _C.CoreError) as e:
            out.append(str(e))
    return out


def test_quantized_arguments_are_checked(dist_pool):
    for msgs in dist_pool(2).run(_bad_arguments):
        assert "multiple of 32" in msgs[0]
        assert "0 (off), 8 or 4" in msgs[1]
        assert "'all_gather' or 'reduce_scatter'" in msgs[2]
