"""What flatshard's mistake checks (python/flatshard/checks/) cost on
bench_step.py's transformer at 2 ranks, side by side in one run.

    python3 benchmarks/bench_mistakes.py [--steps 30] [--rounds 3] [--wraps 5]

Wrap time: the FSDP1 wrapper (one unit per block) and fully_shard (every
block, then the root) built with FLATSHARD_CHECK_INIT=1 and =0 in turn
(the initial values' CRC-32C and the store exchange of item 2 are the
difference); the slower rank's time, median of --wraps each.

Step time, the impls taking turns step by step as in bench_step.py:
  fsdp1 / fully_shard            flatshard's defaults: the global optimizer
                                 step hooks installed (items 1 and 4, and 3's
                                 step count), the end-of-backward test of
                                 item 4; FULL_SHARD has no replicas to compare
  fsdp1-bare / fully_shard-bare  the same with torch's global optimizer hooks
                                 taken off for their steps (what the step
                                 costs with no check at all; the end-of-backward
                                 test, one test of an empty dict, stays)
  noshard-k1 / noshard-k0        FSDP1 NO_SHARD comparing its replicas at
                                 every step / never: the difference is one
                                 comparison (item 3); at the default k=1000
                                 a step pays a thousandth of it.
"""
import argparse
import datetime
import os
import statistics
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_step import LR, WORLD, one_step  # noqa: E402
from harness import cpu_name, print_table, run_ranks  # noqa: E402
from models import MODELS  # noqa: E402

IMPLS = ("fsdp1", "fsdp1-bare", "fully_shard", "fully_shard-bare", "noshard-k1", "noshard-k0")


def build(impl, spec):
    from flatshard import FullyShardedDataParallel as FSDP, ShardingStrategy, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    torch.manual_seed(0)
    model = spec["build"]()
    if impl.startswith("fully_shard"):
        for m in model.modules():
            if isinstance(m, spec["unit_cls"]):
                fully_shard(m)
        fully_shard(model)
    else:
        kw = {}
        if impl.startswith("noshard"):
            kw = dict(sharding_strategy=ShardingStrategy.NO_SHARD,
                      check_replicas_every=int(impl[-1]))
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({spec["unit_cls"]}), **kw)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def bare_step(model, opt, spec, batch):
    """one_step with torch's global optimizer hooks taken off."""
    from flatshard.checks import hooks
    for h in hooks._HANDLES.values():
        h.remove()
    hooks._HANDLES.clear()
    try:
        return one_step(model, opt, spec, batch)
    finally:
        hooks.install(after=True)


def wrap_times(spec, wraps):
    """{label: [the slower rank's seconds]} for each wrapper, init check on/off."""
    from flatshard import FullyShardedDataParallel as FSDP, fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    out = {}
    for i in range(wraps + 1):  # the first: untimed (the Comms are made then)
        for wrapper in ("fsdp1", "fully_shard"):
            for on in ("1", "0"):
                torch.manual_seed(0)
                model = spec["build"]()
                os.environ["FLATSHARD_CHECK_INIT"] = on
                dist.barrier()
                t0 = time.perf_counter()
                if wrapper == "fsdp1":
                    FSDP(model, auto_wrap_policy=ModuleWrapPolicy({spec["unit_cls"]}))
                else:
                    for m in model.modules():
                        if isinstance(m, spec["unit_cls"]):
                            fully_shard(m)
                    fully_shard(model)
                dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i:
                    out.setdefault(f"{wrapper} init check {'on' if on == '1' else 'off'}",
                                   []).append(dt.item())
    del os.environ["FLATSHARD_CHECK_INIT"]
    return out


def worker(rank, port, args, out):
    import random
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    try:
        spec = MODELS["transformer"]()
        batch = spec["make_batch"](rank)
        wraps = wrap_times(spec, args.wraps)
        res = {}
        for r in range(args.rounds):
            models = {}
            for impl in IMPLS:
                model, opt = build(impl, spec)
                first = one_step(model, opt, spec, batch)[1]
                for _ in range(2):
                    one_step(model, opt, spec, batch)
                models[impl] = (model, opt)
                res.setdefault(impl, {"times": [], "first": first})
            order = list(models)
            shuffle = random.Random(r)
            for _ in range(args.steps):
                shuffle.shuffle(order)
                for impl in order:
                    step = bare_step if impl.endswith("-bare") else one_step
                    res[impl]["times"].append(step(*models[impl], spec, batch)[0])
            models.clear()
        if rank == 0:
            out.put((wraps, res))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--wraps", type=int, default=5)
    args = p.parse_args()
    wraps, res = run_ranks(worker, WORLD, args)
    print(f"# {cpu_name()}; torch {torch.__version__}; {WORLD} ranks, 1 thread each; "
          "bench_step.py's transformer, AdamW")
    print("| wrap | median ms | min-max ms |")
    print("|---|---|---|")
    for label, ts in wraps.items():
        print(f"| {label} | {statistics.median(ts) * 1e3:.1f} | "
              f"{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} |")
    print()
    print_table(res, IMPLS)
    med = {i: statistics.median(res[i]["times"]) for i in IMPLS}
    for a, b in (("fsdp1", "fsdp1-bare"), ("fully_shard", "fully_shard-bare"),
                 ("noshard-k1", "noshard-k0")):
        print(f"# {a} / {b}: {med[a] / med[b]:.4f}")
    per_check = med["noshard-k1"] - med["noshard-k0"]
    print(f"# one replica comparison: {per_check:.3f} ms; at k=1000: "
          f"{per_check / 1000 / med['noshard-k0'] * 100:.4f}% of the NO_SHARD step")


if __name__ == "__main__":
    main()
