"""Sharded training of a small transformer across processes on CPU.

    torchrun --nproc-per-node 2 examples/train_small.py [--steps 20] [--strategy FULL_SHARD]

Every transformer block is its own unit (gathered just in time, freed after);
prints the loss per step, tokens/s, and each rank's memory for parameters,
gradients and optimizer state, measured from torch's own storages, next to
the process's resident memory (now and its peak), which also holds the
runtime, the activations and whatever the C library keeps.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard
import flatshard.plan
from flatshard import FullyShardedDataParallel as FSDP, ShardingStrategy


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        h = self.ln1(x)
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab=512, d=128, heads=4, layers=4, seq=64):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: both live in the root unit
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--strategy", default="FULL_SHARD", choices=["FULL_SHARD", "SHARD_GRAD_OP",
                                                                  "SHARD_OPTIM",
                                                                  "NO_SHARD"])
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = TinyGPT(seq=args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    model = FSDP(model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                 sharding_strategy=ShardingStrategy[args.strategy],
                 device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    # FLATSHARD_MEMORY_REPORT=1: each rank prints the planner's prediction
    # against its measured bytes after the first step (flatshard.plan).
    watch = flatshard.plan.watch_from_env(model)
    if rank == 0:
        print(f"flatshard {flatshard.__version__}: {n_params / 1e6:.2f}M parameters, "
              f"{world} ranks, {args.strategy}, collectives over "
              f"{model._unit.c.comm.backend} (process group: gloo)")

    # A learnable toy language: each token is the previous one plus one (mod vocab).
    gen = torch.Generator().manual_seed(1 + rank)
    tokens = 0
    start = None
    for step in range(args.steps):
        if step == 1:  # the first step pays for warm-up; time the rest
            dist.barrier()
            start, tokens = time.perf_counter(), 0
        opt.zero_grad(set_to_none=True)
        first = torch.randint(0, 512, (args.batch, 1), generator=gen)
        seq = (first + torch.arange(args.seq + 1)) % 512
        logits = model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 512), seq[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        if watch is not None and step == 0:
            print(watch.report(opt) + "\n", end="", flush=True)
        tokens += args.batch * args.seq * world
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"step {step:3d}  loss {avg.item() / world:.4f}")
    dist.barrier()
    elapsed = time.perf_counter() - start if start else float("nan")
    # Right after a step: gradients are still held (zero_grad comes first in a step).
    mem = flatshard.memory_stats(model, opt)
    keys = ["params", "grads", "optim", "unsharded", "resident", "peak_resident"]
    mine = torch.tensor([mem[k] or 0 for k in keys], dtype=torch.int64)
    every = torch.empty(world * len(keys), dtype=torch.int64)
    # torch 2.13 names it all_gather_single; 2.11 all_gather_into_tensor
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(every, mine)
    lines = [(r, dict(zip(keys, row.tolist()))) for r, row in enumerate(every.view(world, -1))]
    if rank == 0:
        print(f"throughput: {tokens / elapsed:,.0f} tokens/s over {args.steps - 1} steps")
        full = n_params * 4
        print(f"per-rank memory (KiB)  [unsharded fp32 model: {full / 1024:,.0f} KiB]")
        print("rank   params    grads    optim  unsharded-now   resident  peak-resident")
        for r, m in lines:
            print(f"{r:4d} {m['params'] / 1024:8,.0f} {m['grads'] / 1024:8,.0f} "
                  f"{m['optim'] / 1024:8,.0f} {m['unsharded'] / 1024:14,.0f} "
                  f"{m['resident'] / 1024:10,.0f} {m['peak_resident'] / 1024:14,.0f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
