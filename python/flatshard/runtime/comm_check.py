"""A known-answer check of a new Comm's reductions, before it carries a
gradient.

A backend that sums where it should average trains on gradients world_size
times too large, and nothing fails: torch's gloo ReduceOp.AVG does exactly
that (pytorch issue 162338), and a user's own reduce-scatter (fully_shard's
set_custom_reduce_scatter) can do the same or worse. So when a Comm is made,
every rank contributes values whose sum and average are known exactly, and
each reduction (reduce-scatter and all-reduce, average and sum) is run once
per dtype gradients are reduced in (float32, float64, bfloat16, float16).
A user's custom reduce-scatter is checked when it is set, in its group's
reduce dtype only, so it is called twice more than torch would call it.
Rank r's element i is (r + 1) * (i + 1): a backend that sums for an
average, averages for a sum, reduces nothing or hands back another rank's
part gives a result at least a factor (world_size + 1) / world_size off,
far outside the one rounding of the dtype allowed here.

Each rank then learns every rank's outcome through one all-gather of a
byte (an all-gather moves bytes, it does no arithmetic), so a wrong
result is reported by every rank together, naming the ranks that saw it,
instead of one rank raising while the others wait in their next
collective. Cost: at most 17 collectives of a few elements, once per Comm
(benchmarks/results/mistakes2.md).

Imports: _C, errors.
"""
import torch

from .. import _C
from ..errors import ReductionCheckError

# (name, torch dtype, _C code, relative tolerance: one rounding of the dtype)
DTYPES = (
    ("float32", torch.float32, _C.F32, 2 * torch.finfo(torch.float32).eps),
    ("float64", torch.float64, _C.F64, 2 * torch.finfo(torch.float64).eps),
    ("bfloat16", torch.bfloat16, _C.BF16, 2 * torch.finfo(torch.bfloat16).eps),
    ("float16", torch.float16, _C.F16, 2 * torch.finfo(torch.float16).eps),
)
TAG = "known-answer check"


def _values(rank, n, dtype):
    return (torch.arange(1, n + 1, dtype=torch.float64) * (rank + 1)).to(dtype)


def _expected(world, n, average):
    """Every rank's values summed (or averaged), exactly (float64)."""
    total = torch.arange(1, n + 1, dtype=torch.float64) * (world * (world + 1) / 2)
    return total / world if average else total


def _mismatch(got, want, tol):
    """The first element of `got` off `want` by more than `tol` relative, as
    text, or None."""
    off = (got.double() - want).abs() > tol * want.abs()
    if not off.any():
        return None
    i = int(off.nonzero()[0])
    return f"element {i}: got {got[i].item():g}, expected {want[i].item():g}"


def _one(comm, collective, average, dtype, code, tol):
    """A wrong result of one collective on this rank, as text, or None."""
    rank, world = comm.rank, comm.world_size
    want = _expected(world, world, average)
    buf = _values(rank, world, dtype)
    if collective == "reduce_scatter":
        out = torch.empty(1, dtype=dtype)
        comm.reduce_scatter(buf.data_ptr(), out.data_ptr(), 1, code, average, TAG)
        return _mismatch(out, want[rank:rank + 1], tol)
    comm.all_reduce(buf.data_ptr(), world, code, average, TAG)
    return _mismatch(buf, want, tol)


def _run_all(comm, dtypes, collectives):
    """This rank's first wrong result, as text, or ''."""
    for name, dtype, code, tol in DTYPES:
        if dtype not in dtypes:
            continue
        for collective in collectives:
            for average in (True, False):
                bad = _one(comm, collective, average, dtype, code, tol)
                if bad is not None:
                    return f"{collective}(average={average}) in {name}: {bad}"
    return ""


ALL_DTYPES = tuple(d[1] for d in DTYPES)
COLLECTIVES = ("reduce_scatter", "all_reduce")


def check_reductions(comm, backend, dtypes=ALL_DTYPES, collectives=COLLECTIVES):
    """Raise ReductionCheckError on every rank when any rank's reductions on
    host Comm `comm` (backend named `backend` in the message) give a wrong
    result: each of `collectives`, averaging and summing, in each of
    `dtypes`. Nothing to check on one rank."""
    if comm.world_size == 1:
        return
    mine = _run_all(comm, dtypes, collectives)
    flag = torch.tensor([1 if mine else 0], dtype=torch.uint8)
    flags = torch.empty(comm.world_size, dtype=torch.uint8)
    comm.all_gather(flag.data_ptr(), flags.data_ptr(), 1, _C.U8, TAG)
    wrong = [r for r in range(comm.world_size) if flags[r]]
    if not wrong:
        return
    where = f"on rank {comm.rank}, {mine}" if mine else "not on this rank"
    raise ReductionCheckError(
        f"flatshard: the {backend!r} backend reduces wrongly: each rank r contributed "
        f"(r + 1) * (i + 1) for element i, and ranks {wrong} of {comm.world_size} got a wrong "
        f"result ({where}). Gradients reduced through it would be wrong without an error. "
        "Fix the backend (a custom reduce-scatter is asked for a SUM; flatshard divides "
        "for averages itself), or use comm_backend='shm' or 'torch'")
