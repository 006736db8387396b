"""One shm all-gather size in several fresh pairs of ranks: whether its time is a property of the run.

    python3 benchmarks/bench_comm_modes.py [--kib 1024] [--pairs 6] [--calls 3000]
                                           [--window 250] [--realloc]
                                           [--staging auto]

Each pair is two new processes (forked, one thread each) with a new shm
Comm (its own segment), which call the all-gather of --kib KiB (the output,
as bench_comm.py counts it; float32) --calls times back to back, each call
timed alone. Printed per pair: rank 0's median microseconds per call in
each window of --window calls, and the GB/s of the pair's median. Beside
them, in the same pairs, the same bytes as one rank's piece copied by
libc's memcpy from a buffer the other rank has just written (the read a
peer's slot costs) and from a buffer of its own (the ceiling of one copy),
alternating call by call. --realloc gives each window new input and output
tensors (new pages), with the segment kept: a time that changes with them
follows where the buffers lie, one that does not follows the segment or
the machine.

--staging cached,streamed,auto gives each pair one Comm per setting of
FLATSHARD_SHM_STAGING (comm_shm.c, [Note: staging stores]) and calls them
in turn, call by call, so that all of them meet the same placement of the
pair's CPUs; each is printed on its own line.

A figure that stays put within a pair but differs between pairs is a
property of that run (where its pages or its CPUs lie), not of the code:
bench_comm.py's one run of the 1 MiB point cannot tell them apart.
"""
import argparse
import ctypes
import mmap
import multiprocessing as mp
import os
import statistics
import sys
import time
import uuid

os.environ["OMP_NUM_THREADS"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

from harness import cpu_name  # noqa: E402


def attach(_C, rank, world, name, staging="auto"):
    """Rank 0 creates the segment; the others retry until it is there."""
    deadline = time.monotonic() + 30
    while True:
        try:
            return _C.Comm("shm", rank, world, name=name, create=rank == 0,
                           slot_bytes=8 << 20, timeout_s=60.0, staging=staging)
        except Exception:
            if rank == 0 or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def windows(ts, size):
    return [round(statistics.median(ts[i:i + size]) * 1e6, 1) for i in range(0, len(ts), size)]


def gather_rank(rank, args, name, q):
    from flatshard import _C
    torch.set_num_threads(1)
    comms = [attach(_C, rank, 2, f"{name}-{st}", st) for st in args.staging]
    n = (args.kib << 10) // 4 // 2
    shard, full = torch.ones(n), torch.ones(2 * n)
    for c in comms:
        for _ in range(20):
            c.all_gather(shard.data_ptr(), full.data_ptr(), n, _C.F32, "")
        c.barrier()
    ts, kept = [[] for _ in comms], []
    for i in range(args.calls):
        if args.realloc and i % args.window == 0:
            kept.append((shard, full))  # held: the new ones get other pages
            shard, full = torch.ones(n), torch.ones(2 * n)
        for c, out in zip(comms, ts):
            t = time.perf_counter()
            c.all_gather(shard.data_ptr(), full.data_ptr(), n, _C.F32, "")
            out.append(time.perf_counter() - t)
    comms[0].barrier()
    q.put((rank, ts))


def copy_pair(args, q):
    """Rank 1 writes a piece into shared memory, rank 0 copies it out (a
    peer's slot read), then copies a piece of its own (one copy's ceiling)."""
    nbytes = (args.kib << 10) // 2
    shm = mmap.mmap(-1, nbytes + 4096)
    turn = ctypes.c_uint32.from_buffer(shm, nbytes)  # 0: the writer's, 1: the reader's
    shared = ctypes.addressof(ctypes.c_char.from_buffer(shm, 0))
    src, dst = ctypes.create_string_buffer(b"x" * nbytes, nbytes), ctypes.create_string_buffer(nbytes)
    calls = min(args.calls, 2000)
    pid = os.fork()
    if pid == 0:
        for _ in range(calls):
            while turn.value != 0:
                pass
            ctypes.memmove(shared, src, nbytes)
            turn.value = 1
        os._exit(0)
    peer, own = [], []
    for _ in range(calls):
        while turn.value != 1:
            pass
        t = time.perf_counter()
        ctypes.memmove(dst, shared, nbytes)
        peer.append(time.perf_counter() - t)
        t = time.perf_counter()
        ctypes.memmove(dst, src, nbytes)
        own.append(time.perf_counter() - t)
        turn.value = 0
    os.waitpid(pid, 0)
    q.put((statistics.median(peer), statistics.median(own)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kib", type=int, default=1024)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--window", type=int, default=250)
    ap.add_argument("--realloc", action="store_true")
    ap.add_argument("--staging", default="auto",
                    help="comma list of FLATSHARD_SHM_STAGING settings: auto, cached, streamed")
    args = ap.parse_args()
    args.staging = [st for st in args.staging.split(",") if st]
    if not args.staging or any(st not in ("auto", "cached", "streamed") for st in args.staging):
        ap.error("--staging: a comma list of 'auto', 'cached' and 'streamed'")
    if args.kib < 8 or args.pairs < 1 or args.calls < args.window or args.window < 1:
        ap.error("--kib >= 8, --pairs >= 1, --calls >= --window >= 1")
    ctx = mp.get_context("fork")
    size = args.kib << 10
    print(f"{cpu_name()}, 2 ranks, all-gather of {args.kib} KiB (float32), {args.calls} calls "
          f"per pair, windows of {args.window}{', new buffers each window' if args.realloc else ''}"
          f"; load {os.getloadavg()[0]:.2f}")
    for p in range(args.pairs):
        q = ctx.Queue()
        name = f"/flatshard-modes-{os.getpid()}-{p}-{uuid.uuid4().hex[:6]}"
        procs = [ctx.Process(target=gather_rank, args=(r, args, name, q)) for r in range(2)]
        for pr in procs:
            pr.start()
        got = dict(q.get() for _ in procs)
        for pr in procs:
            pr.join()
        cp = ctx.Process(target=copy_pair, args=(args, q))
        cp.start()
        peer, own = q.get()
        cp.join()
        print(f"  pair {p}: a {size >> 11} KiB piece: peer's {peer * 1e6:.1f} us, own "
              f"{own * 1e6:.1f} us")
        for st, ts in zip(args.staging, got[0]):
            med = statistics.median(ts)
            print(f"    {st:>8}: all-gather {med * 1e6:7.1f} us median ({size / med / 1e9:5.2f} "
                  f"GB/s); windows {windows(ts, args.window)}")
    print(f"  load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
