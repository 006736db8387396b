"""GPT training with what a real run uses: bf16 mixed precision, activation
checkpointing on every block, gradient clipping, and a sharded checkpoint
saved every few steps and resumed from.

    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 40 --ckpt-dir ckpt
    torchrun --nproc-per-node 2 examples/train_gpt.py --steps 80 --ckpt-dir ckpt --resume

With --resume the run continues from the newest complete checkpoint in
--ckpt-dir (model, optimizer and step), exactly where it stopped: the batches
depend only on the step, so a resumed run prints the same losses as one that
never stopped (tests/test_examples.py checks this).
"""
import argparse
import functools
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)

import flatshard
from flatshard import FullyShardedDataParallel as FSDP, MixedPrecision, ModuleWrapPolicy


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=256, d=128, heads=4, layers=4, seq=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def batch(rank, step, n, seq, vocab=256):
    """Rank `rank`'s batch at `step` (a function of both only, so a resumed
    run sees the same data): sequences that count up by a per-row stride."""
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    return (start + stride * torch.arange(seq + 1)) % vocab


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="train until this step")
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--ckpt-dir", default=None, help="save sharded checkpoints here")
    ap.add_argument("--ckpt-every", type=int, default=10)
    ap.add_argument("--resume", action="store_true", help="continue from --ckpt-dir")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = FSDP(GPT(seq=args.seq), auto_wrap_policy=ModuleWrapPolicy({Block}),
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32),
                 device_id=torch.device("cpu"))
    # Recompute each block's activations in backward instead of keeping them.
    apply_activation_checkpointing(
        model, check_fn=lambda m: isinstance(m, Block),
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

    start = 0
    if args.resume:
        start = flatshard.load_checkpoint(args.ckpt_dir, model, opt)["step"]
        if rank == 0:
            print(f"resumed from step {start}")
    t0, tokens = time.perf_counter(), 0
    for step in range(start, args.steps):
        data = batch(rank, step, args.batch, args.seq)
        logits = model(data[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), data[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        tokens += data[:, :-1].numel() * world
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"step {step} loss {avg.item() / world:.6f}")
        if args.ckpt_dir and (step + 1) % args.ckpt_every == 0:
            flatshard.save_checkpoint(args.ckpt_dir, model, opt, extra={"step": step + 1})
    if rank == 0:
        print(f"{tokens / (time.perf_counter() - t0):,.0f} tokens/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
