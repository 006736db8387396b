"""What the benchmark scripts share around their measurements: a free TCP port
for the ranks' rendezvous, the CPU's name to print beside every figure, the
--impl list checked, and the ranks spawned and watched. Imported by the
scripts as `harness` (their folder is first on sys.path when run as
`python3 benchmarks/<script>.py`)."""
import queue
import socket
import statistics
import sys


def free_port():
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_name():
    """The CPU's model name from /proc/cpuinfo, with its family and model
    (a name such as "AMD EPYC" covers several generations); "unknown CPU"
    elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = {}
            for ln in f:
                if not ln.strip():
                    break  # the first CPU's block is enough
                k, _, v = ln.partition(":")
                fields[k.strip()] = v.strip()
    except OSError:
        return "unknown CPU"
    name = fields.get("model name", "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def impl_list(parser, args, known):
    """args.impl (a comma list) as a list, each checked against `known`."""
    impls = [i for i in args.impl.split(",") if i]
    bad = [i for i in impls if i not in known]
    if bad:
        parser.error(f"--impl: unknown {bad}; choose from {', '.join(known)}")
    return impls


def run_ranks(worker, world, *args):
    """worker(rank, port, *args, out) in `world` spawned processes; returns
    the first thing a rank puts on `out` (rank 0's results). A rank that
    dies ends the run with its exit instead of a wait for it."""
    import torch.multiprocessing as mp  # here: importing torch is the caller's choice
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, port, *args, out)) for r in range(world)]
    for pr in procs:
        pr.start()
    res = None
    while res is None:
        try:
            res = out.get(timeout=5)
        except queue.Empty:
            dead = [r for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
            if dead:
                for pr in procs:
                    pr.kill()
                sys.exit(f"rank(s) {dead} failed; their traceback is above")
    for pr in procs:
        pr.join()
    return res


def print_table(res, impls):
    """The markdown table of step times: each impl's median, p10-p90 and
    ratio to "unwrapped", and its first loss; res[impl] holds "times" and
    "first", or "error" for an impl that failed."""
    un = res.get("unwrapped", {})
    base = statistics.median(un["times"]) if "times" in un else None
    print("| impl | median ms | p10-p90 ms | x unwrapped | first loss |")
    print("|---|---|---|---|---|")
    for impl in impls:
        r = res.get(impl, {})
        if "times" not in r:
            print(f"| {impl} | failed: {r.get('error', '?')[:80]} | | | |")
            continue
        t = sorted(r["times"])
        med = statistics.median(t)
        lo, hi = t[len(t) // 10], t[(9 * len(t)) // 10]
        ratio = f"{med / base:.2f}" if base else "-"
        print(f"| {impl} | {med:.2f} | {lo:.2f}-{hi:.2f} | {ratio} | {r['first']:.6f} |")
