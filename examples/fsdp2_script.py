"""A torch FSDP2 training script in the usual shape: fully_shard applied to
each block then the root, bf16 mixed precision, gradient clipping through
DTensor parameters, a full state dict gathered at the end. It differs from
the same script written for torch's fully_shard in one line, the import
below; tests/test_examples.py runs it both ways and compares.

    torchrun --nproc-per-node 2 examples/fsdp2_script.py [--steps 8] [--save model.pt]
        [--precision bf16|fp32]
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from flatshard import fully_shard, MixedPrecisionPolicy, FSDPModule  # noqa: E501


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class Model(nn.Module):
    def __init__(self, vocab=256, d=64, layers=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.out = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save", default=None, help="write the full state dict here (rank 0)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    torch.manual_seed(0)
    model = Model()
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if args.precision == "bf16" else MixedPrecisionPolicy())
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    assert isinstance(model, FSDPModule)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        # A learnable toy language: each token is the previous one plus one.
        start = torch.randint(0, 256, (4, 1), generator=gen)
        idx = (start + torch.arange(17)) % 256
        logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 256),
                                           idx[:, 1:].reshape(-1))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"step {step} loss {avg.item() / world:.6f} grad_norm {norm.item():.6f}")

    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    if rank == 0 and args.save:
        tmp = args.save + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
