"""Training that survives a killed rank: examples/train_small.py's model with
flatshard.Snapshots, run under torchrun with restarts.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 3 \\
        examples/train_resilient.py [--steps 20] [--api fsdp1|fsdp2] [--kill-at 7]

Every step's state (parameter shards, optimizer state, the RNGs, the data
sampler) is copied to shared memory on the host, overlapped with the next
step. --kill-at N kills rank 1 with SIGKILL in the middle of step N's
backward, in the first run only: torchrun restarts both ranks, they resume
from the last step both hold, and the losses go on as if nothing happened.
"""
import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard
from train_small import Block, TinyGPT


class TokenSampler:
    """This rank's stream of sequences; Stateful (state_dict/load_state_dict),
    so a restart draws the same batches."""

    def __init__(self, rank, batch, seq):
        self.gen = torch.Generator().manual_seed(1 + rank)
        self.batch, self.seq = batch, seq

    def next(self):
        first = torch.randint(0, 512, (self.batch, 1), generator=self.gen)
        return (first + torch.arange(self.seq + 1)) % 512

    def state_dict(self):
        return {"gen": self.gen.get_state()}

    def load_state_dict(self, sd):
        self.gen.set_state(sd["gen"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--api", choices=["fsdp1", "fsdp2"], default="fsdp1")
    ap.add_argument("--kill-at", type=int, default=None,
                    help="kill rank 1 in this step's backward (first run only)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    first_run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    torch.manual_seed(0)
    model = TinyGPT(seq=args.seq)
    if args.api == "fsdp1":
        model = flatshard.FullyShardedDataParallel(
            model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
            device_id=torch.device("cpu"))
    else:
        for block in model.blocks:
            flatshard.fully_shard(block)
        flatshard.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sampler = TokenSampler(rank, args.batch, args.seq)

    snaps = flatshard.Snapshots(model, opt, stateful=[sampler])
    start = snaps.restore()
    if rank == 0:
        print(f"flatshard {flatshard.__version__}: {world} ranks, {args.api}, run "
              f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}, starting at step {start}",
              flush=True)
    for step in range(start, args.steps):
        opt.zero_grad(set_to_none=True)
        seq = sampler.next()
        logits = model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 512), seq[:, 1:].reshape(-1))
        if first_run and rank == 1 and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        snaps.commit(step)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        if rank == 0:
            print(f"step {step:3d}  loss {avg.item() / world:.4f}", flush=True)
    snaps.close()  # a finished run: its segments removed
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
