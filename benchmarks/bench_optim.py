"""AdamW step over 2^26 fp32 parameters: flatshard's fused C step vs torch's
AdamW (foreach=True and fused=True), against a measured memory-copy ceiling.

    python3 benchmarks/bench_optim.py [--log2 26] [--threads 2] [--reps 5]

A pure fp32 AdamW step reads param, grad, exp_avg, exp_avg_sq and writes
param, exp_avg, exp_avg_sq: 28 bytes per parameter, so its speed limit is the
machine's memory bandwidth. The ceiling is the faster of two streaming loops
on buffers of the same size, counted as bytes read + written: `dst.copy_(src)`
(whose stores also read dst first, uncounted, as every store to memory not
already in cache does) and `a.add_(b)` (reads a and b, writes a: every byte
moved is counted, as in the optimizer step). Also timed: the step that also
writes a bf16 copy of the updated parameters (the offload / mixed-precision
case; 30 bytes per parameter): flatshard in one pass vs torch's fused step
followed by a separate `copy_`.
"""
import argparse
import shlex
import statistics
import sys
import time

import torch

import flatshard.optim as fo


def median_time(fn, reps):
    fn()  # warm-up: first touch, lazy state
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2", type=int, default=26)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    n = 1 << args.log2
    print("command: python3 " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"torch {torch.__version__}, {n:,} fp32 parameters, {args.threads} threads, "
          f"median of {args.reps} interleaved rounds")
    src, dst = torch.randn(n), torch.empty(n)
    copy_bw = 2 * 4 * n / median_time(lambda: dst.copy_(src), args.reps)
    add_bw = 3 * 4 * n / median_time(lambda: dst.add_(src), args.reps)
    ceiling = max(copy_bw, add_bw)
    del src, dst
    print(f"ceiling: {ceiling / 1e9:.2f} GB/s read + write (copy_ {copy_bw / 1e9:.2f}, "
          f"add_ {add_bw / 1e9:.2f})")

    # Every contender gets its own parameter and state, all built first and
    # then timed in interleaved rounds, so that allocation order and machine
    # noise fall on all of them alike.
    grad = torch.randn(n)
    low = torch.empty(n, dtype=torch.bfloat16)
    steps = {}
    for name in ("torch foreach", "torch fused", "flatshard", "torch fused + copy_ bf16"):
        p = torch.randn(n)
        p.grad = grad
        if name == "flatshard":
            opt = fo.AdamW([p], lr=1e-3, threads=args.threads)
        else:
            opt = torch.optim.AdamW([p], lr=1e-3, foreach=name == "torch foreach",
                                    fused=name != "torch foreach")
        if "copy_" in name:
            steps[name] = (lambda o, q: lambda: (o.step(), low.copy_(q)))(opt, p)
        else:
            steps[name] = opt.step
    p = torch.randn(n)
    st = {"exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n), "step": 0}

    def fused_with_copy():
        st["step"] += 1
        fo.adamw_step_(p, grad, st["exp_avg"], st["exp_avg_sq"], st["step"], lr=1e-3,
                       out_copy=low, threads=args.threads)
    steps["flatshard + bf16 copy"] = fused_with_copy
    times = {name: [] for name in steps}
    for fn in steps.values():
        fn()  # warm-up: first touch of the state
    for _ in range(args.reps):
        for name, fn in steps.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    rows = {name: statistics.median(ts) for name, ts in times.items()}

    print(f"\n{'step':>26} {'ms':>9} {'GB/s':>7} {'/ceiling':>9}")
    for name, t in rows.items():
        moved = (30 if "copy" in name else 28) * n
        print(f"{name:>26} {t * 1e3:9.1f} {moved / t / 1e9:7.2f} {moved / t / ceiling:9.2f}")
    f = rows["flatshard"]
    print(f"\nflatshard vs torch fused: {rows['torch fused'] / f:.2f}x faster; "
          f"vs torch foreach: {rows['torch foreach'] / f:.2f}x faster")
    print(f"flatshard + bf16 copy vs torch fused + copy_: "
          f"{rows['torch fused + copy_ bf16'] / rows['flatshard + bf16 copy']:.2f}x faster")


if __name__ == "__main__":
    main()
