"""Where a host all-gather's time goes: the shm backend's two-copy path beside single-copy designs.

    python3 benchmarks/bench_copy_designs.py [--kib 512] [--pairs 10] [--calls 1000]

Builds copy_designs.c (beside this file) with the machine's C compiler into
a temporary directory and runs it --pairs times: each run is a fresh pair
of processes that all-gathers 2 x --kib KiB --calls times with every design
in turn, call by call (the designs are described in copy_designs.c). The
host decides where a pair's two CPUs lie, and that decides which design is
fastest (benchmarks/results/comm.md, "The shm backend's staging stores"); so
each pair is printed with its placement ("slow" where plain stores into the
slot take longer than streaming ones, the sign of CPUs that share no
cache), and a table per placement follows.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import cpu_name  # noqa: E402

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "copy_designs.c")


def build(tmp):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        sys.exit("bench_copy_designs: no C compiler (cc or gcc) on PATH")
    exe = os.path.join(tmp, "copy_designs")
    subprocess.run([cc, "-O2", "-std=c11", "-o", exe, SOURCE], check=True)
    return exe


def run_pair(exe, kib, calls):
    """{design: [median us per quarter of the run]} of one fresh pair."""
    out = subprocess.run([exe, str(kib), str(calls)], check=True, capture_output=True,
                         text=True).stdout
    return {line.split()[0]: [float(x) for x in line.split()[1:]] for line in out.splitlines()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kib", type=int, default=512, help="each rank's piece")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    if args.kib < 4 or args.pairs < 1 or args.calls < 4:
        ap.error("--kib >= 4, --pairs >= 1, --calls >= 4")
    print(f"{cpu_name()}, 2 processes, all-gather of 2 x {args.kib} KiB, {args.calls} calls "
          f"of each design per pair; load {os.getloadavg()[0]:.2f}")
    by_place = {"fast": [], "slow": []}
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp)
        for p in range(args.pairs):
            res = run_pair(exe, args.kib, args.calls)
            med = {d: statistics.median(q) for d, q in res.items()}
            place = "slow" if med["slot-cached"] > med["slot-streamed"] else "fast"
            by_place[place].append(med)
            print(f"  pair {p} ({place}): " + ", ".join(f"{d} {m:.1f}" for d, m in med.items())
                  + " us")
    print("\n| placement | pairs | " + " | ".join(by_place["fast"][0] if by_place["fast"]
                                                  else by_place["slow"][0]) + " |")
    for place, meds in by_place.items():
        if not meds:
            continue
        designs = list(meds[0])
        cells = []
        for d in designs:
            xs = [m[d] for m in meds]
            cells.append(f"{min(xs):.0f}-{max(xs):.0f}")
        print(f"| {place} | {len(meds)} | " + " | ".join(cells) + " |")
    print(f"(us per all-gather, the range of the pairs' medians); load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
