"""Two or more builds of the shm backend in the same ranks, taking turns call block by call block.

    python3 benchmarks/bench_comm_ab.py OLD.so NEW.so [...] [--world 2] [--mib 64]
                                        [--kib N] [--rounds 15] [--calls 4]
                                        [--slots 8388608,...]

Each .so is a build of flatshard._C (copy python/flatshard/_C*.so aside
before rebuilding). Every rank loads all of them, makes one shm Comm from
each (a segment of its own), and in every round times `--calls` all-gathers
and then `--calls` reduce-scatters of float32 through each build in turn, so
that load from other work on a shared machine falls on every build alike;
bench_comm.py run once per build cannot tell a 20% change from the drift of
a busy host. Size is the full buffer as in bench_comm.py (all-gather output,
reduce-scatter input); GB/s = size / (rank 0's time per call), median
[min-max] over the rounds, and the median microseconds per call (--kib
sizes the buffer in KiB instead: a tiny unit's collectives, where the
hand-offs decide). --slots gives each build's slot bytes (as
FLATSHARD_SHM_SLOT_BYTES would), so one build can also be compared with
itself at several slot sizes. The load average is printed before and after.
"""
import argparse
import importlib.util
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid

os.environ["OMP_NUM_THREADS"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from harness import cpu_name  # noqa: E402


def load_build(path):
    spec = importlib.util.spec_from_file_location("flatshard._C", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def attach(mod, rank, world, name, slot_bytes):
    """Rank 0 creates the segment; the others retry until it is there."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return mod.Comm("shm", rank, world, name=name, create=rank == 0,
                            slot_bytes=slot_bytes, timeout_s=60.0)
        except Exception:
            if rank == 0 or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def worker(rank, args, names, q):
    torch.set_num_threads(1)
    mods = [load_build(p) for p in args.builds]
    comms = [attach(m, rank, args.world, n, s) for m, n, s in zip(mods, names, args.slots)]
    n = args.size // 4 // args.world
    shard, full = torch.ones(n), torch.ones(n * args.world)
    f32 = mods[0].F32
    res = {}
    for _ in range(args.rounds):
        for b, c in enumerate(comms):
            calls = {"ag": lambda: c.all_gather(shard.data_ptr(), full.data_ptr(), n, f32, ""),
                     "rs": lambda: c.reduce_scatter(full.data_ptr(), shard.data_ptr(), n, f32,
                                                    False, "")}
            for op, fn in calls.items():
                fn()
                c.barrier()
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                c.barrier()
                res.setdefault((b, op), []).append((time.perf_counter() - start) / args.calls)
    q.put((rank, res))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="paths of flatshard._C builds")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--kib", type=int, default=0, help="the size in KiB (instead of --mib)")
    ap.add_argument("--slots", default="", help="slot bytes per build, comma-separated")
    args = ap.parse_args()
    args.size = args.kib << 10 if args.kib else args.mib << 20
    args.slots = ([int(x) for x in args.slots.split(",")] if args.slots
                  else [8 << 20] * len(args.builds))
    if len(args.slots) != len(args.builds):
        ap.error("--slots needs one size per build")
    names = [f"/flatshard-ab-{os.getpid()}-{i}-{uuid.uuid4().hex[:6]}"
             for i in range(len(args.builds))]
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    before = os.getloadavg()[0]
    procs = [ctx.Process(target=worker, args=(r, args, names, q)) for r in range(args.world)]
    for p in procs:
        p.start()
    out = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    size = args.size
    print(f"{cpu_name()}, {args.world} ranks, {size / 1024:g} KiB, {args.rounds} rounds x "
          f"{args.calls} calls, load {before:.2f} -> {os.getloadavg()[0]:.2f}")
    for op, what in (("ag", "all-gather"), ("rs", "reduce-scatter")):
        for b, path in enumerate(args.builds):
            bw = sorted(size / t / 1e9 for t in out[0][(b, op)])
            us = statistics.median(out[0][(b, op)]) * 1e6
            print(f"  {what:14s} {os.path.basename(path):24s} slot {args.slots[b]:>9d}: "
                  f"{statistics.median(bw):6.2f} [{bw[0]:.2f}-{bw[-1]:.2f}] GB/s, {us:.2f} us")


if __name__ == "__main__":
    main()
