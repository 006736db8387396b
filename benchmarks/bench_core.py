"""Side-by-side step time and per-rank memory: torch vs flatshard (FSDP1 and FSDP2 APIs).

    python3 benchmarks/bench_core.py [--steps N] [--warmup K]
        [--impl torch,flatshard,flatshard-gloo] [--model transformer,tiny64]
        [--strategy FULL_SHARD]
    python3 benchmarks/bench_core.py --impl torch-fsdp2,flatshard-fsdp2,flatshard-fsdp2-gloo

Impls: "torch" is torch's FSDP1; "flatshard" is flatshard with its default
collective backend (shared memory between ranks of one host); "flatshard-gloo"
is flatshard over the same gloo process group torch uses (comm_backend="torch").
FSDP2's API (fully_shard on every block, then on the root): "torch-fsdp2" is
torch's fully_shard; "flatshard-fsdp2" is flatshard.fully_shard on its default backend and
"flatshard-fsdp2-gloo" the same over gloo (FLATSHARD_COMM_BACKEND=torch).
Ratios are printed against "torch" and, for the fully_shard impls, against
"torch-fsdp2".

For every (model, impl) pair this spawns a fresh 2-rank gloo process group on
CPU (BENCH_WORLD=N in the environment: N ranks; 1 shows each wrapper's cost
over the model alone, with nothing to shard), one intra-op thread per rank,
its own port, builds the model from the same seed, wraps it with the impl's
FullyShardedDataParallel (one unit per block via torch's ModuleWrapPolicy)
and trains it with AdamW on a fixed per-rank batch. It reports:

* step time (zero_grad, forward, backward, optimizer step): each step starts
  at a barrier and counts as the slowest rank's time; median and mean over the
  timed steps.  "transformer" (4 GPT blocks, d_model 256) is compute-bound and
  shows whether flatshard adds cost on real work; "tiny64" (64 wrapped
  Linear(32,32) units) is dominated by per-unit overhead (hooks, collective
  calls, flattening), where implementation differences show up most.
* bytes held per rank after a step (max over ranks) by the parameter storages,
  the gradient storages and the optimizer state, each deduplicated by storage,
  plus the growth of peak RSS over the run: the point of sharding is that
  these are ~1/world_size of the unsharded model.
* the first losses of each impl: both do the same math, so they should agree
  to ~1e-5; a mismatch means the faster number is not a valid comparison.

A failure in one impl is printed and the remaining runs go on.
"""
import argparse
import datetime
import os
import resource
import shlex
import statistics
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, inherited by the ranks

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import MODELS  # noqa: E402
from harness import free_port  # noqa: E402

def _world():
    raw = os.environ.get("BENCH_WORLD", "2")
    if not raw.isdigit() or int(raw) < 1:
        sys.exit(f"bench_core: BENCH_WORLD must be a positive whole number of ranks, not {raw!r}")
    return int(raw)


WORLD = _world()
N_LOSSES = 3
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
REPO_PYTHON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")


def import_impl(impl):
    """Returns (FullyShardedDataParallel, ShardingStrategy, extra kwargs) of the impl."""
    if impl == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        return FullyShardedDataParallel, ShardingStrategy, {}
    try:
        import flatshard
    except ModuleNotFoundError as e:  # not installed: use the source tree
        if e.name != "flatshard":
            raise
        sys.path.insert(0, REPO_PYTHON)
        import flatshard
    extra = {"comm_backend": "torch"} if impl == "flatshard-gloo" else {}
    return flatshard.FullyShardedDataParallel, flatshard.ShardingStrategy, extra


FSDP2_IMPLS = ("torch-fsdp2", "flatshard-fsdp2", "flatshard-fsdp2-gloo")


def fully_shard_model(impl, spec):
    """FSDP2's API: fully_shard on every unit, then on the root."""
    if impl == "torch-fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        if impl.endswith("-gloo"):
            os.environ["FLATSHARD_COMM_BACKEND"] = "torch"
        import_impl("flatshard")
        from flatshard import fully_shard
    torch.manual_seed(0)
    model = spec["build"]()
    for m in model.modules():
        if isinstance(m, spec["unit_cls"]):
            fully_shard(m)
    fully_shard(model)
    return model


def storage_bytes(tensors):
    """Bytes of the distinct storages behind `tensors` (views share one;
    a DTensor counts its local shard)."""
    seen = {}
    for t in tensors:
        t = getattr(t, "_local_tensor", t)
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def max_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def worker(rank, port, impl, model_name, args, queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # A hung collective fails after COLLECTIVE_TIMEOUT instead of stalling the run.
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=COLLECTIVE_TIMEOUT)
    try:
        spec = MODELS[model_name]()
        rss0 = max_rss_bytes()
        if impl in FSDP2_IMPLS:
            model = fully_shard_model(impl, spec)
        else:
            FSDP, ShardingStrategy, extra = import_impl(impl)
            torch.manual_seed(0)
            model = FSDP(spec["build"](), auto_wrap_policy=ModuleWrapPolicy({spec["unit_cls"]}),
                         sharding_strategy=ShardingStrategy[args.strategy],
                         device_id=torch.device("cpu"), **extra)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        inputs, targets = spec["make_batch"](rank)

        times, losses = [], []
        for step in range(args.warmup + args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad()
            loss = spec["loss_fn"](model(inputs), targets)
            loss.backward()
            opt.step()
            dt = time.perf_counter() - t0
            if step >= args.warmup:
                times.append(dt)
            if step < N_LOSSES:
                losses.append(loss.item())

        # Gradients are still held here: zero_grad runs at the start of a step.
        mem = torch.tensor([
            storage_bytes(model.parameters()),
            storage_bytes(p.grad for p in model.parameters() if p.grad is not None),
            storage_bytes(t for st in opt.state.values() for t in st.values()
                          if torch.is_tensor(t)),
            max_rss_bytes() - rss0,
        ], dtype=torch.float64)
        step_times = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        dist.all_reduce(step_times, op=dist.ReduceOp.MAX)
        if rank == 0:
            ms = [t * 1e3 for t in step_times.tolist()]
            queue.put(dict(median_ms=statistics.median(ms), mean_ms=statistics.mean(ms),
                           params=int(mem[0]), grads=int(mem[1]), optim=int(mem[2]),
                           rss=int(mem[3]), losses=losses))
        dist.barrier()  # tear down together, not while the peer still talks
    finally:
        dist.destroy_process_group()


def run_one(impl, model_name, args):
    """Runs one impl on its own process group; returns its result or None."""
    queue = mp.get_context("spawn").SimpleQueue()
    try:
        mp.spawn(worker, args=(free_port(), impl, model_name, args, queue), nprocs=WORLD)
        return queue.get()
    except Exception as e:  # report and go on with the other impls
        lines = str(e).strip().splitlines()
        print(f"  [{impl}] FAILED: " + "\n    ".join(lines[-12:]), flush=True)
        if queue.empty():
            return None
        print(f"  [{impl}] (failed after reporting its figures: they are kept)")
        return queue.get()


FIELDS = [("median_ms", "step ms (median)", "{:.2f}"), ("mean_ms", "step ms (mean)", "{:.2f}"),
          ("params", "params B/rank", "{:,}"), ("grads", "grads B/rank", "{:,}"),
          ("optim", "optim B/rank", "{:,}"), ("rss", "peak RSS delta B", "{:,}")]


def report(model_name, results):
    print(f"\n== {model_name} ==")
    rows = [["impl"] + [title for _, title, _ in FIELDS]]
    for impl, r in results.items():
        rows.append([impl] + (["FAILED"] * len(FIELDS) if r is None else
                              [fmt.format(r[key]) for key, _, fmt in FIELDS]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))

    ok = {impl: r for impl, r in results.items() if r is not None}
    if ok:
        print("first losses:")
    for impl, r in ok.items():
        print(f"  {impl:>14}: " + "  ".join(f"{x:.8f}" for x in r["losses"]))
    for base_name in ("torch", "torch-fsdp2"):
        base = results.get(base_name)
        for name, new in results.items():
            if name in ("torch", base_name) or base is None or new is None:
                continue
            if base_name == "torch-fsdp2" and name not in FSDP2_IMPLS:
                continue
            diff = max(abs(a - b) for a, b in zip(base["losses"], new["losses"]))
            print(f"  max |loss diff| {name} vs {base_name}: {diff:.2e}")
            ratios = [f"{key} {new[key] / base[key]:.3f}" if base[key] else f"{key} n/a"
                      for key, _, _ in FIELDS]
            print(f"ratio {name}/{base_name}: " + ", ".join(ratios))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--impl", default="torch,flatshard,flatshard-gloo")
    p.add_argument("--model", default="transformer,tiny64")
    p.add_argument("--strategy", default="FULL_SHARD", help="ShardingStrategy member name")
    args = p.parse_args()
    print("command:", shlex.join(sys.orig_argv))
    print(f"torch {torch.__version__}, python {sys.version.split()[0]}, world size {WORLD}, "
          f"gloo on CPU, 1 thread/rank, {args.warmup} warmup + {args.steps} timed steps")
    for model_name in args.model.split(","):
        results = {}
        for impl in args.impl.split(","):
            print(f"running {model_name} / {impl} ...", flush=True)
            results[impl] = run_one(impl, model_name, args)
        report(model_name, results)


if __name__ == "__main__":
    main()
