"""The collective backend interface (csrc/comm.h) over the torch backend:
each collective against a result every rank computes locally."""
import pytest
import torch
import torch.distributed as dist

from flatshard import comm as fcomm

SIZES = [0, 1, 7, 64, 1001]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def rank_data(rank, n, dtype, salt=0):
    g = torch.Generator().manual_seed(1000 * rank + n + salt)
    return torch.randint(-8, 8, (n,), generator=g).to(dtype)  # exact in every dtype


def _collectives(n, dtype):
    rank, world = dist.get_rank(), dist.get_world_size()
    c = fcomm.comm_for(dist.group.WORLD)
    everyone = [rank_data(r, n, dtype) for r in range(world)]
    # all-gather: rank r's input lands at r * n
    out = torch.full((n * world,), 99, dtype=dtype)
    fcomm.all_gather_into(c, out, everyone[rank])
    assert torch.equal(out, torch.cat(everyone))
    # reduce-scatter, sum and average (never trusted to gloo's AVG)
    big = [rank_data(r, n * world, dtype, salt=1) for r in range(world)]
    total = torch.stack([b.double() for b in big]).sum(0)
    for average in (False, True):
        got = torch.empty(n, dtype=dtype)
        fcomm.reduce_scatter_into(c, got, big[rank].clone(), average=average)
        want = total[rank * n:(rank + 1) * n] / (world if average else 1)
        assert torch.equal(got, want.to(dtype)), (average, got, want)
    # all-reduce
    t = everyone[rank].clone()
    fcomm.all_reduce_(c, t)
    assert torch.equal(t, torch.stack([e.double() for e in everyone]).sum(0).to(dtype))
    # broadcast from the last rank, any dtype as bytes
    b = everyone[rank].clone()
    fcomm.broadcast_(c, b, root=world - 1)
    assert torch.equal(b, everyone[world - 1])
    c.barrier()
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_collectives_against_local_results(dist_pool, world, n, dtype):
    assert dist_pool(world).run(_collectives, n, dtype) == [True] * world


def _bad_sizes():
    c = fcomm.comm_for(dist.group.WORLD)
    errors = []
    for call in (lambda: fcomm.all_gather_into(c, torch.empty(3), torch.empty(2)),
                 lambda: fcomm.reduce_scatter_into(c, torch.empty(3), torch.empty(5)),
                 lambda: fcomm.broadcast_(c, torch.empty(2), root=7)):
        try:
            call()
        except (ValueError, RuntimeError) as e:
            errors.append(type(e).__name__)
    return errors


def test_size_mismatches_are_refused_locally(dist_pool):
    assert dist_pool(2).run(_bad_sizes)[0] == ["ValueError", "ValueError", "CoreError"]
