"""The small transformer's training step at 2 ranks against the same model unwrapped.

    python3 benchmarks/bench_step.py [--steps 30] [--warmup 3] [--rounds 3]
        [--impl unwrapped,ddp,fsdp1,fully_shard,torch-fsdp1,torch-fully_shard]

The model is benchmarks/models.py's "transformer" (4 GPT blocks, d_model
256, vocab 1024, batch 8 x 128 tokens, float32), the one bench_core.py
times, on two ranks of one host (BENCH_WORLD in the environment changes it;
a gloo process group), one thread each. A step is what training does:
zero_grad, forward, cross-entropy, backward and an AdamW step (lr 1e-3, the
same for every impl), on a fixed per-rank batch from a seeded generator, the
weights built from the same seed for every impl. The impls:

  unwrapped          the model on each rank, its own copy, no communication
                     at all: the limit no data-parallel wrapper can beat;
  ddp                torch's DistributedDataParallel over the gloo group;
  fsdp1              flatshard.FullyShardedDataParallel, FULL_SHARD, one
                     unit per block (ModuleWrapPolicy) and the root,
                     flatshard's default collective backend;
  fully_shard        flatshard.fully_shard on every block, then the root, on
                     a 1-D CPU DeviceMesh;
  torch-fsdp1        torch's FSDP1 as "fsdp1" (device_id cpu, over gloo);
  torch-fully_shard  torch's fully_shard as "fully_shard" (over gloo).

All run in the same processes, built afresh each round; after their warmup
they take turns step by step in a random order (the same on every rank), so
that this machine's drifting speed falls on every impl alike. Each step
starts at a barrier and counts as the slower rank's time. Printed: the
median and p10-p90 of the step time, "x unwrapped" (the median over
unwrapped's: what the wrapper's communication and bookkeeping add to the
same compute; 1.00 is free, ddp's figure is the cost of gradient all-reduce
alone), and rank 0's first loss, which is the same model on the same batch
for every impl. The loss after the last step of round 1 follows: the sharded
impls' should equal ddp's (same averaged gradients, same AdamW), unwrapped's
differs (each rank trains on its own batch only).
"""
import argparse
import datetime
import os
import random
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, inherited by the ranks

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import cpu_name, impl_list, print_table, run_ranks  # noqa: E402
from models import MODELS  # noqa: E402

WORLD = int(os.environ.get("BENCH_WORLD", "2"))
IMPLS = ("unwrapped", "ddp", "fsdp1", "fully_shard", "torch-fsdp1", "torch-fully_shard")
LR = 1e-3


def build(impl, spec):
    """The impl's model from seed 0, and its AdamW."""
    torch.manual_seed(0)
    model = spec["build"]()
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    elif impl in ("fsdp1", "torch-fsdp1"):
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        if impl == "fsdp1":
            from flatshard import FullyShardedDataParallel as FSDP, ShardingStrategy
            extra = {}
        else:
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy
            extra = {"device_id": torch.device("cpu")}
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({spec["unit_cls"]}),
                     sharding_strategy=ShardingStrategy.FULL_SHARD, **extra)
    elif impl in ("fully_shard", "torch-fully_shard"):
        if impl == "fully_shard":
            from flatshard import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (WORLD,))
        for m in model.modules():
            if isinstance(m, spec["unit_cls"]):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def one_step(model, opt, spec, batch):
    """One training step from a barrier; (the slower rank's ms, loss)."""
    inputs, targets = batch
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = spec["loss_fn"](model(inputs), targets)
    loss.backward()
    opt.step()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item() * 1e3, loss.item()


def run_round(impls, spec, batch, args, res, seed):
    """Every impl built and warmed up, then timed step by step in turn, in a
    new random order each step (the same on every rank). Adds {"times",
    "first", "last"} or {"error"} per impl to `res`."""
    models = {}
    for impl in impls:
        try:
            model, opt = build(impl, spec)
            first = one_step(model, opt, spec, batch)[1]
            for _ in range(args.warmup - 1):
                one_step(model, opt, spec, batch)
        except Exception as e:  # one failing impl does not end the run
            res.setdefault(impl, {"error": f"{type(e).__name__}: {e}"})
            continue
        models[impl] = (model, opt)
        res.setdefault(impl, {"times": [], "first": first})
    order = list(models)
    shuffle = random.Random(seed)  # the same orders on every rank
    for _ in range(args.steps):
        shuffle.shuffle(order)
        for impl in order:
            ms, loss = one_step(*models[impl], spec, batch)
            res[impl]["times"].append(ms)
            if seed == 0:  # round 1's, from every impl after as many steps
                res[impl]["last"] = loss
    models.clear()


def worker(rank, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=120))
    try:
        spec = MODELS["transformer"]()
        batch = spec["make_batch"](rank)
        res = {}
        for r in range(args.rounds):  # fresh models each round
            run_round(args.impl, spec, batch, args, res, seed=r)
        if rank == 0:
            out.put(res)
        dist.barrier()  # tear down together
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per round, at least 1")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds, each with every impl built afresh")
    p.add_argument("--impl", default=",".join(IMPLS))
    args = p.parse_args()
    args.impl = impl_list(p, args, IMPLS)
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--warmup, --steps and --rounds must be at least 1")
    res = run_ranks(worker, WORLD, args)
    print(f"# {cpu_name()}; torch {torch.__version__}; {WORLD} ranks, 1 thread each; "
          "transformer (4 GPT blocks, d_model 256), batch 8 x 128, AdamW step")
    print(f"# {args.rounds} rounds x {args.steps} timed steps per impl after {args.warmup} "
          "warmup, the impls taking turns step by step")
    print_table(res, args.impl)
    ref = res.get("ddp", {}).get("last")
    lasts = [(i, res[i]["last"]) for i in args.impl if "last" in res.get(i, {})]
    print(f"# loss after {args.warmup + args.steps} steps (round 1, rank 0): " + ", ".join(
        f"{i} {v:.6f}" + (f" ({v - ref:+.1e} vs ddp)" if ref is not None and i != "ddp" else "")
        for i, v in lasts))


if __name__ == "__main__":
    main()
