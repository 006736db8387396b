"""flatshard.Snapshots' buddy copies on one machine seen as two hosts
(FLATSHARD_SNAPSHOT_HOST_RANKS=1: each rank a host): every committed step is
held by the rank's own segment and by its buddy's; when one host's segments
are gone, the survivors restore from the buddy copies, with the bits the
ranks had at the crash; when both copies of a part are gone, the step, the
lost rank and the checkpoint to resume from are named."""
import os

import torch
import torch.distributed as dist

import flatshard
from flatshard.snapshots import list_segments, names, remove_segments

from test_snapshots import Counter, _model, _steps


def _crash(snaps):
    """As a SIGKILL after the step's copies: the segments stay."""
    snaps._snap.wait()
    snaps._buddy.close(remove=False)
    snaps._snap.close()
    snaps._snap = None
    snaps._hook.remove()


def _train(job, steps):
    model, opt = _model()
    counter = Counter()
    snaps = flatshard.Snapshots(model, opt, [counter], job=job)
    assert snaps.restore() == 0
    _steps(model, opt, snaps, counter, 0, steps)
    _crash(snaps)
    return [p.detach().clone() for p in model.parameters()], \
        {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}


def _restore(job):
    model, opt = _model()
    counter = Counter()
    snaps = flatshard.Snapshots(model, opt, [counter], job=job,
                                checkpoint_dir="/nonexistent/ckpt")
    try:
        start = snaps.restore()
        return start, counter.n, [p.detach().clone() for p in model.parameters()], \
            {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items()}
    except flatshard.SnapshotError as e:
        return str(e)
    finally:
        if snaps._snap is not None:
            _crash(snaps)


def scenario(job, what):
    os.environ["FLATSHARD_SNAPSHOT_HOST_RANKS"] = "1"
    try:
        return _scenario(job, what)
    finally:
        del os.environ["FLATSHARD_SNAPSHOT_HOST_RANKS"]


def _scenario(job, what):
    rank = dist.get_rank()
    params, state = _train(job, 4)  # steps 2 (agreed) and 3 (copied) held, twice each
    dist.barrier()
    segs = sorted((s["name"], s["owner"], s["steps"]) for s in list_segments(job))
    dist.barrier()
    if what == "host lost" and rank == 1:  # host 1's memory: rank 1's and its buddy copy
        for name in (names.segment_name(job, 1), names.buddy_name(job, 1, 0)):
            flatshard._C.snapshot_unlink(name)
    if what == "both lost":  # rank 1's own copy (host 1) and its buddy copy (host 0)
        flatshard._C.snapshot_unlink(names.segment_name(job, 1) if rank == 1 else
                                     names.buddy_name(job, 0, 1))
    dist.barrier()
    return segs, params, state, _restore(job)


def test_each_rank_held_twice_and_a_lost_host_restored_from_the_buddy(dist_pool):
    job = f"t{os.getpid()}_buddy_host"
    try:
        for rank, (segs, params, state, got) in enumerate(
                dist_pool(2).run(scenario, job, "host lost")):
            assert segs == [(f"/flatshard-snap-{job}-r0", 0, [2, 3]),
                            (f"/flatshard-snap-{job}-r0-buddy1", 1, [2, 3]),
                            (f"/flatshard-snap-{job}-r1", 1, [2, 3]),
                            (f"/flatshard-snap-{job}-r1-buddy0", 0, [2, 3])]
            start, count, rparams, rstate = got
            assert (start, count) == (4, 4)
            assert all(torch.equal(a, b) for a, b in zip(params, rparams)), rank
            assert state.keys() == rstate.keys()
            assert all(torch.equal(state[k], rstate[k]) for k in state), rank
    finally:
        remove_segments(job)


def test_both_copies_lost_names_the_step_the_rank_and_the_checkpoint(dist_pool):
    job = f"t{os.getpid()}_buddy_both"
    try:
        for err in [r[3] for r in dist_pool(2).run(scenario, job, "both lost")]:
            assert isinstance(err, str), err
            assert "the newest any rank holds: 3" in err
            assert "at step 3 both copies (own and buddy) of the parts of rank(s) [1]" in err
            assert "rank 0: holds steps [2, 3]" in err and "rank 1: holds steps none" in err
            assert "No checkpoint on disk to resume from either" in err and "/nonexistent" in err
    finally:
        remove_segments(job)
