"""torch.compile on fully_shard: torch's against flatshard's, compiled and eager.

    python3 benchmarks/bench_compile.py [--steps 10] [--warmup 3] [--rounds 1]
        [--impl torch-eager,fully_shard-eager,torch-compiled,fully_shard-compiled]

The model is models.py's transformer (GPT: 4 pre-LayerNorm blocks, d_model
256, 4 heads, vocab 1024, seq 128), batch 8 per rank, fully_shard on each
block and the root, SGD step. Two ranks on one host, one thread each, a gloo
process group: torch's fully_shard runs its collectives on it, flatshard's on
its default backend (shared memory). Every impl runs in the same two
processes, one after the other (in `rounds` interleaved rounds), each from
torch._dynamo.reset() with inductor's caches off, so that the impl compiled
second does not reuse the first one's kernels (the blocks' graphs are the
same). Each step starts at a barrier and counts as the slower rank's time.

Printed: the compile time (the first step's time, which compiles forward and
backward, less the median step), the median and spread of the steps after
`warmup`, the ratio of flatshard to torch for the same mode, the graph
breaks torch._dynamo.explain counts, and the first and last losses, which
must agree between impls (same seed, same math).
"""
import argparse
import datetime
import os
import statistics
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, inherited by the ranks

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import transformer_spec  # noqa: E402
from harness import cpu_name, impl_list, run_ranks  # noqa: E402

WORLD = 2
IMPLS = ("torch-eager", "fully_shard-eager", "torch-compiled", "fully_shard-compiled")


def build(impl, spec):
    from torch.distributed.device_mesh import init_device_mesh
    if impl.startswith("torch"):
        from torch.distributed.fsdp import fully_shard
    else:
        from flatshard import fully_shard
    torch.manual_seed(0)
    model = spec["build"]()
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def graph_breaks(impl, spec, rank):
    torch._dynamo.reset()
    inputs, _ = spec["make_batch"](rank)
    count = torch._dynamo.explain(build(impl, spec))(inputs).graph_break_count
    torch._dynamo.reset()
    return count


def run_impl(impl, rank, spec, args):
    torch._dynamo.reset()
    model = build(impl, spec)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    run = torch.compile(model) if impl.endswith("compiled") else model
    inputs, targets = spec["make_batch"](rank)
    times, losses = [], []
    for _ in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        loss = spec["loss_fn"](run(inputs), targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(dt.item() * 1e3)
        losses.append(loss.item())
    del run, model
    torch._dynamo.reset()
    return times, losses


def worker(rank, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torch._inductor import config as inductor_config
    inductor_config.force_disable_caches = True
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=1800))
    spec = transformer_spec()
    try:
        res = {}
        for _ in range(args.rounds):
            for impl in args.impl:
                try:
                    t, losses = run_impl(impl, rank, spec, args)
                except Exception as e:  # one failing impl does not end the run
                    res.setdefault(impl, {"error": f"{type(e).__name__}: {e}"})
                    continue
                r = res.setdefault(impl, {"first": [], "times": [], "losses": losses})
                r["first"].append(t[0])
                r["times"] += t[args.warmup:]
        for impl in args.impl:
            if impl.endswith("compiled") and "times" in res.get(impl, {}):
                res[impl]["breaks"] = graph_breaks(impl, spec, rank)
        if rank == 0:
            out.put(res)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds of every impl")
    p.add_argument("--impl", default=",".join(IMPLS))
    args = p.parse_args()
    args.impl = impl_list(p, args, IMPLS)
    if args.warmup < 1:
        p.error("--warmup: at least 1 (the first step compiles)")
    res = run_ranks(worker, WORLD, args)
    cpu = cpu_name()
    print(f"# {cpu}; torch {torch.__version__}; {WORLD} ranks, 1 thread each; load "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} at the end")
    print("# GPT (4 blocks, d_model 256, seq 128, vocab 1024), batch 8 per rank, SGD; "
          f"{args.rounds} round(s) x {args.steps} timed steps after {args.warmup} warm-up")
    print("| impl | compile s | median ms | p10-p90 ms | flatshard/torch | graph breaks "
          "| first, last loss |")
    print("|---|---|---|---|---|---|---|")
    med = {}
    for impl in args.impl:
        r = res.get(impl, {})
        if "times" in r:
            med[impl] = statistics.median(r["times"])
    for impl in args.impl:
        r = res.get(impl, {})
        if "times" not in r:
            print(f"| {impl} | failed: {r.get('error', 'not run')[:80]} | | | | | |")
            continue
        t = sorted(r["times"])
        lo, hi = t[len(t) // 10], t[(9 * len(t)) // 10]
        compile_s = "-"
        if impl.endswith("compiled"):
            compile_s = f"{statistics.median(r['first']) / 1e3 - med[impl] / 1e3:.1f}"
        mode = impl.split("-", 1)[1]
        ratio = "-"
        if impl.startswith("fully_shard") and f"torch-{mode}" in med:
            ratio = f"{med[impl] / med[f'torch-{mode}']:.2f}"
        print(f"| {impl} | {compile_s} | {med[impl]:.1f} | {lo:.1f}-{hi:.1f} | {ratio} "
              f"| {r.get('breaks', '-')} | {r['losses'][0]:.6f}, {r['losses'][-1]:.6f} |")


if __name__ == "__main__":
    main()
