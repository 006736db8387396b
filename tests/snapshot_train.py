"""A training script for tests/test_snapshots.py, run under torchrun: a small
model sharded with either API, each step's batch seeded by the step index,
flatshard.Snapshots restoring and committing. In the first run only
(TORCHELASTIC_RESTART_COUNT 0), rank --kill-rank kills itself with SIGKILL
at --kill POINT:STEP (forward, backward or optim: inside optimizer.step);
the library's own points (the copy, the commit) are FLATSHARD_SNAPSHOT_FAULT.
At the end every rank saves its parameter shards and optimizer state.
"""
import argparse
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.a = nn.Linear(d, 3 * d + 1)
        self.b = nn.Linear(3 * d + 1, d)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


def build(d=13, layers=3):
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d) for _ in range(layers)], nn.Linear(d, 5))


class Sampler:
    """A Stateful data source: where it is, and its own generator."""

    def __init__(self, rank):
        self.gen = torch.Generator().manual_seed(100 + rank)
        self.drawn = 0

    def batch(self):
        self.drawn += 1
        return torch.randn(6, 13, generator=self.gen), torch.randn(6, 5, generator=self.gen)

    def state_dict(self):
        return {"gen": self.gen.get_state(), "drawn": self.drawn}

    def load_state_dict(self, sd):
        self.gen.set_state(sd["gen"])
        self.drawn = sd["drawn"]


def wrap(model, api, strategy, world):
    if api == "fsdp1":
        from flatshard import FullyShardedDataParallel as FSDP, ShardingStrategy
        kw = {}
        if strategy == "HYBRID_SHARD":
            from torch.distributed.device_mesh import init_device_mesh
            kw["device_mesh"] = init_device_mesh("cpu", (1, world))
        return FSDP(model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                    sharding_strategy=ShardingStrategy[strategy],
                    device_id=torch.device("cpu"), **kw)
    mesh = None
    if strategy == "HYBRID_SHARD":
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    reshard = strategy != "SHARD_GRAD_OP"
    for m in model:
        if isinstance(m, Block):
            flatshard.fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
    return flatshard.fully_shard(model, mesh=mesh, reshard_after_forward=reshard)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--api", choices=["fsdp1", "fsdp2"], default="fsdp1")
    ap.add_argument("--strategy", default="FULL_SHARD",
                    choices=["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--kill", default=None, help="forward|backward|optim:STEP")
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    first_run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    point, at = (args.kill.split(":") if args.kill else (None, "-1"))
    die = first_run and rank == args.kill_rank

    def maybe_die(where, step):
        if die and where == point and step == int(at):
            os.kill(os.getpid(), signal.SIGKILL)

    model = wrap(build(), args.api, args.strategy, world)
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    sampler = Sampler(rank)
    snaps = flatshard.Snapshots(model, opt, stateful={"sampler": sampler, "sched": sched})
    start = snaps.restore()
    print(f"rank {rank} run {os.environ.get('TORCHELASTIC_RESTART_COUNT')} starts at step "
          f"{start}", flush=True)
    step_box = [0]
    opt.register_step_pre_hook(lambda *a: maybe_die("optim", step_box[0]))
    for step in range(start, args.steps):
        step_box[0] = step
        x, y = sampler.batch()
        x = x + 0.01 * torch.randn(x.shape)  # the global generator, restored too
        maybe_die("forward", step)
        loss = ((model(x) - y) ** 2).mean()
        maybe_die("backward", step)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        snaps.commit(step)
        print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
    snaps.close()
    from flatshard.snapshots.record import local
    state = {"params": {n: local(p).detach().clone() for n, p in model.named_parameters()},
             "optim": {i: {k: (local(v).clone() if torch.is_tensor(v) else v)
                           for k, v in opt.state[p].items()}
                       for i, p in enumerate(model.parameters())},
             "lr": opt.param_groups[0]["lr"], "drawn": sampler.drawn}
    torch.save(state, f"{args.out}.rank{rank}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
