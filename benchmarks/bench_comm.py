"""Collective bandwidth: flatshard's shm backend vs gloo, against memcpy measured in the same run.

    python3 benchmarks/bench_comm.py [--worlds 2,4] [--min-mib 1] [--max-mib 256]
                                     [--rounds 5] [--backends shm,torch]

For each world size this spawns that many ranks (one thread each) and times
all-gather and reduce-scatter of float32 at sizes from --min-mib to
--max-mib (doubling), through flatshard's Comm on each backend: "shm"
(csrc/backends/comm_shm.c) and "torch" (the gloo process group).
"shm-cached" and "shm-streamed" are the shm backend with its staging
stores fixed (FLATSHARD_SHM_STAGING; plain "shm" is its default, "auto",
which measures both as it runs and keeps the faster: comm_shm.c,
[Note: staging stores]), each on a process group of its own. Size is the full
buffer, as nccl-tests counts it: the all-gather output, the reduce-scatter
input. Algorithm bandwidth = size / time (GB/s, 1e9), the time being rank
0's mean over the repetitions between two barriers.

The ceiling is measured, not assumed: in every round, after each size's
collectives, rank 0 alone (the others wait in a barrier) times libc's
memcpy on a buffer of that size, a read-only pass (memchr for a byte that
is not there) and a write-only pass (memset); then "peer": rank 0's memcpy
of a shared buffer rank 1 has just written, the copy across CPUs that every
collective on one host makes, whose speed depends on where the run's ranks
lie (benchmarks/results/comm.md, "The shm backend's 1 MiB all-gather": as fast
as memcpy in some runs, half as fast in others). --rounds rounds interleave
them with the collectives, so load that comes and goes reaches both; each
figure is printed as median [min-max] over the rounds, and "/memcpy" is
the collective's median over memcpy's median. The load average is printed
before and after each world size.
"""
import argparse
import ctypes
import os
import shlex
import statistics
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from harness import cpu_name, run_ranks  # noqa: E402

_libc = ctypes.CDLL(None)
_libc.memchr.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
_libc.memchr.restype = ctypes.c_void_p
PASSES = ("memcpy", "read", "write", "peer")
BACKENDS = ("shm", "shm-cached", "shm-streamed", "torch")


def reps_for(size):
    """Repetitions per point: fixed by size, so every rank runs the same count."""
    return max(3, min(30, (256 << 20) // size))


def warmups_for(size, scale):
    """Untimed calls before each point's timed ones: about 512 MiB moved
    (--warmup 1), at least one (the buffers' first touch). On a virtual
    machine two ranks that have been idle (waiting in a barrier while rank 0
    times memcpy) run their first few hundred small collectives 2-4x slower
    than the ones after (benchmarks/results/comm.md, "The shm backend's
    staging stores"), which a point of 30 calls would measure instead of the
    collective; --warmup 0 measures that."""
    return max(1, int(scale * min(300, (512 << 20) // size)))


def timed(fn, reps, sync, warmups=1):
    for _ in range(warmups):  # first touch of the buffers, and see warmups_for
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - start) / reps


def ceiling(size, reps, bufs):
    """Seconds per pass of memcpy, read and write on `size` bytes (libc's own
    routines, one thread): the median of `reps` timings each."""
    a, b = bufs
    pa, pb = a.data_ptr(), b.data_ptr()
    calls = {"memcpy": lambda: ctypes.memmove(pb, pa, size),
             "read": lambda: _libc.memchr(pa, 1, size),  # a is 1.0f: no byte 0x01
             "write": lambda: ctypes.memset(pb, 0, size)}
    out = {}
    for name, fn in calls.items():
        fn()
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        out[name] = statistics.median(ts)
    return out


def shared_buffer(rank, port, nbytes, sync):
    """nbytes of float32 every rank maps (a /dev/shm file rank 0 makes and
    removes once all have mapped it)."""
    path = f"/dev/shm/flatshard-bench-comm-{os.getppid()}-{port}"
    if rank == 0:
        with open(path, "wb") as f:
            f.truncate(nbytes)
    sync()
    try:
        buf = torch.from_file(path, shared=True, size=nbytes // 4, dtype=torch.float32)
        sync()
    finally:
        if rank == 0:
            os.unlink(path)
    return buf


def peer_copy(rank, shared, size, reps, sync):
    """Rank 0's median seconds to memcpy `size` bytes that rank 1 wrote just
    before (each repetition: rank 1 writes, a barrier, rank 0 copies); None
    with one rank."""
    if shared is None:
        return None
    src, dst = shared[:size // 4], torch.empty(size // 4)
    ts = []
    for _ in range(reps + 1):
        if rank == 1:
            src.fill_(1.0)
        sync()
        if rank == 0:
            t = time.perf_counter()
            ctypes.memmove(dst.data_ptr(), src.data_ptr(), size)
            ts.append(time.perf_counter() - t)
        sync()
    return statistics.median(ts[1:]) if rank == 0 else None


def worker(rank, port, world, sizes, rounds, backends, warmup, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from flatshard.runtime import comm as fcomm
    comms = {}
    for b in backends:
        if b.startswith("shm-"):
            os.environ[fcomm.ENV_STAGING] = b[4:]
            comms[b] = fcomm.comm_for(dist.new_group(backend="gloo"), "shm")
            del os.environ[fcomm.ENV_STAGING]
        else:
            comms[b] = fcomm.comm_for(dist.group.WORLD, b)
    sync = comms[backends[0]].barrier
    shared = shared_buffer(rank, port, max(sizes), sync) if world > 1 else None
    res = {}  # (size, what) -> [seconds per round]
    for _ in range(rounds):
        for size in sizes:
            n = size // 4 // world  # elements per rank
            shard, full = torch.ones(n), torch.ones(n * world)
            reps, warm = reps_for(size), warmups_for(size, warmup)
            for backend, c in comms.items():
                ag = timed(lambda: fcomm.all_gather_into(c, full, shard), reps, sync, warm)
                rs = timed(lambda: fcomm.reduce_scatter_into(c, shard, full, average=False),
                           reps, sync, warm)
                res.setdefault((size, "ag", backend), []).append(ag)
                res.setdefault((size, "rs", backend), []).append(rs)
            if rank == 0:
                for name, t in ceiling(size, reps, (torch.ones(size // 4),
                                                    torch.empty(size // 4))).items():
                    res.setdefault((size, name, ""), []).append(t)
            sync()
            t = peer_copy(rank, shared, size, reps, sync)
            if t is not None:
                res.setdefault((size, "peer", ""), []).append(t)
    if rank == 0:
        out.put(res)
    sync()
    dist.destroy_process_group()


def spread(size, times):
    """'median [min-max]' of the bandwidths, and the median."""
    bw = sorted(size / t / 1e9 for t in times)
    med = statistics.median(bw)
    return f"{med:.2f} [{bw[0]:.2f}-{bw[-1]:.2f}]", med


def load():
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--min-mib", type=int, default=1)
    ap.add_argument("--max-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backends", default="shm,torch")
    ap.add_argument("--warmup", type=float, default=1.0,
                    help="untimed calls per point, as a multiple of about 512 MiB moved "
                         "(at least one call)")
    args = ap.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    if not backends or any(b not in BACKENDS for b in backends):
        ap.error("--backends: a comma list of " + ", ".join(map(repr, BACKENDS)))
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    sizes, s = [], args.min_mib
    while s <= args.max_mib:
        sizes.append(s << 20)
        s *= 2
    print("command: python3 " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"{cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, float32, "
          f"GB/s = 1e9 bytes/s, median [min-max] over {args.rounds} rounds, "
          f"{warmups_for(sizes[0], args.warmup)} untimed calls before each "
          f"{sizes[0] >> 20} MiB point")
    for world in (int(w) for w in args.worlds.split(",")):
        print(f"\n== {world} ranks == {load()}")
        res = run_ranks(worker, world, world, sizes, args.rounds, backends, args.warmup)
        head = f"{'size':>7} | " + " | ".join(f"{p:>19}" for p in PASSES)
        for b in backends:
            name = "gloo" if b == "torch" else b
            head += f" | {'all-gather ' + name:>19} {'/memcpy':>7} | " \
                    f"{'reduce-scatter ' + name:>22} {'/memcpy':>7}"
        print(head)
        for size in sizes:
            cells, ceil = [], None
            for p in PASSES:
                if (size, p, "") not in res:  # "peer" with one rank
                    cells.append(f"{'-':>19}")
                    continue
                text, med = spread(size, res[(size, p, "")])
                ceil = med if p == "memcpy" else ceil
                cells.append(f"{text:>19}")
            row = f"{size >> 20:>4}MiB | " + " | ".join(cells)
            for b in backends:
                ag, ag_med = spread(size, res[(size, "ag", b)])
                rs, rs_med = spread(size, res[(size, "rs", b)])
                row += f" | {ag:>19} {ag_med / ceil:>7.2f} | {rs:>22} {rs_med / ceil:>7.2f}"
            print(row)
        print(f"   after: {load()}")


if __name__ == "__main__":
    main()
