"""The known-answer check of a Comm's reductions (runtime/comm_check.py):
every backend flatshard builds passes it, and a backend that sums where it
should average, or a custom reduce-scatter that averages where it is asked
to sum, is named on every rank before any gradient goes through it."""
import pytest
import torch
import torch.distributed as dist

from flatshard.errors import ReductionCheckError
from flatshard.runtime import comm as fcomm
from flatshard.runtime.comm_check import check_reductions
from test_diagnostics import assert_documented

TIMEOUT = 120


def _good_backends():
    """Every host backend passes: comm_for checked a twin of each (the
    Comm's own ledger starts empty), and the Comm itself passes too."""
    group = dist.new_group(backend="gloo")
    out = []
    for backend in ("shm", "torch"):
        c = fcomm.comm_for(group, backend)
        before = len(c.ledger())
        check_reductions(c, backend)
        out.append((before, len(c.ledger())))
    return out


def test_every_backend_passes(dist_pool):
    # 4 dtypes x 2 collectives x (average, sum), and the outcomes' all-gather
    assert dist_pool(2).run(_good_backends, timeout=TIMEOUT) == [[(0, 17), (0, 17)]] * 2


class _SumsForAverage:
    """A backend that ignores average=True: the Comm's own collectives, summing."""

    def __init__(self, comm):
        self.c, self.rank, self.world_size = comm, comm.rank, comm.world_size

    def reduce_scatter(self, ip, op, n, code, average, tag):
        self.c.reduce_scatter(ip, op, n, code, False, tag)

    def all_reduce(self, p, n, code, average, tag):
        self.c.all_reduce(p, n, code, False, tag)

    def all_gather(self, *args):
        self.c.all_gather(*args)


def _catch(fn):
    try:
        fn()
    except ReductionCheckError as e:
        return str(e)
    return None


def _sums_for_average():
    c = _SumsForAverage(fcomm.comm_for(dist.group.WORLD, "shm"))
    return _catch(lambda: check_reductions(c, "summing"))


def test_a_backend_that_sums_for_an_average_is_named(dist_pool):
    msgs = dist_pool(2).run(_sums_for_average, timeout=TIMEOUT)
    for rank, msg in enumerate(msgs):
        assert msg is not None
        assert "'summing' backend reduces wrongly" in msg and "ranks [0, 1] of 2" in msg
        # rank r's part of the average of (r + 1) * (i + 1): 1.5 * (r + 1); summed: 3 * (r + 1)
        assert (f"on rank {rank}, reduce_scatter(average=True) in float32: element 0: "
                f"got {3 * (rank + 1)}, expected {1.5 * (rank + 1):g}") in msg, msg


class _AveragingReduceScatter:
    """torch's ReduceScatter protocol, but averaging whatever op it is given."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM,
                                   group=group)
        output_tensor.div_(dist.get_world_size(group))


def _custom(dtype):
    return _catch(lambda: fcomm.custom_comm(dist.group.WORLD, None, _AveragingReduceScatter(),
                                            dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_custom_reduce_scatter_that_averages_a_sum_is_named(dist_pool, dtype):
    name = str(dtype).split(".")[1]
    for rank, msg in enumerate(dist_pool(2).run(_custom, dtype, timeout=TIMEOUT)):
        assert msg is not None and "custom reduce-scatter _AveragingReduceScatter" in msg
        # averaged by the custom object, then again by flatshard: 0.75 * (r + 1)
        assert (f"on rank {rank}, reduce_scatter(average=True) in {name}: element 0: "
                f"got {0.75 * (rank + 1):g}, expected {1.5 * (rank + 1):g}") in msg, msg
        assert "asked for a SUM" in msg
        if rank == 0 and dtype == torch.float32:
            assert_documented("reduction-check", "ReductionCheckError: " + msg)


def _fully_shard_custom():
    """Through the public API: fully_shard's set_custom_reduce_scatter."""
    import flatshard
    from torch.distributed.device_mesh import init_device_mesh
    m = torch.nn.Linear(4, 4)
    flatshard.fully_shard(m, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return _catch(lambda: m.set_custom_reduce_scatter(_AveragingReduceScatter()))


def test_set_custom_reduce_scatter_checks_it(dist_pool):
    for msg in dist_pool(2).run(_fully_shard_custom, timeout=TIMEOUT):
        assert msg is not None and "reduce_scatter(average=True) in float32" in msg
