"""What flatshard.Snapshots costs: bench_step.py's transformer at 2 ranks
(FSDP1 wrapper, FULL_SHARD, AdamW), side by side in the same processes.

    python3 benchmarks/bench_snapshots.py [--steps 30] [--warmup 3]

1. The step with a snapshot every step against the same model without:
   the two models take turns step by step; each step starts at a barrier,
   counts as the slower rank's time and includes commit() (and the wait in
   the next optimizer.step for the copy, when it was not done).
2. Host memory: each rank's segment against its fp32 parameter shard plus
   optimizer state (one copy).
4. The same snapshots with the buddy copy (each rank taken as a host of
   its own: FLATSHARD_SNAPSHOT_HOST_RANKS=1), a third model in the turns.
3. The restore after a crash, in the restarted process, against a restart
   from flatshard.save_checkpoint on local disk (a temporary directory):
   from a freshly built model to the end of the next step, both ways. The
   process restart itself (torchrun noticing, spawning, importing torch,
   the process group) is the same for both and not counted here.
"""
import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import cpu_name, run_ranks  # noqa: E402
from models import MODELS  # noqa: E402

import flatshard  # noqa: E402
from flatshard.snapshots.record import local, nbytes  # noqa: E402

WORLD = 2


def build(spec):
    torch.manual_seed(0)
    model = flatshard.FullyShardedDataParallel(
        spec["build"](), auto_wrap_policy=flatshard.ModuleWrapPolicy({spec["unit_cls"]}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def step(model, opt, spec, batch, snaps=None, i=0):
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad()
    spec["loss_fn"](model(batch[0]), batch[1]).backward()
    opt.step()
    if snaps is not None:
        snaps.commit(i)
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item() * 1e3


def worker(rank, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    spec = MODELS["transformer"]()
    batch = spec["make_batch"](rank)
    job = f"bench{port}"
    res = {"plain": [], "snap": [], "buddy": []}
    plain, snapped, buddied = build(spec), build(spec), build(spec)
    snaps = flatshard.Snapshots(*snapped, job=job)
    snaps.restore()
    # the buddy copy: each rank a host of its own (the copy goes over gloo)
    os.environ["FLATSHARD_SNAPSHOT_HOST_RANKS"] = "1"
    bsnaps = flatshard.Snapshots(*buddied, job=job + "b")
    del os.environ["FLATSHARD_SNAPSHOT_HOST_RANKS"]
    bsnaps.restore()
    n = 0
    for _ in range(args.warmup):
        step(*plain, spec, batch)
        step(*snapped, spec, batch, snaps, n)
        step(*buddied, spec, batch, bsnaps, n)
        n += 1
    for i in range(args.steps):
        order = [("plain", plain, None), ("snap", snapped, snaps), ("buddy", buddied, bsnaps)]
        order = order[i % 3:] + order[:i % 3]
        for name, m, s in order:
            res[name].append(step(*m, spec, batch) if s is None else
                             step(*m, spec, batch, s, n))
        n += 1
    res["buddy_segment_bytes"] = bsnaps.segment_bytes
    bsnaps.close()
    snaps._snap.wait()
    model, opt = snapped
    state = sum(nbytes(local(p)) for p in model.parameters()) + sum(
        nbytes(local(v)) for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
    res["segment_bytes"], res["state_bytes"] = snaps.segment_bytes, state

    # 3. a crash right after the last commit; the restarted process's model
    restore_ms, disk_ms = [], []
    ckroot = tempfile.mkdtemp(prefix="bench-snap-ckpt-") if rank == 0 else None
    box = [ckroot]
    dist.broadcast_object_list(box)
    for r in range(args.restores):
        flatshard.save_checkpoint(os.path.join(box[0], f"c{r}"), model, opt)
        snaps._snap.wait()
        # the restarted process builds its model, then restores and steps
        fresh = build(spec)
        dist.barrier()
        t0 = time.perf_counter()
        again = flatshard.Snapshots(*fresh, job=job)
        again.restore()
        step(*fresh, spec, batch)
        restore_ms.append((time.perf_counter() - t0) * 1e3)
        again._hook.remove()
        again._snap.close()
        again._snap = None
        fresh = build(spec)
        dist.barrier()
        t0 = time.perf_counter()
        flatshard.load_checkpoint(os.path.join(box[0], f"c{r}"), *fresh)
        step(*fresh, spec, batch)
        disk_ms.append((time.perf_counter() - t0) * 1e3)
    t = torch.tensor([statistics.median(restore_ms), statistics.median(disk_ms)],
                     dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    res["restore_ms"], res["disk_ms"] = t.tolist()
    snaps.close()
    if rank == 0:
        import shutil
        shutil.rmtree(box[0], ignore_errors=True)
        out.put(res)
    dist.barrier()
    dist.destroy_process_group()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--restores", type=int, default=3)
    args = p.parse_args()
    res = run_ranks(worker, WORLD, args)
    print(f"CPU: {cpu_name()}; torch {torch.__version__}; {WORLD} ranks, one thread each")
    for name in ("plain", "snap", "buddy"):
        xs = res[name]
        print(f"{name:6s} step median {statistics.median(xs):8.2f} ms  "
              f"p10-p90 {pct(xs, .1):.2f}-{pct(xs, .9):.2f}")
    ratio = statistics.median(res["snap"]) / statistics.median(res["plain"])
    print(f"snapshots every step: x{ratio:.3f} of the step ({(ratio - 1) * 100:+.1f}%)")
    ratio = statistics.median(res["buddy"]) / statistics.median(res["plain"])
    print(f"with the buddy copy (each rank a host): x{ratio:.3f} of the step "
          f"({(ratio - 1) * 100:+.1f}%); own + held buddy segments "
          f"{res['buddy_segment_bytes']:,} bytes")
    print(f"segment {res['segment_bytes']:,} bytes; shard + optimizer state "
          f"{res['state_bytes']:,} bytes: x{res['segment_bytes'] / res['state_bytes']:.2f} "
          "(two slots)")
    print(f"restore + next step {res['restore_ms']:.1f} ms; load_checkpoint (local disk) + "
          f"next step {res['disk_ms']:.1f} ms: x{res['restore_ms'] / res['disk_ms']:.2f}")


if __name__ == "__main__":
    main()
