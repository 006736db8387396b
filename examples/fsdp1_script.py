"""A torch FSDP1 training script in the usual shape: auto-wrap policy, mixed
precision, gradient clipping, a full state dict saved on rank 0. It differs
from the same script written for torch's FSDP in one line, the import below;
tests/test_examples.py runs it both ways and compares.

    torchrun --nproc-per-node 2 examples/fsdp1_script.py [--steps 8] [--save model.pt]
        [--precision bf16|fp32]
"""
import argparse
import functools
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

from flatshard import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy, StateDictType, FullStateDictConfig  # noqa: E501


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
        self.blocks = nn.Sequential(*[Block(d) for _ in range(layers)])
        self.out = nn.Linear(d, vocab)

    def forward(self, idx):
        return self.out(self.blocks(self.emb(idx)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--save", default=None, help="write the full state dict here (rank 0)")
    ap.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    torch.manual_seed(0)
    model = FSDP(Model(),
                 auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                    transformer_layer_cls={Block}),
                 sharding_strategy=ShardingStrategy.FULL_SHARD,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                reduce_dtype=torch.float32,
                                                buffer_dtype=torch.float32)
                 if args.precision == "bf16" else None,
                 device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(args.steps):
        # A learnable toy language: each token is the previous one plus one.
        start = torch.randint(0, 256, (4, 1), generator=gen)
        idx = (start + torch.arange(17)) % 256
        logits = model(idx[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, 256),
                                           idx[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        norm = model.clip_grad_norm_(1.0)
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"step {step} loss {avg.item() / dist.get_world_size():.6f} "
                  f"grad_norm {norm.item():.6f}")

    cfg = FullStateDictConfig(rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if rank == 0 and args.save:
        tmp = args.save + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, args.save)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
