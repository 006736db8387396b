"""Tests of the multi-rank test harness itself (dist_pool.py)."""
import os
import sys

import pytest
import torch
import torch.distributed as dist

import dist_pool as dist_pool_module  # the fixture takes the plain name


def _all_reduce(scale):
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), (t * scale).tolist()


def _raise_on(bad_ranks):
    if dist.get_rank() in bad_ranks:
        _fail_deeper(dist.get_rank())
    dist.barrier()  # the good ranks now wait for the failed ones forever


def _fail_deeper(rank):
    raise ValueError(f"boom from rank {rank}")


def _getpid():
    return os.getpid()


def _print(text):
    print(text)
    print(f"on stderr from {dist.get_rank()}", file=sys.stderr, end="")


def _skip_collective_on_rank1():
    if dist.get_rank() != 1:
        dist.barrier()


def _exit_on_rank1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_all_reduce(dist_pool, world_size):
    pool = dist_pool(world_size)
    expected = [2.0 * world_size * (world_size + 1) / 2] * 3
    assert pool.run(_all_reduce, scale=2.0) == [
        (rank, world_size, expected) for rank in range(world_size)]


def test_pool_is_reused(dist_pool):
    pool = dist_pool(2)
    pids = pool.run(_getpid)
    assert pids == pool.pids() and len(set(pids)) == 2
    assert pool.run(_getpid) == pids


def test_rank_output_is_shown_with_the_test(dist_pool, capsys):
    assert dist_pool(2).run(_print, "hello") == [None, None]
    out = capsys.readouterr().out
    assert "[rank 0] hello\n" in out and "[rank 1] hello\n" in out
    assert "[rank 1] on stderr from 1\n" in out


def test_exception_names_rank_and_traceback_then_pool_recovers(dist_pool):
    pool = dist_pool(2)
    with pytest.raises(AssertionError) as info:
        pool.run(_raise_on, {1}, timeout=60)
    message = str(info.value)
    assert "rank 1 raised" in message
    assert "Traceback" in message and "_fail_deeper" in message
    assert "ValueError: boom from rank 1" in message
    # given up on after the grace that follows a failure, not the 60s timeout
    assert (f"ranks [0] did not answer within {dist_pool_module.GRACE_AFTER_FAILURE}s "
            "of another rank's failure") in message
    assert "[rank 0]   File" in message and " in _raise_on" in message  # rank 0's stack

    # every failing rank is reported
    with pytest.raises(AssertionError) as info:
        pool.run(_raise_on, {0, 1})
    assert "boom from rank 0" in str(info.value) and "boom from rank 1" in str(info.value)

    assert pool.run(_all_reduce, 1.0)[0] == (0, 2, [3.0] * 3)


def test_hang_times_out_kills_pool_and_recovers(dist_pool):
    pool = dist_pool(2)
    old_pids = pool.run(_getpid)
    with pytest.raises(AssertionError) as info:
        pool.run(_skip_collective_on_rank1, timeout=3)
    message = str(info.value)
    assert "ranks [0] did not answer within the 3s timeout" in message
    # rank 0's Python stack, dumped while it was blocked inside gloo
    assert "[rank 0]   File" in message and " in _skip_collective_on_rank1" in message
    assert not any(_alive(pid) for pid in old_pids)
    new_pids = pool.run(_getpid)
    assert set(new_pids).isdisjoint(old_pids)


def test_dead_worker_reported_promptly(dist_pool):
    pool = dist_pool(2)
    with pytest.raises(AssertionError) as info:
        pool.run(_exit_on_rank1, timeout=60)
    # seen as its pipe's end: rank 0, in a barrier with the dead rank, is
    # given up on after the grace, never at the 60s timeout
    assert "rank 1 died with exit code 3" in str(info.value)
    assert "within the 60s timeout" not in str(info.value), str(info.value)
    assert pool.run(_all_reduce, 1.0)[1] == (1, 2, [3.0] * 3)


def test_rejects_functions_ranks_cannot_import(dist_pool):
    with pytest.raises(ValueError, match="module-level"):
        dist_pool(2).run(lambda: None)
