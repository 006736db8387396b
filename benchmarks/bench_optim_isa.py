"""AdamW on 2^24 fp32 parameters, 2 threads: flatshard's loop capped at an
instruction set against torch's fused AdamW capped at the same one, the two
taking turns step by step in one process.

    OMP_NUM_THREADS=2 python3 benchmarks/bench_optim_isa.py avx2|default

avx2: flatshard's `simd="avx2"` and torch's ATEN_CPU_CAPABILITY=avx2 (set
before torch is imported), what a CPU without AVX-512 runs (a Zen 1, Zen 2
or Zen 3 EPYC, many Xeons); default: each at the best this CPU has. Printed:
the median of steps 11-75 of each (flatshard chooses its loop on scratch
buffers before its first step, or reads the choice from its cache file;
the first steps also fault in the state) and torch's time over flatshard's
(above 1: flatshard is faster), with the load average. bench_optim.py --isa
avx2 times the same cap against every contender, and the first steps.
"""
import os
import statistics
import sys
import time

cap = sys.argv[1] if len(sys.argv) > 1 else "default"
if cap not in ("avx2", "default"):
    sys.exit("usage: bench_optim_isa.py avx2|default")
if cap == "avx2":
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
import torch  # noqa: E402
from harness import cpu_name  # noqa: E402
from flatshard.optim.functional import adamw_step_  # noqa: E402

torch.set_num_threads(2)
n = 1 << 24
g = torch.Generator().manual_seed(0)
def bufs():
    return [torch.randn(n, generator=g) for _ in range(4)]
a = bufs(); b = bufs()
p = torch.nn.Parameter(b[0]); p.grad = b[1]
opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
simd = "avx2" if cap == "avx2" else "auto"
tf, tt = [], []
for step in range(1, 76):
    t = time.perf_counter(); adamw_step_(a[0], a[1], a[2], a[3], step, lr=1e-3, threads=2, simd=simd); tf.append(time.perf_counter() - t)
    t = time.perf_counter(); opt.step(); tt.append(time.perf_counter() - t)
mf, mt = statistics.median(tf[10:]) * 1e3, statistics.median(tt[10:]) * 1e3
print(f"{cpu_name()}; {cap}: torch's capability {torch.backends.cpu.get_cpu_capability()}; "
      f"flatshard {mf:.2f} ms, torch fused {mt:.2f} ms: flatshard at {mt / mf:.2f}x torch's speed; "
      "load average %.2f %.2f %.2f" % os.getloadavg())
