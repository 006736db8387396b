"""AdamW step over 2^20, 2^24 and 2^26 fp32 parameters: flatshard's fused C
step vs torch's AdamW (foreach=True and fused=True) and, when DeepSpeed is
installed, DeepSpeedCPUAdam (adamw_mode=True), against a measured
memory-copy ceiling and the step's own traffic bound.

    python3 benchmarks/bench_optim.py [--log2 20 24 26] [--threads 2] [--reps 5]
        [--no-model] [--isa native|avx2] [--first-steps 60]

--isa avx2 caps every contender at AVX2: torch by ATEN_CPU_CAPABILITY=avx2
(set before torch is imported), flatshard by simd="avx2"; DeepSpeedCPUAdam
is built for the CPU's own instruction set by its op builder, so its column
is left out under the cap unless its op was built for AVX2 (said so).
--first-steps N: instead of the tables, a fresh flatshard AdamW and a fresh
torch fused AdamW (each its own parameter and state) take turns step by step
for their first N steps at 2^log2 (the first --log2), in two processes one
after the other sharing one new cache file: the first measures flatshard's
loop before its first step, the second finds the choice in the file. Printed
per process: the N steps' total of each and the ratio.

Hyperparameters as in LLM pre-training: lr 1e-3, betas (0.9, 0.95), eps
1e-8, weight decay 0.1. A pure fp32 AdamW step reads param, grad, exp_avg,
exp_avg_sq and writes param, exp_avg, exp_avg_sq: 28 bytes per parameter, so
its speed limit is the machine's memory bandwidth. The ceiling is the faster
of two streaming loops on buffers of the same size, counted as bytes read +
written: `dst.copy_(src)` (whose stores also read dst first, uncounted, as
every store to memory not already in cache does) and `a.add_(b)` (reads a
and b, writes a: every byte moved is counted, as in the optimizer step).
The step's own bound is timed in the same rounds as the steps: the C loop of
adam_traffic.c (built at the start with cc -O3 -march=native) reads and
writes the step's 28 bytes per element with no math, on the same threads
(torch's OpenMP team, found at run time as flatshard's loop finds it); its row says how much faster than each contender any loop could
be at that moment (on a 2-vCPU VM the memory bandwidth itself moves by 1.5x
with where the host runs the vCPUs).
Then one optimizer over GPT-2 small's parameter list (148 tensors), where
what each tensor costs beside its bytes counts too, and over 256 tensors of
768 parameters, where little else counts (printed per tensor), as plain
tensors and as DTensors on a one-rank mesh (fully_shard's parameters). Also timed: the step
that also writes a bf16 copy of the updated parameters
(the offload / mixed-precision case; 30 bytes per parameter): flatshard in
one pass vs torch's fused step followed by a separate `copy_`.

flatshard chooses its loop variant per size class: a class under 2^16
elements on scratch buffers before its first step, a larger one on slices of
its own first steps (or it reads an earlier process's choice from its cache
file: here a new file per run, so every class is measured; the warm-up steps
before the timed rounds see the larger classes decided); the choices and
their timings are printed after the tables (the loop's candidates in CPU
time per element of their busiest thread, the thread splits in wall-clock
time). The load average is printed beside each table. On a shared machine
the medians move with the load: the ratios are
printed for the medians and, in brackets, for each contender's fastest
round. DeepSpeed is optional and never required: its CPU
Adam op is built on first use (DS_ACCELERATOR=cpu, a C++ compiler).
"""
import argparse
import ctypes
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

if "--isa" in sys.argv and sys.argv[sys.argv.index("--isa") + 1:][:1] == ["avx2"]:
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"  # before torch is imported
import torch  # noqa: E402

import flatshard.optim as fo  # noqa: E402
from flatshard.optim.checks import _zeros_like  # noqa: E402

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BOUND = "28-byte bound (C, no math)"


def median_time(fn, reps):
    fn()  # warm-up: first touch, lazy state
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def time_rounds(steps, times, reps):
    """`reps` rounds of every step in `steps` (name -> fn), each time
    appended to times[name]. Each round starts from another contender: none
    always follows the same one (whose OpenMP threads may still be spinning,
    whose stores may still be draining)."""
    order = list(steps.items())
    for r in range(reps):
        k = r % len(order)
        for name, fn in order[k:] + order[:k]:
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)


def cpu_model():
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or "unknown CPU"
    flags = set(fields.get("flags", "").split())
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    if "avx512f" in flags and "avx512_bf16" in flags:
        isa += " with AVX512_BF16"
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}, {isa}, {os.cpu_count()} logical CPUs)")


def load():
    return "load average %.2f %.2f %.2f" % os.getloadavg()


def deepspeed_adam(isa):
    """DeepSpeedCPUAdam, or None with the reason when it cannot be used here."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder
    except Exception as e:  # not installed, or its op does not build here
        return None, f"{type(e).__name__}: {e}".splitlines()[0]
    width = CPUAdamBuilder().simd_width()
    if isa == "avx2" and "AVX512" in width:
        return None, f"its op is built for {width.strip()}, above the AVX2 cap"
    return DeepSpeedCPUAdam, None


def traffic_loop():
    """The C loop of adam_traffic.c (built here, once per run) as a function
    of (param, grad, exp_avg, exp_avg_sq, threads), or (None, why)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None, "no C compiler (cc or gcc) on PATH"
    here = os.path.dirname(os.path.abspath(__file__))
    lib = os.path.join(tempfile.mkdtemp(prefix="bench-optim-"), "adam_traffic.so")
    try:
        subprocess.run([cc, "-O3", "-march=native", "-shared", "-fPIC", "-o", lib,
                        os.path.join(here, "adam_traffic.c"), "-ldl"], check=True,
                       capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        return None, f"adam_traffic.c did not build: {e}"
    fn = ctypes.CDLL(lib).adam_traffic
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int]
    fn.restype = ctypes.c_int
    return (lambda p, g, m, v, threads: fn(p.data_ptr(), g.data_ptr(), m.data_ptr(),
                                            v.data_ptr(), p.numel(), threads)), None


def bench_size(log2, args, ds_adam):
    n = 1 << log2
    src, dst = torch.randn(n), torch.empty(n)
    copy_bw = 2 * 4 * n / median_time(lambda: dst.copy_(src), args.reps)
    add_bw = 3 * 4 * n / median_time(lambda: dst.add_(src), args.reps)
    ceiling = max(copy_bw, add_bw)
    del src, dst
    print(f"\n2^{log2} = {n:,} fp32 parameters; ceiling {ceiling / 1e9:.2f} GB/s read + write "
          f"(copy_ {copy_bw / 1e9:.2f}, add_ {add_bw / 1e9:.2f})")

    # Every contender gets its own parameter and state, all built first and
    # then timed in interleaved rounds, so that allocation order and machine
    # noise fall on all of them alike.
    grad = torch.randn(n)
    low = torch.zeros(n, dtype=torch.bfloat16)
    names = ["torch foreach", "torch fused", "flatshard"] + \
        (["DeepSpeedCPUAdam"] if ds_adam else []) + ["torch fused + copy_ bf16"]
    steps = {}
    for name in names:
        p = torch.randn(n)
        p.grad = grad
        if name == "flatshard":
            opt = flatshard_adamw(p, args)
        elif name == "DeepSpeedCPUAdam":
            opt = ds_adam([p], **HP, adamw_mode=True)
        else:
            opt = torch.optim.AdamW([p], **HP, foreach=name == "torch foreach",
                                    fused=name != "torch foreach")
        if "copy_" in name:
            steps[name] = (lambda o, q: lambda: (o.step(), low.copy_(q)))(opt, p)
        else:
            steps[name] = opt.step
    p = torch.randn(n)
    # state placed as flatshard's AdamW places its own ([Note: state in huge
    # pages] in flatshard/optim), so that the ratio to the plain step is the
    # copy's cost alone
    st = {"exp_avg": _zeros_like(p), "exp_avg_sq": _zeros_like(p), "step": 0}

    def fused_with_copy():
        st["step"] += 1
        fo.adamw_step_(p, grad, st["exp_avg"], st["exp_avg_sq"], st["step"], **HP,
                       out_copy=low, threads=args.threads, simd=args.simd)
    steps["flatshard + bf16 copy"] = fused_with_copy
    loop, why = traffic_loop()
    if loop:  # the same 28 bytes with no math: the speed limit, measured in the same rounds
        # laid out as flatshard's AdamW lays out a parameter and its state
        tp, tg = torch.randn(n), torch.randn(n)
        tm, tv = _zeros_like(tp), _zeros_like(tp)
        steps[BOUND] = lambda: loop(tp, tg, tm, tv, args.threads)
    else:
        print(f"(the 28-byte bound is not timed: {why})")
    times = {name: [] for name in steps}
    for _ in range(3):  # warm-up: first touch of the state; flatshard's choice of loop
        for fn in steps.values():
            fn()
    print(load())
    time_rounds(steps, times, args.reps)
    rows = {name: statistics.median(ts) for name, ts in times.items()}
    fastest = {name: min(ts) for name, ts in times.items()}

    def ratio(a, b):
        return f"{rows[a] / rows[b]:.2f}x ({fastest[a] / fastest[b]:.2f}x)"

    print(f"{'step':>26} {'ms':>9} {'min ms':>9} {'GB/s':>7} {'/ceiling':>9}")
    for name, t in rows.items():
        moved = (30 if "copy" in name else 28) * n
        print(f"{name:>26} {t * 1e3:9.2f} {min(times[name]) * 1e3:9.2f} "
              f"{moved / t / 1e9:7.2f} {moved / t / ceiling:9.2f}")
    print(f"flatshard vs torch fused: {ratio('torch fused', 'flatshard')} faster; "
          f"vs torch foreach: {ratio('torch foreach', 'flatshard')}"
          + (f"; vs DeepSpeedCPUAdam: {ratio('DeepSpeedCPUAdam', 'flatshard')}"
             if ds_adam else ""))
    if BOUND in rows:
        print(f"{BOUND}: {ratio('torch fused', BOUND)} faster than torch fused, "
              f"{ratio('flatshard', BOUND)} faster than flatshard (what any loop moving the "
              f"28 bytes could gain at most, here and now)")
    print(f"flatshard + bf16 copy: {ratio('flatshard + bf16 copy', 'flatshard')} flatshard's "
          f"plain step; {ratio('torch fused + copy_ bf16', 'flatshard + bf16 copy')} faster "
          f"than torch fused + copy_")


def gpt2_shapes():
    """GPT-2 small's parameter tensors (124M parameters in 148 tensors: the
    token and position embeddings, then per layer two LayerNorms, the
    attention's fused qkv and output projections, the MLP's two matrices)."""
    shapes = [(50257, 768), (1024, 768)]
    for _ in range(12):
        shapes += [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,),
                   (768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
    return shapes + [(768,), (768,)]


def race_lists(shapes, args, ds_adam):
    """Each contender's own optimizer over parameters of `shapes` (the same
    gradients for all), warmed up, then timed in interleaved rounds (at
    least 15): name -> median seconds, and the medians' ratios printed."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=g) for s in shapes]
    names = ["torch fused", "flatshard"] + (["DeepSpeedCPUAdam"] if ds_adam else [])
    steps = {}
    for name in names:
        ps = [torch.randn(s, generator=g) for s in shapes]
        for p, gr in zip(ps, grads):
            p.grad = gr
        if name == "flatshard":
            steps[name] = fo.AdamW(ps, **HP, threads=args.threads).step
        elif name == "DeepSpeedCPUAdam":
            steps[name] = ds_adam(ps, **HP, adamw_mode=True).step
        else:
            steps[name] = torch.optim.AdamW(ps, **HP, fused=True).step
    for _ in range(3):  # warm-up: first touch of the state; flatshard's choice of loop
        for fn in steps.values():
            fn()
    print(load())
    times = {name: [] for name in steps}
    time_rounds(steps, times, max(args.reps, 15))
    return {name: statistics.median(ts) for name, ts in times.items()}, times


def race_dtensors(count, numel, args):
    """torch fused and flatshard over `count` DTensor parameters of `numel`
    elements on a one-rank mesh (gloo, a file store in a new folder), as
    fully_shard hands them to an optimizer: name -> median seconds."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="bench-optim-"), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = torch.Generator().manual_seed(0)
        steps = {}
        for name in ("torch fused", "flatshard"):
            ps = [torch.nn.Parameter(distribute_tensor(torch.randn(numel, generator=g), mesh,
                                                       [Shard(0)])) for _ in range(count)]
            for p in ps:  # laid out with the parameter's own mesh and placements, as
                # fully_shard makes its gradients
                p.grad = DTensor.from_local(torch.randn(numel, generator=g), p.device_mesh,
                                            p.placements, run_check=False)
            steps[name] = (fo.AdamW(ps, **HP, threads=args.threads) if name == "flatshard" else
                           torch.optim.AdamW(ps, **HP, fused=True)).step
        for _ in range(3):
            for fn in steps.values():
                fn()
        times = {name: [] for name in steps}
        time_rounds(steps, times, max(args.reps, 15))
        return {name: statistics.median(ts) for name, ts in times.items()}
    finally:
        dist.destroy_process_group()


def print_ratios(med):
    print(f"flatshard vs torch fused: {med['torch fused'] / med['flatshard']:.2f}x faster"
          + (f"; vs DeepSpeedCPUAdam: {med['DeepSpeedCPUAdam'] / med['flatshard']:.2f}x"
             if "DeepSpeedCPUAdam" in med else ""))


def bench_model(args, ds_adam):
    """One optimizer over a model's parameter list: every tensor its own
    state, the per-tensor costs (Python, the call into C, the thread
    split) paid 148 times per step."""
    shapes = gpt2_shapes()
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"\nGPT-2 small's parameter list: {len(shapes)} tensors, {n:,} fp32 parameters")
    med, times = race_lists(shapes, args, ds_adam)
    print(f"{'step':>26} {'ms':>9} {'min ms':>9} {'GB/s':>7}")
    for name, t in med.items():
        print(f"{name:>26} {t * 1e3:9.2f} {min(times[name]) * 1e3:9.2f} {28 * n / t / 1e9:7.2f}")
    print_ratios(med)


def bench_small(args, ds_adam, count=256, numel=768):
    """Many small tensors (LayerNorm- and bias-sized): what each tensor costs
    a step besides its bytes (the Python checks, the call into C, the split),
    per tensor."""
    print(f"\n{count} tensors of {numel} fp32 parameters (per-tensor cost)")
    med, _ = race_lists([(numel,)] * count, args, ds_adam)
    print(f"{'step':>26} {'ms':>9} {'us/tensor':>10}")
    for name, t in med.items():
        print(f"{name:>26} {t * 1e3:9.3f} {t / count * 1e6:10.2f}")
    print_ratios(med)
    print(f"\nthe same as DTensor parameters (one-rank mesh, as fully_shard's): {load()}")
    med = race_dtensors(count, numel, args)
    for name, t in med.items():
        print(f"{name:>26} {t * 1e3:9.3f} {t / count * 1e6:10.2f}")
    print_ratios(med)


class _Capped:
    """flatshard's step under an instruction-set cap (simd= of the functional
    form; the optimizer classes run at the CPU's best), its state placed as
    AdamW places its own."""
    def __init__(self, p, args):
        self.p, self.args, self.st = p, args, None

    def step(self):
        if self.st is None:  # at the first step, as AdamW makes its state
            self.st = {"exp_avg": _zeros_like(self.p), "exp_avg_sq": _zeros_like(self.p), "step": 0}
        self.st["step"] += 1
        fo.adamw_step_(self.p, self.p.grad, self.st["exp_avg"], self.st["exp_avg_sq"],
                       self.st["step"], **HP, threads=self.args.threads, simd=self.args.simd)


def flatshard_adamw(p, args):
    return fo.AdamW([p], **HP, threads=args.threads) if args.simd == "auto" else _Capped(p, args)


def first_steps(args):
    """One process's part of --first-steps: fresh optimizers, taking turns."""
    n, count = 1 << args.log2[0], args.first_steps
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=g)
    pf, pt = torch.randn(n, generator=g), torch.randn(n, generator=g)
    pf.grad, pt.grad = grad, grad
    ours = flatshard_adamw(pf, args)
    theirs = torch.optim.AdamW([pt], **HP, fused=True)
    t_ours, t_theirs = [], []
    before = load()
    for k in range(count):
        order = [(ours, t_ours), (theirs, t_theirs)]
        for opt, ts in order if k % 2 == 0 else order[::-1]:
            t = time.perf_counter()
            opt.step()
            ts.append(time.perf_counter() - t)
    r = [r for r in fo.tune_report() if r["kind"] == "adam" and r["size_log2"] == args.log2[0]]
    how = "?"
    if r:
        r = r[0]
        how = (f"measured on its first {r['live_steps']} steps, {r['tune_s'] * 1e3:.1f} ms "
               "beyond the winner's time" if r["source"] == "steps" else
               f"{r['source']} in {r['tune_s'] * 1e3:.1f} ms") + \
            (", busy machine" if r["busy"] else "") + f": {r['chosen']}"
    print(f"  first {count} steps at 2^{args.log2[0]}: flatshard {sum(t_ours) * 1e3:.0f} ms "
          f"(first step {t_ours[0] * 1e3:.1f} ms, loop {how}), torch fused "
          f"{sum(t_theirs) * 1e3:.0f} ms (first step {t_theirs[0] * 1e3:.1f} ms): flatshard at "
          f"{sum(t_theirs) / sum(t_ours):.2f}x torch fused's speed; {before}, after: "
          f"{load()[13:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2", type=int, nargs="+", default=[20, 24, 26])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-model", action="store_true",
                    help="skip the step over GPT-2 small's 148 parameter tensors")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native")
    ap.add_argument("--first-steps", type=int, default=0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.simd = "avx2" if args.isa == "avx2" else "auto"
    torch.set_num_threads(args.threads)
    if args.child:
        first_steps(args)
        return
    print("command: python3 " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"CPU: {cpu_model()}")
    print(f"torch {torch.__version__} (capability {torch.backends.cpu.get_cpu_capability()}), "
          f"flatshard simd={args.simd}, {args.threads} threads")
    if args.first_steps:
        cache = os.path.join(tempfile.mkdtemp(prefix="bench-optim-"), "optim_tune.txt")
        env = dict(os.environ, FLATSHARD_OPTIM_TUNE_CACHE=cache,
                   OMP_NUM_THREADS=str(args.threads))
        for who in ("a fresh process, empty cache file", "a second process, same file"):
            print(who + ":", flush=True)
            subprocess.run([sys.executable, os.path.abspath(__file__), "--child"] +
                           sys.argv[1:], env=env, check=True)
        return
    # a new cache file: every class measured in this run
    os.environ["FLATSHARD_OPTIM_TUNE_CACHE"] = os.path.join(
        tempfile.mkdtemp(prefix="bench-optim-"), "optim_tune.txt")
    ds_adam, why = deepspeed_adam(args.isa)
    print(f"median of {args.reps} interleaved rounds; DeepSpeedCPUAdam: "
          + ("timed" if ds_adam else f"not timed ({why})"))
    for log2 in args.log2:
        bench_size(log2, args, ds_adam)
    if not args.no_model:
        bench_model(args, ds_adam)
        bench_small(args, ds_adam)
    print("\nflatshard's loop variants, as measured (on scratch before a small class's first step, on"
          " a larger class's own first steps):")
    print("\n".join(fo.describe_tuning()))


if __name__ == "__main__":
    main()
