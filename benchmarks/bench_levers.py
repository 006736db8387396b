"""The memory levers side by side: what each saves and what it costs.

    python3 benchmarks/bench_levers.py [--steps 10] [--disk-mib 256] [--dir /tmp]

Part 1: the transformer of bench_core.py (models.py) on 2 ranks, AdamW
(flatshard.optim), one unit per block, trained with each lever on in turn,
each configuration in fresh processes (so peak RSS is its own):
  ZeRO-3 (FULL_SHARD, the baseline), DDP (NO_SHARD), ZeRO-1 (SHARD_OPTIM),
  ZeRO-2 (SHARD_GRAD_OP), FULL_SHARD + CPUOffload(offload_params=True),
  FULL_SHARD + activation checkpointing (torch's checkpoint_wrapper on each
  block, applied after wrapping), FULL_SHARD + optimizer state on disk.
Per configuration: step time (zero_grad + forward + backward + step, slowest
rank, median of the timed steps), memory per rank after a step by role
(flatshard.memory_stats: params, unsharded, grads, optim), activation bytes
saved for backward (a saved-tensor hook: what checkpointing removes), peak
RSS of rank 0, and bytes moved per step per rank (collectives: the Comm
ledger's bytes, i.e. each call's count x element size: the shard for
all-gather and reduce-scatter, the whole buffer for all-reduce; disk: reads
+ writes). Ratios are against the baseline. Same weights and data under
every lever, so the last loss agrees across them.

Part 2: disk-offloaded AdamW against the disk itself, in one process: a
parameter of --disk-mib MiB of optimizer state; first the disk's sequential
bandwidth measured with plain reads and writes of files of the same size
(write + fdatasync, then read, page cache dropped before each), then the
optimizer's steps (read + update + write, fdatasync, same cache policy).
Target: the step moves its bytes at >= 70% of that read+write bandwidth.
"""
import argparse
import os
import resource
import shlex
import shutil
import sys
import tempfile
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CONFIGS = ["ZeRO-3 FULL_SHARD", "DDP NO_SHARD", "ZeRO-1 SHARD_OPTIM", "ZeRO-2 SHARD_GRAD_OP",
           "FULL_SHARD + cpu_offload", "FULL_SHARD + act. ckpt", "FULL_SHARD + disk optim"]


def _ledger_bytes(comm, after):
    entries = [e for e in comm.ledger() if e["seq"] > after]
    return sum(e["bytes"] for e in entries), max([after] + [e["seq"] for e in entries])


def worker(rank, world, port, config, steps, tmp, queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import flatshard
    import flatshard.optim as fo
    from flatshard import FSDP, CPUOffload, ShardingStrategy
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing, checkpoint_wrapper)
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from models import transformer_spec
    spec = transformer_spec(batch=4)
    strategy = {"DDP": "NO_SHARD", "ZeRO-1": "SHARD_OPTIM",
                "ZeRO-2": "SHARD_GRAD_OP"}.get(config.split()[0], "FULL_SHARD")
    kw = dict(sharding_strategy=ShardingStrategy[strategy],
              auto_wrap_policy=ModuleWrapPolicy({spec["unit_cls"]}))
    if "cpu_offload" in config:
        kw["cpu_offload"] = CPUOffload(offload_params=True)
    torch.manual_seed(0)  # the same weights under every lever: the losses must agree
    model = FSDP(spec["build"](), **kw)
    if "ckpt" in config:
        apply_activation_checkpointing(model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                       check_fn=lambda m: isinstance(m, spec["unit_cls"]))
    offload = fo.DiskOffload(os.path.join(tmp, f"rank{rank}"), durable=True) \
        if "disk" in config else None
    opt = fo.AdamW(model.parameters(), lr=1e-3, offload=offload)
    x, y = spec["make_batch"](rank)
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    comm = model._unit.c.comm
    seq = _ledger_bytes(comm, -1)[1]
    times, moved, disk = [], [], []
    for i in range(steps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        saved[0] = 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = spec["loss_fn"](model(x), y)
        loss.backward()
        opt.step()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        b, seq = _ledger_bytes(comm, seq)
        if i >= 2:
            times.append(dt.item())
            moved.append(b)
            disk.append(opt._disk.bytes_read + opt._disk.bytes_written if offload else 0)
    stats = flatshard.memory_stats(model, opt)
    if offload is not None:
        stats["optim"] = 0  # moments on disk; what stays is the per-parameter step count
    row = dict(config=config, step_ms=1e3 * sorted(times)[len(times) // 2], stats=stats,
               saved=saved[0], rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
               comm=sum(moved) // len(moved), disk=sum(disk) // len(disk),
               loss=loss.item())
    if rank == 0:
        queue.put(row)
    dist.barrier()
    dist.destroy_process_group()


def _mib(n):
    return f"{n / 2**20:.1f}"


def part1(steps, tmp):
    ctx = mp.get_context("spawn")
    rows = []
    for i, config in enumerate(CONFIGS):
        queue = ctx.SimpleQueue()
        d = tempfile.mkdtemp(dir=tmp, prefix="levers-")
        try:
            mp.start_processes(worker, args=(2, 29700 + 11 * i + os.getpid() % 97, config, steps,
                                             d, queue), nprocs=2, start_method="spawn", join=True)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        rows.append(queue.get())
    base = rows[0]
    model_state = lambda r: sum(r["stats"][k] for k in ("params", "unsharded", "grads",  # noqa
                                                        "optim"))
    print("\n== Part 1: 2 ranks, transformer (4 blocks, d 256, seq 128, batch 4/rank), "
          "AdamW; memory per rank in MiB ==")
    print("| lever | step ms | x | params | unsharded | grads | optim | model state | x | "
          "saved activations | x | peak RSS | comm MiB/step | disk MiB/step | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["stats"]
        print(f"| {r['config']} | {r['step_ms']:.1f} | {r['step_ms'] / base['step_ms']:.2f} | "
              f"{_mib(s['params'])} | {_mib(s['unsharded'])} | {_mib(s['grads'])} | "
              f"{_mib(s['optim'])} | {_mib(model_state(r))} | "
              f"{model_state(r) / model_state(base):.2f} | {_mib(r['saved'])} | "
              f"{r['saved'] / base['saved']:.2f} | {_mib(r['rss'])} | {_mib(r['comm'])} | "
              f"{_mib(r['disk'])} | {r['loss']:.5f} |")


def _drop(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def disk_baseline(path, nbytes, chunk):
    """Seconds to write nbytes sequentially (+ fdatasync), and to read them back
    with the page cache dropped: plain os.write / os.readv, `chunk` at a time."""
    buf = bytearray(os.urandom(chunk))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    t0 = time.perf_counter()
    for off in range(0, nbytes, chunk):
        os.write(fd, memoryview(buf)[:min(chunk, nbytes - off)])
    os.fdatasync(fd)
    t_write = time.perf_counter() - t0
    os.close(fd)
    _drop(path)
    fd = os.open(path, os.O_RDONLY)
    t0 = time.perf_counter()
    while os.readv(fd, [buf]):
        pass
    t_read = time.perf_counter() - t0
    os.close(fd)
    os.unlink(path)
    return t_write, t_read


def part2(disk_mib, tmp, steps=5):
    import flatshard.optim as fo
    d = tempfile.mkdtemp(dir=tmp, prefix="disk-adam-")
    try:
        n = disk_mib * 2**20 // 8  # both moments: 8 bytes per element
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        cfg = fo.DiskOffload(os.path.join(d, "state"))
        opt = fo.AdamW([p], lr=1e-3, offload=cfg)
        opt.step()  # the first generation (zeros in, nothing read)
        base = []
        for _ in range(2):
            base.append(disk_baseline(os.path.join(d, "raw"), 8 * n, cfg.chunk_bytes))
        t_write = min(b[0] for b in base)
        t_read = min(b[1] for b in base)
        times = []
        for _ in range(steps):
            _drop(os.path.join(cfg.path, opt._disk.current))
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        t_step = min(times)
        t_median = sorted(times)[len(times) // 2]
        moved = opt._disk.bytes_read + opt._disk.bytes_written
        raw_bw = 16 * n / (t_write + t_read)
        step_bw = moved / t_step
        # the same update in memory, for the compute share of the step
        m = fo.AdamW([p], lr=1e-3)
        m.step()
        t0 = time.perf_counter()
        m.step()
        t_mem = time.perf_counter() - t0
        print(f"\n== Part 2: disk-offloaded AdamW, {disk_mib} MiB of optimizer state "
              f"({n / 1e6:.1f}M parameters), chunk {cfg.chunk_bytes >> 20} MiB x "
              f"{cfg.buffers} buffers, fdatasync on ==")
        print(f"disk alone: write {8 * n / t_write / 1e6:.0f} MB/s, read "
              f"{8 * n / t_read / 1e6:.0f} MB/s, read+write {raw_bw / 1e6:.0f} MB/s "
              f"({(t_write + t_read) * 1e3:.0f} ms for the step's bytes)")
        print(f"optimizer step: {t_step * 1e3:.0f} ms (best of {steps}; all: "
              f"{', '.join(f'{t * 1e3:.0f}' for t in times)}), moved {moved / 1e6:.0f} MB = "
              f"{step_bw / 1e6:.0f} MB/s = {step_bw / raw_bw:.2f} of the disk's read+write "
              f"bandwidth (target >= 0.70); median step {t_median * 1e3:.0f} ms = "
              f"{moved / t_median / raw_bw:.2f}; the same update in memory: "
              f"{t_mem * 1e3:.0f} ms")
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--disk-mib", type=int, default=256)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--part", choices=["1", "2", "both"], default="both")
    args = ap.parse_args()
    print("command: python3 " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, files under {args.dir}")
    if args.part in ("1", "both"):
        part1(args.steps, args.dir)
    if args.part in ("2", "both"):
        part2(args.disk_mib, args.dir)


if __name__ == "__main__":
    main()
