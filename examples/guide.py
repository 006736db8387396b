"""The walk-through of docs/guide.md: one small transformer, trained at each
stage from a single process to full sharding with every memory lever, printing
what each rank holds (the planner's prediction next to the measured bytes),
the step time, and the bytes each rank sent through collectives per step.

    python examples/guide.py --stage single
    torchrun --nproc-per-node 2 examples/guide.py --stage zero3

Stages: single, ddp, zero1, zero2, zero3, bf16, checkpointing, cpu_offload,
disk_offload (each one adds to or changes the one before; see the guide).
"""
import argparse
import functools
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

import flatshard
import flatshard.optim
import flatshard.plan
from flatshard import (CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision,
                       ModuleWrapPolicy, ShardingStrategy)
from train_small import Block, TinyGPT

STAGES = {  # stage -> (strategy, bf16, activation checkpointing, cpu offload, disk offload)
    "single": (None, False, False, False, False),
    "ddp": (ShardingStrategy.NO_SHARD, False, False, False, False),
    "zero1": (ShardingStrategy.SHARD_OPTIM, False, False, False, False),
    "zero2": (ShardingStrategy.SHARD_GRAD_OP, False, False, False, False),
    "zero3": (ShardingStrategy.FULL_SHARD, False, False, False, False),
    "bf16": (ShardingStrategy.FULL_SHARD, True, False, False, False),
    "checkpointing": (ShardingStrategy.FULL_SHARD, True, True, False, False),
    "cpu_offload": (ShardingStrategy.FULL_SHARD, True, True, True, False),
    "disk_offload": (ShardingStrategy.FULL_SHARD, True, True, True, True),
}


def storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


class CommCounter:
    """Bytes this rank handed to collectives (each collective's per-rank
    payload), read from the C core's ledger of recent collectives."""

    def __init__(self, model):
        self.comm = model._unit.c.comm if isinstance(model, FSDP) else None
        self.last = max((e["seq"] for e in self.comm.ledger()), default=-1) if self.comm else -1

    def take(self):
        if self.comm is None:
            return 0
        new = [e for e in self.comm.ledger() if e["seq"] > self.last]
        self.last = max((e["seq"] for e in new), default=self.last)
        return sum(e["bytes"] for e in new)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", required=True, choices=list(STAGES))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64)
    args = ap.parse_args()
    strategy, bf16, ckpt, cpu_offload, disk = STAGES[args.stage]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if strategy is not None:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if strategy is not None else 0
    world = dist.get_world_size() if strategy is not None else 1

    torch.manual_seed(0)
    model = TinyGPT(seq=args.seq)
    if strategy is not None:
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                     sharding_strategy=strategy, device_id=torch.device("cpu"),
                     mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.float32)
                     if bf16 else None,
                     cpu_offload=CPUOffload(offload_params=True) if cpu_offload else None)
    if ckpt:
        apply_activation_checkpointing(
            model, check_fn=lambda m: isinstance(m, Block),
            checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                    checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    scratch = tempfile.mkdtemp(prefix=f"flatshard-guide-{rank}-") if disk else None
    offload = flatshard.optim.DiskOffload(scratch, durable=False) if disk else None
    opt = flatshard.optim.AdamW(model.parameters(), lr=3e-3, offload=offload)
    watch = flatshard.plan.watch(model) if strategy is not None else None

    gen = torch.Generator().manual_seed(1 + rank)
    times, sent, counter = [], [], CommCounter(model)
    for step in range(args.steps):
        start = torch.randint(0, 512, (args.batch, 1), generator=gen)
        seq = (start + torch.arange(args.seq + 1)) % 512
        t0 = time.perf_counter()
        logits = model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 512),
                                           seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        sent.append(counter.take())
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}")
    step_ms = 1e3 * sorted(times[1:] or times)[len(times[1:] or times) // 2]
    for r in range(world):
        if r == rank:
            if watch is not None:
                print(watch.report(opt))
            else:
                print(f"rank 0 (one process): params {storage_bytes(model.parameters()):,} B, "
                      f"grads {storage_bytes(p.grad for p in model.parameters()):,} B, "
                      f"optim {storage_bytes(t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()):,} B")
            print(f"rank {rank}: step {step_ms:.1f} ms (median), collectives "
                  f"{sent[-1]:,} B per step", flush=True)
        if world > 1:
            dist.barrier()
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    if strategy is not None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
