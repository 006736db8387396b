"""A training script for tests/test_snapshots.py, run under torchrun: a small
model sharded with either API, each step's batch seeded by the step index,
flatshard.Snapshots restoring and committing. In the first run only
(TORCHELASTIC_RESTART_COUNT 0), rank --kill-rank kills itself with SIGKILL
at --kill POINT:STEP (forward, backward or optim: inside optimizer.step);
the library's own points (the copy, the commit) are FLATSHARD_SNAPSHOT_FAULT.
With --reference, each rank first trains the same model without snapshots (a
run that never failed) and at the end writes whether the two ended with the
same bits.
"""
import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard
import flatshard.snapshots


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
    ap.add_argument("--kill2", default=None, help="the same, in the second run")
    ap.add_argument("--lose-segment", action="store_true",
                    help="the killed rank removes its segment first (its host's memory lost)")
    ap.add_argument("--job", default=None)
    ap.add_argument("--every", type=int, default=1)
    ap.add_argument("--out", required=True)
    ap.add_argument("--reference", action="store_true",
                    help="train the same model without snapshots first, and write whether the "
                         "two end bit-equal to OUT.rankR.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill = {0: args.kill, 1: args.kill2}.get(run)
    point, at = (kill.split(":") if kill else (None, "-1"))
    die = rank == args.kill_rank

    def maybe_die(where, step, snaps):
        if die and where == point and step == int(at):
            if args.lose_segment:
                flatshard.snapshots.remove_segments(snaps.job)
            os.kill(os.getpid(), signal.SIGKILL)

    def train(snaps_on):
        model = wrap(build(), args.api, args.strategy, world)
        opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
        sampler = Sampler(rank)
        torch.manual_seed(1000 + rank)
        start, snaps = 0, None
        if snaps_on:
            snaps = flatshard.Snapshots(model, opt, stateful={"sampler": sampler, "sched": sched},
                                        job=args.job, every=args.every,
                                        checkpoint_dir=args.out + ".ckpt")
            start = snaps.restore()
            print(f"rank {rank} run {run} starts at step {start}", flush=True)
            step_box = [0]
            opt.register_step_pre_hook(lambda *a: maybe_die("optim", step_box[0], snaps))
        for step in range(start, args.steps):
            if snaps_on:
                step_box[0] = step
            x, y = sampler.batch()
            x = x + 0.01 * torch.randn(x.shape)  # the global generator, restored too
            if snaps_on:
                maybe_die("forward", step, snaps)
            loss = ((model(x) - y) ** 2).mean()
            if snaps_on:
                maybe_die("backward", step, snaps)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            if snaps_on:
                snaps.commit(step)
                print(f"rank {rank} step {step} loss {loss.item():.6f}", flush=True)
        if snaps_on:
            snaps.close()
        from flatshard.snapshots.record import local
        return {"params": {n: local(p).detach().clone() for n, p in model.named_parameters()},
                "optim": [{k: (local(v).clone() if torch.is_tensor(v) else v)
                           for k, v in opt.state[p].items()} for p in model.parameters()],
                "lr": opt.param_groups[0]["lr"], "drawn": sampler.drawn}, start

    # The reference: the same training in this process, never failed.
    want, _ = train(False) if args.reference else (None, None)
    got, start = train(True)
    if want is not None:
        same = {"params": all(torch.equal(want["params"][k], got["params"][k])
                              for k in want["params"]) and list(want["params"]) == list(got["params"]),
                "optim": len(want["optim"]) == len(got["optim"]) and all(
                    a.keys() == b.keys() and all(
                        torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                        for k in a) for a, b in zip(want["optim"], got["optim"])),
                "lr": want["lr"] == got["lr"], "drawn": want["drawn"] == got["drawn"],
                "start": start, "state_steps": sorted({int(o["step"]) for o in got["optim"]})}
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(same, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
