"""Collective bandwidth: flatshard's shm backend vs gloo, with memcpy as the ceiling.

    python3 benchmarks/bench_comm.py [--worlds 2,4] [--min-mib 1] [--max-mib 256]

For each world size this spawns that many ranks (one thread each) and times
all-gather and reduce-scatter of float32 at sizes from --min-mib to
--max-mib (doubling), through flatshard's Comm on both backends: "shm"
(csrc/backends/comm_shm.c) and "torch" (the gloo process group). Size is the full
buffer, as nccl-tests counts it: the all-gather output, the reduce-scatter
input. Reported: algorithm bandwidth = size / time (GB/s, 1e9), the time
being rank 0's mean over the repetitions between two barriers. The ceiling is
one process' memcpy bandwidth on a buffer of the same size.
"""
import argparse
import os
import shlex
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def reps_for(size):
    """Repetitions per point: fixed by size, so every rank runs the same count."""
    return max(3, min(30, (256 << 20) // size))


def timed(fn, comm, reps):
    fn()  # warm-up: first touch of the buffers
    comm.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    comm.barrier()
    return (time.perf_counter() - start) / reps


def worker(rank, world, port, sizes, queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from flatshard.runtime import comm as fcomm
    rows = []
    comms = {b: fcomm.comm_for(dist.group.WORLD, b) for b in ("shm", "torch")}
    for size in sizes:
        n = size // 4 // world  # elements per rank
        shard = torch.ones(n)
        full = torch.ones(n * world)
        reps = reps_for(size)
        for backend, c in comms.items():
            ag = timed(lambda: fcomm.all_gather_into(c, full, shard), c, reps)
            rs = timed(lambda: fcomm.reduce_scatter_into(c, shard, full, average=False), c, reps)
            rows.append((size, backend, ag, rs))
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def memcpy_bw(size):
    a, b = torch.ones(size // 4), torch.empty(size // 4)
    b.copy_(a)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < 0.3 or reps < 3:
        b.copy_(a)
        reps += 1
    return size * reps / (time.perf_counter() - start) / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--min-mib", type=int, default=1)
    ap.add_argument("--max-mib", type=int, default=256)
    args = ap.parse_args()
    sizes, s = [], args.min_mib
    while s <= args.max_mib:
        sizes.append(s << 20)
        s *= 2
    print("command: python3 " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, float32, GB/s = 1e9 bytes/s")
    ceiling = {size: memcpy_bw(size) for size in sizes}
    ctx = mp.get_context("spawn")
    for i, world in enumerate(int(w) for w in args.worlds.split(",")):
        queue = ctx.SimpleQueue()
        mp.start_processes(worker, args=(world, 29600 + 7 * i + os.getpid() % 100, sizes, queue),
                           nprocs=world, start_method="spawn", join=True)
        rows = queue.get()
        print(f"\n== {world} ranks ==")
        print(f"{'size':>9} {'memcpy':>7} | {'all-gather shm':>14} {'gloo':>6} {'x':>5} "
              f"{'/memcpy':>7} | {'reduce-scatter shm':>18} {'gloo':>6} {'x':>5} {'/memcpy':>7}")
        by = {(r[0], r[1]): r for r in rows}
        for size in sizes:
            shm, gloo = by[(size, "shm")], by[(size, "torch")]
            bw = [size / t / 1e9 for t in (shm[2], gloo[2], shm[3], gloo[3])]
            print(f"{size >> 20:>6}MiB {ceiling[size]:>7.2f} | {bw[0]:>14.2f} {bw[1]:>6.2f} "
                  f"{bw[0] / bw[1]:>5.1f} {bw[0] / ceiling[size]:>7.2f} | {bw[2]:>18.2f} "
                  f"{bw[3]:>6.2f} {bw[2] / bw[3]:>5.1f} {bw[2] / ceiling[size]:>7.2f}")


if __name__ == "__main__":
    main()
