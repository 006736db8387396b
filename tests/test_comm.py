"""The collective backend interface (csrc/backends/comm.h), for the torch (gloo) and
shm backends: each collective against a result every rank computes locally,
on sizes 0, 1, odd primes and larger than the shm staging slot (chunked),
and the shm backend's chunk pipeline with ranks running ahead of each
other."""
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard import _C
from flatshard.runtime import comm as fcomm
from flatshard.tensors import dtype_code

SIZES = [0, 1, 7, 13, 1001, 40_009]
SMALL_SLOT = 64 << 10  # "shm_small": 16 KiB sections, so 40_009 elements go in chunks
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


def rank_data(rank, n, dtype, salt=0):
    """Small integers (exact in every dtype, and in every order of summing)."""
    return ((torch.arange(n, dtype=torch.int64) * (rank + 3 + salt)) % 17 - 8).to(dtype)


_SMALL = {}


def comm(backend):
    """The WORLD group's Comm; "shm_small" is shm with small slots, on a group
    of its own made once per worker; "shm_cached", "shm_streamed" and
    "shm_auto" are shm with small slots and that FLATSHARD_SHM_STAGING
    ([Note: staging stores]), each on its own group too."""
    if not backend.startswith("shm_"):
        return fcomm.comm_for(dist.group.WORLD, backend)
    if backend not in _SMALL:
        staging = backend[4:] if backend != "shm_small" else "auto"
        os.environ[fcomm.ENV_SLOT] = str(SMALL_SLOT)
        os.environ[fcomm.ENV_STAGING] = staging
        try:
            _SMALL[backend] = fcomm.comm_for(dist.new_group(backend="gloo"), "shm")
        finally:
            del os.environ[fcomm.ENV_SLOT], os.environ[fcomm.ENV_STAGING]
    return _SMALL[backend]


def _collectives(n, dtype, backend):
    rank, world = dist.get_rank(), dist.get_world_size()
    c = comm(backend)
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
        if average:  # sum times 1/world: one rounding of the dtype off the quotient
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(got.double(), want.to(dtype).double(), rtol=2 * eps,
                                       atol=0)
        else:
            assert torch.equal(got, want.to(dtype)), (got, want)
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


@pytest.mark.parametrize("backend", ["shm_small", "torch"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_collectives_against_local_results(dist_pool, backend, world, n, dtype):
    assert dist_pool(world).run(_collectives, n, dtype, backend) == [True] * world


@pytest.mark.parametrize("world", [2, 4])
def test_shm_default_slots_larger_than_a_half(dist_pool, world):
    # 1.5M float32 per rank: 6 MB, more than the default 4 MiB half.
    assert dist_pool(world).run(_collectives, 1_500_007, torch.float32, "shm") == [True] * world


# Chunks of the small slot: one section (comm_shm.c, [Note: chunk size]).
# Per all-gather rank and per reduce-scatter output, sizes one unit around
# one and three chunks, and one chunk past a full turn of the sections.
_SECT = SMALL_SLOT // _C.SHM_SECTIONS


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shm_sizes_around_chunk_boundaries(dist_pool, world, dtype):
    es = torch.empty(0, dtype=dtype).element_size()
    turn = _C.SHM_SECTIONS + 1
    ag = [_SECT // es + d for d in (-1, 0, 1)] + [3 * _SECT // es + 1, turn * _SECT // es]
    rs = [_SECT // (world * es) + d for d in (-1, 0, 1)] + [3 * _SECT // (world * es) + 1,
                                                           turn * _SECT // (world * es)]
    for n in ag + rs:
        assert dist_pool(world).run(_collectives, n, dtype, "shm_small") == [True] * world


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shm_outputs_larger_than_the_cache_streamed(dist_pool, dtype):
    # 2 ranks of 17 MiB + 13 elements: outputs past the last-level cache's
    # share of a rank where that is up to 32 MiB (streamed: comm_shm.c
    # [Note: streaming stores]), in default chunks that do not end on a line.
    n = (17 << 20) // torch.empty(0, dtype=dtype).element_size() + 13
    assert dist_pool(2).run(_collectives, n, dtype, "shm") == [True, True]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("n", [1, 1001, 40_009])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shm_streaming_staging_gives_the_same_results(dist_pool, world, n, dtype):
    # Every collective staged with streaming stores, in chunks of the small
    # slot (40_009 elements: several, not ending on a line).
    assert dist_pool(world).run(_collectives, n, dtype, "shm_streamed") == [True] * world


def _stores_used(staging, calls):
    """Exact all-gathers of one size through a new shm Comm with that
    FLATSHARD_SHM_STAGING, and how many staged with each store."""
    os.environ[fcomm.ENV_STAGING] = staging
    try:
        c = fcomm.comm_for(dist.new_group(backend="gloo"), "shm")
    finally:
        del os.environ[fcomm.ENV_STAGING]
    rank, world = dist.get_rank(), dist.get_world_size()
    before = c.stores_used
    x = rank_data(rank, 3001, torch.float32)
    want = torch.cat([rank_data(r, 3001, torch.float32) for r in range(world)])
    for _ in range(calls):
        out = torch.zeros(3001 * world)
        fcomm.all_gather_into(c, out, x)
        assert torch.equal(out, want)
    after = c.stores_used
    return {k: after[k] - before[k] for k in after}


@pytest.mark.parametrize("staging", ["auto", "cached", "streamed"])
def test_shm_staging_stores_follow_the_setting(dist_pool, staging):
    calls = 40
    used = dist_pool(2).run(_stores_used, staging, calls)
    for u in used:
        assert sum(u.values()) == calls
        if staging == "auto":
            # A new Comm tries the other store at its third collective of a
            # kind and size, and again at the sixteenth (shm_staging.h). A
            # rank may read a new choice one collective after the others
            # (harmless: the bits are the same), so the ranks' counts can
            # differ where rank 0 switched.
            assert min(u.values()) >= 1, used
        else:
            assert u[staging] == calls


def test_shm_staging_setting_is_validated(monkeypatch):
    monkeypatch.setenv(fcomm.ENV_STAGING, "fast")
    with pytest.raises(flatshard.ConfigError, match="FLATSHARD_SHM_STAGING.*'auto'"):
        fcomm.shm_staging()
    with pytest.raises(ValueError, match="staging must be 'auto', 'cached' or 'streamed'"):
        _C.Comm("shm", 0, 1, name="/flatshard-never-made", staging="fast")


def _run_ahead(seed, rounds):
    """Mixed collectives back to back through the small slot, of 0 to 7
    chunks each, while one rank at a time naps between them: the others run
    ahead of it by whole chunks and collectives (comm_shm.c, [Note: chunk
    pipeline]), and every result must still be exact."""
    rank, world = dist.get_rank(), dist.get_world_size()
    c = comm("shm_small")
    rng = random.Random(seed)  # the same sequence on every rank
    chunk_f32 = _SECT // 4
    for i in range(rounds):
        napper = rng.randrange(world)
        n = rng.choice([0, 1, 13, chunk_f32 - 1, chunk_f32 + 1, 4 * chunk_f32 + 3,
                        7 * chunk_f32])
        op = rng.choice(["ag", "rs", "ar", "bc", "a2a"])
        nap = rng.random() < 0.5
        if rank == napper and nap:
            time.sleep(0.002)
        everyone = [rank_data(r, n, torch.float32, salt=i) for r in range(world)]
        if op == "ag":
            out = torch.full((n * world,), 99.0)
            fcomm.all_gather_into(c, out, everyone[rank])
            assert torch.equal(out, torch.cat(everyone)), (i, op, n)
        elif op == "rs":
            big = [rank_data(r, n * world, torch.float32, salt=i) for r in range(world)]
            got = torch.full((n,), 99.0)
            fcomm.reduce_scatter_into(c, got, big[rank], average=False)
            want = torch.stack(big).sum(0)[rank * n:(rank + 1) * n]
            assert torch.equal(got, want), (i, op, n)
        elif op == "ar":
            t = everyone[rank].clone()
            fcomm.all_reduce_(c, t)
            assert torch.equal(t, torch.stack(everyone).sum(0)), (i, op, n)
        elif op == "bc":
            root = rng.randrange(world)
            b = everyone[rank].clone()
            fcomm.broadcast_(c, b, root=root)
            assert torch.equal(b, everyone[root]), (i, op, n)
        else:  # block r of rank q's send goes to block q of rank r's recv
            sends = [rank_data(q, n * world, torch.float32, salt=i) for q in range(world)]
            recv = torch.full((n * world,), 99.0)
            c.all_to_all(sends[rank].data_ptr(), recv.data_ptr(), n,
                         dtype_code(torch.float32), "a2a")
            want = torch.cat([sends[q][rank * n:(rank + 1) * n] for q in range(world)])
            assert torch.equal(recv, want), (i, op, n)
    c.barrier()
    return True


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shm_ranks_running_ahead_get_exact_results(dist_pool, world):
    assert dist_pool(world).run(_run_ahead, 4700 + world, 120) == [True] * world


def _bad_sizes(backend):
    c = comm(backend)
    errors = []
    for call in (lambda: fcomm.all_gather_into(c, torch.empty(3), torch.empty(2)),
                 lambda: fcomm.reduce_scatter_into(c, torch.empty(3), torch.empty(5)),
                 lambda: fcomm.broadcast_(c, torch.empty(2), root=7)):
        try:
            call()
        except (ValueError, RuntimeError) as e:
            errors.append(type(e).__name__)
    return errors


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_size_mismatches_are_refused_locally(dist_pool, backend):
    assert dist_pool(2).run(_bad_sizes, backend)[0] == ["ConfigError", "ConfigError", "CoreError"]


class _CudaComm:
    """What comm.py reads of a Comm(kind='device') on cuda:0 of two ranks."""
    device, device_index, world_size = "cuda", 0, 2


class _HostComm:
    device, device_index, world_size = None, None, 2


def test_tensor_checks_name_the_call_the_argument_and_what_fits():
    """comm.py's one check of every Comm's tensors, host and device alike:
    the call and the argument named, what was given and what is expected."""
    with pytest.raises(flatshard.ConfigError, match=r"all_gather: input='cpu' is not allowed; "
                       r"this Comm moves cuda:0 memory"):
        fcomm.all_gather_into(_CudaComm, torch.empty(4), torch.empty(2))
    with pytest.raises(flatshard.ConfigError, match=r"all_gather: output='torch.float32 of 3' "
                       r"is not allowed; expected torch.float32 of world_size \* 2"):
        fcomm.all_gather_into(_HostComm, torch.empty(3), torch.empty(2))
    with pytest.raises(flatshard.ConfigError, match=r"reduce_scatter: input='torch.bfloat16 of "
                       r"4' is not allowed; expected torch.float32 of world_size \* 2"):
        fcomm.reduce_scatter_into(_HostComm, torch.empty(2), torch.empty(4, dtype=torch.bfloat16))
    with pytest.raises(flatshard.ConfigError, match="all_reduce: tensor=.*expected a contiguous"):
        fcomm.all_reduce_(_HostComm, torch.empty(4, 3).t())


def _collective_inside_backward():
    """A gloo collective issued from a backward hook must not capture the
    Python object torch stashes in thread-local state for the backward: its
    worker may drop that copy while the interpreter finalizes, which aborts
    the process. The stash is back once the collective returns."""
    c = comm("torch")
    seen = {}
    real = dist.all_reduce

    def spy(*args, **kwargs):
        seen["during"] = torch._C._is_key_in_tls("context")
        return real(*args, **kwargs)

    def hook(grad):
        seen["before"] = torch._C._is_key_in_tls("context")
        t = torch.ones(3)
        dist.all_reduce, saved = spy, dist.all_reduce
        try:
            fcomm.all_reduce_(c, t)
        finally:
            dist.all_reduce = saved
        seen["after"] = torch._C._is_key_in_tls("context")
        seen["sum"] = t.tolist()
        return grad

    x = torch.randn(3, requires_grad=True)
    x.register_hook(hook)
    (x * 2).sum().backward()
    return seen


def test_torch_backend_collectives_inside_backward_leave_no_python_state(dist_pool):
    got = dist_pool(2).run(_collective_inside_backward)
    for seen in got:
        assert seen == {"before": True, "during": False, "after": True, "sum": [2.0] * 3}
