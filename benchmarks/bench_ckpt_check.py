"""load_checkpoint with and without the manifest check, side by side.

    python3 benchmarks/bench_ckpt_check.py [--rounds 15] [--d-model 256]

The model is benchmarks/models.py's "transformer" (bench_step.py's: 4 GPT
blocks, d_model 256, vocab 1024; --d-model makes it wider) wrapped by
flatshard's FSDP1 wrapper (one unit per block), with AdamW state after one
step, on two ranks of one host (gloo), one thread each. It is saved once
with flatshard.save_checkpoint; then each round loads it into a fresh model
and optimizer twice, in a random order (the same on every rank):

  checked    load_checkpoint as it is: every file's size and CRC-32C against
             the manifest (the ranks sharing the files), then DCP's load;
  unchecked  the same load with the check replaced by a plain read of
             .metadata (what load_checkpoint did before the manifest).

Each load starts at a barrier and counts as the slower rank's time. Also
timed: the check alone (manifest.check, one rank's share, and the exchange).
The files are in the page cache (just written, read every round): what a
load right after a save, or on a host with memory to spare, pays; from a
cold disk both loads read every byte once more, and the check's share
is read twice (once by the check, once by DCP).
"""
import argparse
import datetime
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

os.environ["OMP_NUM_THREADS"] = "1"  # before torch is imported, inherited by the ranks

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import cpu_name, run_ranks  # noqa: E402
from models import GPT, Block  # noqa: E402

WORLD = 2


def build(d_model):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from flatshard import FullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    model = FSDP(GPT(d_model=d_model), auto_wrap_policy=ModuleWrapPolicy({Block}))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def timed(fn):
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item() * 1e3


def worker(rank, port, args, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=300))
    import flatshard
    import flatshard.fsdp.checkpoint as ck
    verified = ck.verified
    try:
        box = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(box)
        model, opt = build(args.d_model)
        model(torch.randint(1024, (2, 128))).sum().backward()
        opt.step()
        ckpt = flatshard.save_checkpoint(box[0], model, opt)
        nbytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
        del model, opt

        def load(check):
            ck.verified = verified if check else (lambda ckpt, group: None)
            model, opt = build(args.d_model)
            return timed(lambda: flatshard.load_checkpoint(ckpt, model, opt))

        times = {"checked": [], "unchecked": [], "check alone": []}
        load(True), load(False)  # warm: imports, the page cache
        order = ["checked", "unchecked"]
        for r in range(args.rounds):
            random.Random(r).shuffle(order)
            for kind in order:
                times[kind].append(load(kind == "checked"))
            times["check alone"].append(timed(lambda: verified(ckpt, dist.group.WORLD)))
        if rank == 0:
            out.put((times, nbytes))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(box[0])
    finally:
        ck.verified = verified
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--d-model", type=int, default=256)
    args = p.parse_args()
    times, nbytes = run_ranks(worker, WORLD, args)
    base = statistics.median(times["unchecked"])
    print(f"# {cpu_name()}; torch {torch.__version__}; {WORLD} ranks, 1 thread each; "
          f"transformer d_model {args.d_model} + AdamW state: checkpoint of "
          f"{nbytes / 2**20:.1f} MiB; {args.rounds} rounds, page cache warm")
    print("| load | median ms | p10-p90 ms | x unchecked |")
    print("|---|---|---|---|")
    for kind, ts in times.items():
        q = statistics.quantiles(ts, n=10)
        print(f"| {kind} | {statistics.median(ts):.1f} | {q[0]:.1f}-{q[-1]:.1f} | "
              f"{statistics.median(ts) / base:.3f} |")


if __name__ == "__main__":
    main()
