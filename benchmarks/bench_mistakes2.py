"""What flatshard's checks of silent mistakes cost (items: a Comm's
known-answer check, settings that change nothing, parameters read outside
forward), side by side with them off, in one run.

    python3 benchmarks/bench_mistakes2.py [--reps 15] [--steps 20] [--rounds 2]

Two ranks of one host over gloo, one thread each (bench_step.py's set-up).
  construction  comm_for on a new group, shm and torch backends, with the
                known-answer check (runtime/comm_check.py) and with it
                replaced by a no-op, taking turns; ms per Comm.
  step          bench_step.py's transformer step (fsdp1 and fully_shard, one
                unit per block), and fully_shard again with its method guards
                off (fsdp2/outside_forward.py: the only check on a step's
                path); the impls take turns step by step.
  guard         ns per call of a public method through its guard and without
                (rank 0, a method returning its argument): what a model whose
                forward calls public methods pays per call.
Printed: medians with p10-p90, and each "on" over its "off".
"""
import argparse
import datetime
import os
import random
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_step  # noqa: E402
from harness import cpu_name, run_ranks  # noqa: E402
from models import MODELS  # noqa: E402


def _stats(xs):
    xs = sorted(xs)
    q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return q(0.5), q(0.1), q(0.9)


def _construction(reps):
    from flatshard.runtime import comm as fcomm
    real = fcomm.check_reductions
    out = {}
    for r in range(reps):
        for backend in ("shm", "torch"):
            for on in (r % 2 == 0, r % 2 == 1):  # alternate which goes first
                fcomm.check_reductions = real if on else (lambda *a, **k: None)
                group = dist.new_group(backend="gloo")
                dist.barrier()
                t0 = time.perf_counter()
                fcomm.comm_for(group, backend)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                out.setdefault((backend, on), []).append(dt.item() * 1e3)
    fcomm.check_reductions = real
    return out


def _build(impl, spec):
    from flatshard.fsdp2 import api, outside_forward
    if impl != "fully_shard (guards off)":
        return bench_step.build(impl, spec)
    real = outside_forward.guarded_methods
    api._CLASSES.clear()
    outside_forward.guarded_methods = lambda cls, base: {}
    try:
        return bench_step.build("fully_shard", spec)
    finally:
        outside_forward.guarded_methods = real
        api._CLASSES.clear()


def _steps(args):
    spec = MODELS["transformer"]()
    batch = spec["make_batch"](dist.get_rank())
    impls = ["fsdp1", "fully_shard", "fully_shard (guards off)"]
    times = {i: [] for i in impls}
    for rnd in range(args.rounds):
        models = {}
        for impl in impls:
            model, opt = _build(impl, spec)
            for _ in range(3):
                bench_step.one_step(model, opt, spec, batch)
            models[impl] = (model, opt)
        order, shuffle = list(impls), random.Random(rnd)
        for _ in range(args.steps):
            shuffle.shuffle(order)
            for impl in order:
                times[impl].append(bench_step.one_step(*models[impl], spec, batch)[0])
    return times


def _guard_ns(n=200_000):
    from flatshard.fsdp2.outside_forward import _guard

    class M:
        def f(self, x):
            return x
    m, plain, guarded = M(), M.f, _guard(M.f, "f")
    best = {}
    for name, fn in (("plain", plain), ("guarded", guarded)) * 3:
        t0 = time.perf_counter()
        for _ in range(n):
            fn(m, 1)
        best[name] = min(best.get(name, 1e9), (time.perf_counter() - t0) / n * 1e9)
    return best


def worker(rank, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    try:
        res = {"construction": _construction(args.reps), "step": _steps(args),
               "guard": _guard_ns() if rank == 0 else None}
        if rank == 0:
            out.put(res)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    res = run_ranks(worker, 2, args)
    print(f"# {cpu_name()}; torch {torch.__version__}; 2 ranks, 1 thread each")
    print("| construction (comm_for) | check on, ms | check off, ms | on / off |")
    print("|---|---|---|---|")
    for backend in ("shm", "torch"):
        on, off = _stats(res["construction"][(backend, True)]), \
            _stats(res["construction"][(backend, False)])
        print(f"| {backend} | {on[0]:.2f} ({on[1]:.2f}-{on[2]:.2f}) | "
              f"{off[0]:.2f} ({off[1]:.2f}-{off[2]:.2f}) | {on[0] / off[0]:.2f} |")
    print("| step (transformer) | median ms (p10-p90) | over fully_shard (guards off) |")
    print("|---|---|---|")
    base = _stats(res["step"]["fully_shard (guards off)"])[0]
    for impl, xs in res["step"].items():
        m, lo, hi = _stats(xs)
        print(f"| {impl} | {m:.2f} ({lo:.2f}-{hi:.2f}) | {m / base:.3f} |")
    g = res["guard"]
    print(f"# a public method's call: {g['plain']:.0f} ns plain, {g['guarded']:.0f} ns guarded "
          f"(+{g['guarded'] - g['plain']:.0f} ns per call)")


if __name__ == "__main__":
    main()
