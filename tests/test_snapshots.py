"""flatshard.Snapshots under torchrun --max-restarts: a rank killed with
SIGKILL at a chosen point of a step (forward, backward, inside
optimizer.step, in the middle of the snapshot's copy, inside the commit) is
restarted with the others, and training ends with the same bits (parameters,
optimizer state, scheduler, sampler) as the same training that never failed
(tests/snapshot_train.py runs both in each rank). Then, on a pool of ranks:
what cannot be restored is named, never loaded."""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard.snapshots import list_segments, names, remove_segments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "snapshot_train.py")


def torchrun(tmp_path, *args, restarts=2, env=None, nproc=2):
    e = dict(os.environ, OMP_NUM_THREADS="1",
             # torchrun shares its rendezvous store with the workers by default, and a
             # restarted process group can then read the previous run's addresses
             # (pytorch issue 135712): the workers get a store of their own.
             TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(nproc), "--max-restarts", str(restarts),
                           SCRIPT, "--out", str(tmp_path / "out")] + list(args), cwd=ROOT,
                          env=e, capture_output=True, text=True, timeout=400)


# (api, strategy, comm backend, first run's failure, second run's failure,
#  the step each restart starts from)
CASES = [
    ("fsdp1", "FULL_SHARD", "shm", {"FLATSHARD_SNAPSHOT_FAULT": "copy:2:0"},
     ["--kill2", "backward:4", "--kill-rank", "1"], [2, 4]),
    ("fsdp2", "SHARD_GRAD_OP", "torch", {"FLATSHARD_SNAPSHOT_FAULT": "commit:2:1"},
     ["--kill2", "optim:3", "--kill-rank", "0"], [3, 3]),
    ("fsdp1", "HYBRID_SHARD", "torch", {}, ["--kill", "optim:2", "--kill-rank", "1"], [2]),
    ("fsdp2", "HYBRID_SHARD", "shm", {}, ["--kill", "forward:3", "--kill-rank", "0"], [3]),
]


@pytest.mark.deadline(900)
@pytest.mark.parametrize("api,strategy,backend,fault,kills,starts", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_killed_rank_resumes_bit_equal(tmp_path, api, strategy, backend, fault, kills, starts):
    env = dict(fault, FLATSHARD_COMM_BACKEND=backend)
    proc = torchrun(tmp_path, "--api", api, "--strategy", strategy, "--steps", "6",
                    "--reference", *kills, env=env)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    # every restart resumed from the step after the last one every rank held:
    # the step before the kill, or the one before it where the kill landed
    # before every rank had announced that step (commit() counts a step once
    # all announced it; the step is run again, nothing is lost)
    for run, start in enumerate(starts, 1):
        assert any(f"rank 0 run {run} starts at step {s}" in log for s in (start, start - 1)), \
            log[-6000:]
    for rank in range(2):
        verdict = json.loads((tmp_path / f"out.rank{rank}.json").read_text())
        assert verdict.pop("start") in (starts[-1], starts[-1] - 1), (rank, log[-4000:])
        assert verdict == {"params": True, "optim": True, "lr": True, "drawn": True,
                           "state_steps": [6]}, (rank, log[-4000:])
    assert not [s for s in list_segments() if s["job"] in log], "a finished run left segments"


# ---------------------------------------------------------------------------
# on a pool of ranks: what cannot be restored


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def _model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(7, 9), torch.nn.Linear(9, 3))
    model = flatshard.FullyShardedDataParallel(m, device_id=torch.device("cpu"))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _steps(model, opt, snaps, counter, start, stop):
    for step in range(start, stop):
        g = torch.Generator().manual_seed(step * 10 + dist.get_rank())
        model(torch.randn(4, 7, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        counter.n += 1
        snaps.commit(step)


def _crash(snaps):
    """As a SIGKILL would: the segment stays, nothing else is done."""
    snaps._snap.wait()
    snaps._snap.close()
    snaps._snap = None
    snaps._hook.remove()


def _train_and_crash(job, steps, every=1):
    model, opt = _model()
    counter = Counter()
    snaps = flatshard.Snapshots(model, opt, [counter], job=job, every=every)
    assert snaps.restore() == 0
    _steps(model, opt, snaps, counter, 0, steps)
    _crash(snaps)
    return [p.detach().clone() for p in model.parameters()], counter.n


def _restore(job, every=1, checkpoint_dir=None):
    model, opt = _model()
    counter = Counter()
    snaps = flatshard.Snapshots(model, opt, [counter], job=job, every=every,
                                checkpoint_dir=checkpoint_dir)
    try:
        start = snaps.restore()
        return start, counter.n, [p.detach().clone() for p in model.parameters()], \
            snaps.committed
    except flatshard.SnapshotError as e:
        return str(e)
    finally:
        _crash(snaps) if snaps._snap is not None else None


def _damage(job, rank, step):
    """Change one byte of `step`'s first part in rank's segment."""
    import mmap
    seg = [s for s in list_segments(job) if s["rank"] == rank][0]
    snap = flatshard._C.Snapshot(seg["name"], create=False)
    slot = [i for i, s in enumerate(snap.slots()) if s[1] == step][0]
    n = snap.part_bytes(slot, 0)
    t = torch.empty(n, dtype=torch.uint8)
    snap.read(slot, 0, t.data_ptr(), n)
    snap.close()
    with open("/dev/shm" + seg["name"], "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        at = bytes(m).find(t.numpy().tobytes())
        m[at + 3] ^= 1


def _scenario(job, what):
    rank = dist.get_rank()
    if what == "resume":
        _train_and_crash(job, 6)  # the crash: steps 4 (agreed) and 5 (copied) held
        start, count, _, committed = _restore(job)
        return start, committed, count
    if what == "damaged":
        _train_and_crash(job, 4)  # steps 2 (agreed) and 3 held
        dist.barrier()
        if rank == 1:
            _damage(job, 1, 3)
        dist.barrier()
        first = _restore(job)       # rank 1's step 3 is damaged: step 2 is restored
        dist.barrier()
        if rank == 1:
            _damage(job, 1, 2)
        dist.barrier()
        return first[0], first[1], _restore(job)
    if what == "lost":
        _train_and_crash(job, 3)
        dist.barrier()
        if rank == 1:  # its host's memory is gone
            flatshard._C.snapshot_unlink(names.segment_name(job, 1))
        dist.barrier()
        return _restore(job, checkpoint_dir="/nonexistent/ckpt")
    if what == "every":
        _train_and_crash(job, 7, every=3)  # snapshots of steps 0, 3 and 6
        return _restore(job, every=3)[:2]
    raise AssertionError(what)


@pytest.fixture
def job(request):
    name = f"t{os.getpid()}_{request.node.name[:40]}".replace("[", "_").replace("]", "")
    name = "".join(c if c.isalnum() or c in "_." else "_" for c in name)
    yield name
    remove_segments(name)
    remove_segments(name + "-ref")


def test_restore_agrees_on_the_newest_step_every_rank_holds(dist_pool, job):
    for start, committed, count in dist_pool(2).run(_scenario, job, "resume"):
        # step 5 was copied whole by every rank, though not yet agreed on: it counts
        assert (start, committed, count) == (6, 5, 6)


def test_a_damaged_part_is_named_and_the_older_step_used(dist_pool, job):
    for rank, (start, count, err) in enumerate(dist_pool(2).run(_scenario, job, "damaged")):
        assert (start, count) == (3, 3)
        assert "no step of job" in err and "is held whole by every rank" in err
        assert "rank 1: holds steps none; step 2 in /flatshard-snap-" in err
        assert "tensor part 0 fails its CRC-32C" in err


def test_a_lost_segment_names_the_step_and_the_checkpoint(dist_pool, job):
    for err in dist_pool(2).run(_scenario, job, "lost"):
        assert "rank 0: holds steps [1, 2]" in err and "rank 1: holds steps none" in err
        assert "the newest any rank holds: 2" in err
        assert "No checkpoint on disk to resume from either" in err and "/nonexistent" in err


def test_every_k_steps(dist_pool, job):
    for start, count in dist_pool(2).run(_scenario, job, "every"):
        assert (start, count) == (7, 7)  # steps 3 and 6 held whole by both ranks


def _world_change(job, steps):
    if steps:
        return _train_and_crash(job, steps)[1]
    return _restore(job)


def test_another_world_size_is_refused(dist_pool, job):
    dist_pool(2).run(_world_change, job, 3)
    [err] = dist_pool(1).run(_world_change, job, 0)
    assert "taken at world size [2], this job has 1 ranks" in err
    assert "not built" in err


def _budget_and_cleanup(job):
    model, opt = _model()
    snaps = flatshard.Snapshots(model, opt, job=job, budget=4096)
    with pytest.raises(flatshard.ConfigError, match=r"budget=4096 \(or "
                       r"FLATSHARD_SNAPSHOT_BUDGET\) is too small: .*over the budget"):
        snaps.commit(0)
    snaps.close()
    with flatshard.Snapshots(model, opt, job=job) as snaps:
        assert snaps.restore() == 0
        model(torch.ones(2, 7)).sum().backward()
        opt.step()
        snaps.commit(0)
        used = snaps.segment_bytes
        assert snaps.name in [s["name"] for s in list_segments(job)]
    dist.barrier()
    return used, [s["name"] for s in list_segments(job)]


def test_budget_refused_and_segments_removed_at_the_end(dist_pool, job):
    for used, left in dist_pool(2).run(_budget_and_cleanup, job):
        assert used > 4096 and left == []


def test_bad_arguments_are_named():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(flatshard.ConfigError, match="every=0"):
        flatshard.Snapshots(model, opt, every=0)
    with pytest.raises(flatshard.ConfigError, match="optimizer is list"):
        flatshard.Snapshots(model, [opt])
    with pytest.raises(flatshard.ConfigError, match="stateful object '0:int'"):
        flatshard.Snapshots(model, opt, [3])
    with pytest.raises(flatshard.ConfigError, match="budget=-1"):
        flatshard.Snapshots(model, opt, budget=-1)


@pytest.mark.deadline(900)
def test_example_resumes_with_the_same_losses(tmp_path):
    def run(*args):
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               "--nproc-per-node", "2", "--max-restarts", "1",
                               os.path.join(ROOT, "examples", "train_resilient.py"),
                               "--steps", "6", "--seq", "16", "--batch", "2"] + list(args),
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        return proc.stdout
    import re
    clean, killed = run(), run("--kill-at", "3")
    assert "run 1, starting at step 3" in killed
    losses = [dict(re.findall(r"step +(\d+)  loss (\d+\.\d+)", out)) for out in (clean, killed)]
    assert sorted(losses[0]) == [str(i) for i in range(6)]
    assert losses[0] == losses[1]  # steps 0-2 from the first run, 3-5 after the restart
