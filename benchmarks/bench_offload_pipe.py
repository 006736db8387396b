"""The offloaded step, sequential vs pipelined (flatshard.overlap_offload), on
the host-emulated device path: a Comm(kind='device') over the host table
(flatshard.runtime.device.host_device_comm), so the units take their
device path (shards staged for each gather, gradients copied out to host
memory) with the "device" in host memory. One rank.

The step is forward, backward, (clip,) flatshard.optim.AdamW.step(),
zero_grad(). Sequential: the AdamW step after backward, as today.
Pipelined: each unit's step queued as its gradient lands, run on the
engine's host thread while backward goes on (and, with clipping, while
the next forward goes on). The two take turns step by step in one
process, each on its own copy of the model, and the parameters of both
are checked equal to the bit at the end.

    python3 benchmarks/bench_offload_pipe.py [--api fsdp,fully_shard]
        [--layers 8] [--width 1024] [--batch 8] [--steps 12] [--clip 0]

On a CPU the "device" compute and the host AdamW share the same cores;
on a GPU the compute would leave them to the step, so the device figures
(benchmarks/gpu_check.py) are not these."""
import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import harness


class Stack(nn.Module):
    def __init__(self, layers, width):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh())
                                    for _ in range(layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _build(api, a):
    import flatshard
    import flatshard.fsdp.groups as fgroups
    import flatshard.fsdp2.mesh as fmesh
    from flatshard.runtime.device import host_device_comm
    torch.manual_seed(0)
    model = Stack(a.layers, a.width)
    mod = fgroups if api == "fsdp" else fmesh
    saved, made = mod.comm_for, {}

    def comm_for(group, backend, device=None):
        host = saved(group, backend, device)
        if id(host) not in made:
            made[id(host)] = (host, host_device_comm(host))
        return made[id(host)][1]
    mod.comm_for = comm_for
    try:
        if api == "fsdp":
            return flatshard.FSDP(model, auto_wrap_policy=flatshard.ModuleWrapPolicy(
                {nn.Sequential}), device_id=torch.device("cpu"),
                cpu_offload=flatshard.CPUOffload(offload_params=True))
        for b in model.blocks:
            flatshard.fully_shard(b, offload_policy=flatshard.CPUOffloadPolicy())
        return flatshard.fully_shard(model, offload_policy=flatshard.CPUOffloadPolicy())
    finally:
        mod.comm_for = saved


def _setup(api, pipelined, a):
    import flatshard
    from flatshard.optim import AdamW
    model = _build(api, a)
    opt = AdamW(model.parameters(), lr=1e-3, threads=1)
    pipe = flatshard.overlap_offload(model, opt, flatshard.OverlapOffload(
        max_units_in_flight=a.units, max_norm=a.clip or None)) if pipelined else None
    return model, opt, pipe


def _step(api, model, opt, pipe, x, a):
    t0 = time.perf_counter()
    loss = model(x).square().mean()
    loss.backward()
    if a.clip and pipe is None:
        if api == "fsdp":
            model.clip_grad_norm_(a.clip)
        else:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), a.clip)
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def _params(api, model, pipe):
    if pipe is not None:
        pipe.wait()
    if api == "fsdp":
        from flatshard import FSDP
        with FSDP.summon_full_params(model):
            return [p.detach().clone() for p in model.parameters()]
    return [p.full_tensor().clone() for p in model.parameters()]


def worker(a):
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(a.batch, a.width, generator=g) for _ in range(a.steps + 2)]
    for api in a.api.split(","):
        runs = {"sequential": _setup(api, False, a), "pipelined": _setup(api, True, a)}
        times = {k: [] for k in runs}
        for i, x in enumerate(xs):
            for k, (model, opt, pipe) in runs.items():  # the two take turns
                t = _step(api, model, opt, pipe, x, a)
                if i >= 2:  # the first steps lay out state and tune the kernels
                    times[k].append(t)
        # A step that ends with steps still queued owes their time to the
        # next: the last one is charged its wait.
        t0 = time.perf_counter()
        pa = _params(api, *runs["pipelined"][::2])
        times["pipelined"][-1] += time.perf_counter() - t0
        same = all(torch.equal(p, q) for p, q in zip(_params(api, *runs["sequential"][::2]), pa))
        seq, pip = (statistics.median(times[k]) for k in ("sequential", "pipelined"))
        stats = runs["pipelined"][2].stats()
        print(f"{api:12s} sequential {seq * 1e3:8.2f} ms  pipelined {pip * 1e3:8.2f} ms  "
              f"ratio {pip / seq:.3f}  same bits: {same}  (median of {len(times[k])}; "
              f"host steps {stats['step_s'] / stats['steps_run'] * 1e6:.0f} us/param, "
              f"waited {stats['wait_s']:.3f} s in total, peak units in flight "
              f"{stats['peak_units_in_flight']}/{stats['max_units']})", flush=True)
        for _, _, pipe in runs.values():
            if pipe is not None:
                pipe.close()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--api", default="fsdp,fully_shard")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--units", type=int, default=2, help="max_units_in_flight")
    p.add_argument("--clip", type=float, default=0.0, help="max_norm (0: no clipping)")
    a = p.parse_args()
    for api in a.api.split(","):
        if api not in ("fsdp", "fully_shard"):
            p.error(f"--api: {api!r}, expected fsdp and/or fully_shard")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(harness.free_port()))
    print(f"CPU: {harness.cpu_name()}; torch {torch.__version__}; load average "
          f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print(f"{a.layers} x Linear({a.width}, {a.width}) units, batch {a.batch}, one rank, "
          f"host-emulated device path, CPUOffload, flatshard.optim.AdamW (1 thread), "
          f"max_units_in_flight={a.units}, clip={a.clip or 'none'}")
    worker(a)
    print(f"load average after: "
          f"{subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    sys.exit(main())
