"""What one collective costs between two small pieces of compute (shm).

    python3 benchmarks/bench_meet.py [--segments 192] [--rounds 60]

Two ranks (BENCH_WORLD in the environment changes it), one thread each,
flatshard's shm Comm. Each rank runs `--segments` pieces of compute, each
relu(Linear(32, 32)(x)) + x on a batch of 8 under no_grad (about a tiny
unit's forward), and after each piece one of:

  none          nothing: the compute alone
  barrier       Comm.barrier()
  all_gather    Comm.all_gather of 2 KiB a rank (a tiny unit's shard), the
                C entry point called with raw pointers, as the engine calls
                the backend
  all_gather_py the same through runtime.comm.all_gather_into (its Python
                checks of both tensors)
  all_gather_64k the C entry point with 64 KiB a rank

The modes take turns round by round (this machine's speed drifts over
seconds), each round starting at a barrier; a round counts as the slower
rank's median. Printed per mode: us per piece, what the collective added
to it ("in the flow"), and the same collective called back to back with
no compute ("alone"). The difference between the two is not waiting for
the other rank alone: it is also the collective's own code and data run
cold, between pieces of torch's.
"""
import argparse
import os
import statistics
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import cpu_name, free_port  # noqa: E402

MODES = ("none", "barrier", "all_gather", "all_gather_py", "all_gather_64k")


def worker(rank, world, port, segments, rounds, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    from flatshard import _C
    from flatshard.runtime.comm import all_gather_into, comm_for
    comm = comm_for(dist.group.WORLD, "shm")
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 32)
    x0 = torch.randn(8, 32)
    small, big = torch.randn(512), torch.randn(16384)
    small_out, big_out = torch.empty(512 * world), torch.empty(16384 * world)
    sp, so, bp, bo = small.data_ptr(), small_out.data_ptr(), big.data_ptr(), big_out.data_ptr()
    calls = {
        "none": None,
        "barrier": comm.barrier,
        "all_gather": lambda: comm.all_gather(sp, so, 512, _C.F32),
        "all_gather_py": lambda: all_gather_into(comm, small_out, small),
        "all_gather_64k": lambda: comm.all_gather(bp, bo, 16384, _C.F32),
    }

    def flow(call):
        x = x0
        comm.barrier()
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(segments):
                x = torch.relu(lin(x)) + x
                if call is not None:
                    call()
        return time.perf_counter() - start

    def alone(call, n=20000):
        comm.barrier()
        start = time.perf_counter()
        for _ in range(n):
            call()
        return (time.perf_counter() - start) / n

    times = {m: [] for m in MODES}
    for _ in range(rounds):
        for m in MODES:
            times[m].append(flow(calls[m]))
    row = [statistics.median(times[m]) / segments for m in MODES]
    row += [alone(calls[m]) for m in MODES[1:]]
    t = torch.tensor(row, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        queue.put(t.tolist())
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--segments", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    world = int(os.environ.get("BENCH_WORLD", "2"))
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(worker, args=(world, free_port(), args.segments, args.rounds, queue), nprocs=world)
    row = queue.get()
    flow, alone = row[:len(MODES)], [None] + row[len(MODES):]
    print(f"# {cpu_name()}; torch {torch.__version__}; {world} ranks, 1 thread each, shm; "
          f"{args.segments} pieces x {args.rounds} rounds")
    print("| after each piece | us per piece | added in the flow, us | alone, us |")
    print("|---|---|---|---|")
    for m, f, a in zip(MODES, flow, alone):
        added = "" if m == "none" else f"{(f - flow[0]) * 1e6:.2f}"
        print(f"| {m} | {f * 1e6:.2f} | {added} | {'' if a is None else f'{a * 1e6:.2f}'} |")


if __name__ == "__main__":
    sys.exit(main())
