"""csrc/core/layout.c against references built from torch ops, on awkward sizes."""
import itertools

import pytest
import torch

from flatshard import _C
from flatshard.tensors import dtype_code

SIZES = [
    [0], [1], [3], [0, 0], [1, 0, 1], [2, 3, 5, 7, 11, 13], [97], [16], [15, 17],
    [1000, 1, 0, 999], [4, 4, 4, 4], [31, 0, 33, 2],
]
WORLDS = [1, 2, 3, 4, 8]
ALIGNS = [1, 4, 8]


def round_up(x, m):
    return (x + m - 1) // m * m


@pytest.mark.parametrize("numels,world,align", list(itertools.product(SIZES, WORLDS, ALIGNS)))
def test_flat_layout_matches_concat_and_chunk(numels, world, align):
    # Reference: params concatenated at aligned offsets, then cut into equal chunks.
    params = [torch.arange(1, n + 1, dtype=torch.float64) + 1000 * i for i, n in enumerate(numels)]
    offsets, end = [], 0
    for n in numels:
        offsets.append(round_up(end, align))
        end = offsets[-1] + n
    shard = round_up(-(-end // world), align)
    flat = torch.zeros(shard * world, dtype=torch.float64)
    for p, off in zip(params, offsets):
        flat[off:off + p.numel()] = p
    covered = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for rank in range(world):
        layout, entries = _C.layout_flat(numels, world, rank, align)
        assert (layout.unpadded_numel, layout.shard_numel, layout.padded_numel,
                layout.shard_begin) == (end, shard, shard * world, shard * rank)
        assert tuple(layout) == (end, shard, shard * world, shard * rank)  # layout.h's order
        ref_shard = flat.chunk(world)[rank] if shard else flat[:0]
        got = torch.empty(shard, dtype=torch.float64)
        pieces = [(p.data_ptr(), _C.F64, e.param_offset, e.shard_offset, e.piece_numel)
                  for p, e in zip(params, entries) if e.piece_numel]
        got.fill_(float("nan"))
        _C.gather_pieces(got.data_ptr(), _C.F64, shard, pieces)
        assert torch.equal(got, ref_shard)  # padding zeroed, pieces in place
        for i, e in enumerate(entries):
            numel, flat_off, shard_off, param_off, piece = (
                e.numel, e.flat_offset, e.shard_offset, e.param_offset, e.piece_numel)
            assert tuple(e) == (numel, flat_off, shard_off, param_off, piece)
            assert numel == numels[i] and flat_off == offsets[i] and flat_off % align == 0
            assert 0 <= shard_off <= shard and shard_off + piece <= shard
            covered[i][param_off:param_off + piece] += 1
    for c in covered:  # every element lives on exactly one rank
        assert torch.all(c == 1)


def test_flat_layout_rejects_bad_arguments():
    for args in [([1], 0, 0, 1), ([1], 2, 2, 1), ([1], 2, -1, 1), ([1], 2, 0, 0), ([-1], 1, 0, 1)]:
        with pytest.raises(_C.CoreError, match="layout_flat"):
            _C.layout_flat(*args)


DIM0_SHAPES = [(), (0,), (1,), (5,), (3, 4), (7, 3), (2, 2, 2), (13, 1), (0, 5), (1, 9)]


@pytest.mark.parametrize("world,align", list(itertools.product([1, 2, 3, 4, 5], [1, 4])))
def test_dim0_layout_matches_torch_chunk_and_roundtrips(world, align):
    gen = torch.Generator().manual_seed(world)
    params = [torch.randn(s, generator=gen) for s in DIM0_SHAPES]
    dim0 = [p.shape[0] if p.dim() else 1 for p in params]
    rows = [int(torch.tensor(p.shape[1:]).prod()) if p.dim() else 1 for p in params]
    blocks = []
    for rank in range(world):
        layout, entries = _C.layout_dim0(dim0, rows, world, rank, align)
        assert layout.gathered_numel == layout.block_numel * world
        block = torch.full((layout.block_numel,), float("nan"))
        for p, e in zip(params, entries):
            d0, row, chunk_rows, off, held = (e.dim0, e.row_numel, e.chunk_rows, e.block_offset,
                                              e.local_rows)
            assert off % align == 0 and chunk_rows == -(-d0 // world)
            chunks = torch.chunk(p.reshape(d0, row), world, dim=0) if d0 else ()
            ref = chunks[rank] if rank < len(chunks) else p.reshape(d0, row)[:0]
            assert held == ref.shape[0]
            _C.dim0_copy_in(block.data_ptr(), _C.F32, p.contiguous().data_ptr(), _C.F32, e)
            got = block[off:off + chunk_rows * row].view(chunk_rows, row)
            assert torch.equal(got[:held], ref)
            assert torch.all(got[held:] == 0)  # padding rows are zero
        blocks.append(block)
    gathered = torch.cat(blocks)
    _, entries = _C.layout_dim0(dim0, rows, world, 0, align)
    for p, e in zip(params, entries):
        out = torch.empty(p.numel())
        _C.dim0_copy_out(out.data_ptr(), _C.F32, gathered.data_ptr(), _C.F32, world,
                         blocks[0].numel(), e)
        assert torch.equal(out.view(p.shape), p)


def test_dim0_copy_casts_to_bf16():
    p = torch.randn(5, 3, dtype=torch.float64)
    layout, entries = _C.layout_dim0([5], [3], 2, 1, 1)
    block = torch.empty(layout.block_numel, dtype=torch.bfloat16)
    _C.dim0_copy_in(block.data_ptr(), dtype_code(torch.bfloat16), p.data_ptr(), _C.F64, entries[0])
    assert torch.equal(block[:6], p[3:].reshape(-1).to(torch.bfloat16))


def test_align_numel_is_the_one_rule():
    """layout.h's alignment, which every flat buffer (FSDP1, fully_shard,
    the planner) takes from _C: 16 bytes in elements, at least one."""
    assert _C.ALIGN_BYTES == 16
    for elem_bytes, want in [(1, 16), (2, 8), (4, 4), (8, 2), (16, 1), (32, 1), (3, 5)]:
        assert _C.align_numel(elem_bytes) == want, elem_bytes
    with pytest.raises(ValueError, match="elem_bytes"):
        _C.align_numel(0)


@pytest.mark.parametrize("numels,world,align", list(itertools.product(SIZES, WORLDS, ALIGNS)))
def test_dim0_unsharded_buffer_and_post_forward_chunks(numels, world, align):
    """The unsharded buffer against one built by torch ops (each parameter
    padded to the alignment, concatenated, the end padded to align * world),
    and every post-forward group's chunks against torch.chunk of it."""
    gathered = [i % 3 != 1 for i in range(len(numels))]  # some left out (extensions)
    sizes = [n if g else 0 for n, g in zip(numels, gathered)]
    got = _C.layout_dim0_unsharded(sizes, world, align)
    pieces = [torch.nn.functional.pad(torch.arange(1, n + 1, dtype=torch.float64),
                                      (0, round_up(n, align) - n)) for n in sizes]
    ref = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.float64)
    ref = torch.nn.functional.pad(ref, (0, round_up(ref.numel(), align * world) - ref.numel()))
    assert got["alloc_numel"] == ref.numel()
    starts = [sum(p.numel() for p in pieces[:i]) for i in range(len(pieces))]
    assert got["offsets"] == starts
    for off, n in zip(got["offsets"], sizes):
        assert off % align == 0
        assert torch.equal(ref[off:off + n], torch.arange(1, n + 1, dtype=torch.float64))
    for k in (k for k in range(1, world + 1) if world % k == 0):
        chunks = torch.chunk(ref, k) if ref.numel() else [ref] * k
        for rank in range(k):
            keep = _C.layout_dim0_post_chunk(ref.numel(), k, rank)
            assert keep.start % align == 0
            assert torch.equal(ref[keep], chunks[rank])
            assert keep.stop - keep.start == ref.numel() // k


def test_dim0_unsharded_layouts_reject_bad_arguments():
    for args in [([1], 0, 1), ([1], 1, 0), ([-1], 1, 1), ([2 ** 62, 2 ** 62], 1, 1)]:
        with pytest.raises(_C.CoreError, match="layout_dim0_unsharded"):
            _C.layout_dim0_unsharded(*args)
    for args in [(8, 3, 0), (8, 0, 0), (8, 2, 2), (8, 2, -1), (-8, 2, 0)]:
        with pytest.raises(_C.CoreError, match="layout_dim0_post_chunk"):
            _C.layout_dim0_post_chunk(*args)
