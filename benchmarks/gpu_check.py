"""The GPU check: build flatshard, run the GPU tests, measure. One script,
under 8 minutes on one GPU, no network; prints a table last.

    python3 benchmarks/gpu_check.py [--skip-build] [--json PATH]

1. build: `pip install --no-build-isolation --no-deps -e .` (nvcc must be
   found: the CUDA kernels are part of what is checked), timed.
2. tests: tests/test_cuda.py (kernels against torch/CPU references, NCCL) and
   tests/test_cuda_wrapper.py (the FSDP wrapper on the GPU against torch).
3. model: a ~1B-parameter GPT (benchmarks/models.py: d_model 2048, 18
   layers, vocab 32000, sequence 1024, batch 4) in bf16 at world size 1,
   AdamW(fused=True), step time (median of timed steps, forward + backward +
   optimizer) and peak allocated memory for: the unwrapped model, torch
   FSDP2 (fully_shard), torch FSDP1, and flatshard (FSDP and fully_shard);
   last, what parameter offload costs and saves: flatshard FSDP with
   CPUOffload (fp32 shards, gradients and AdamW on the host, bf16 compute).
   Each in its own process, so peaks and failures stay separate; a variant
   that refuses CUDA modules is listed with its error.
4. optimizer: flatshard's CUDA fused AdamW vs torch's fused AdamW over 2^30
   fp32 parameters, as a fraction of the measured device-copy bandwidth
   (28 bytes per parameter: read param, grad, two moments; write three).
"""
import argparse
import json
import os
import subprocess
import sys
import time
from harness import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BUDGET_S = float(os.environ.get("FLATSHARD_GPU_CHECK_BUDGET_S", "420"))
START = time.monotonic()


def left():
    return BUDGET_S - (time.monotonic() - START)


def run(cmd, timeout, env=None):
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                           timeout=max(5.0, min(timeout, left())), env=env)
        return p.returncode, p.stdout + p.stderr, time.monotonic() - t0
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
            else (e.stdout or "")
        return 124, out + "\n[timed out]", time.monotonic() - t0


# ---------------------------------------------------------------------------
# model variants (run in a child process: `--variant NAME`)

def variant_main(name, steps, warmup, tiny=False, profile=False):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    sys.path.insert(0, HERE)
    from models import GPT, Block

    torch.manual_seed(0)
    # --tiny: the same code on CPU with a small model, to check the script itself
    dev = torch.device("cpu") if tiny else torch.device("cuda", 0)
    if not tiny:
        torch.cuda.set_device(dev)
    vocab, seq, batch = (512, 64, 2) if tiny else (32000, 1024, 4)
    with torch.device(dev):
        model = GPT(vocab=vocab, seq=seq, d_model=64 if tiny else 2048, n_heads=4 if tiny else 16,
                    n_layers=2 if tiny else 18)
    offload = name == "flatshard FSDP + CPUOffload"
    if not offload:  # that one keeps fp32 masters on the host and computes in bf16
        model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    if name != "unwrapped":
        dist.init_process_group("gloo" if tiny else "nccl",
                                init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1, **({} if tiny else {"device_id": dev}))
    if name == "torch FSDP2":
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    elif name == "torch FSDP1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                         device_id=None if tiny else dev, use_orig_params=True)
    elif name == "flatshard FSDP":
        import flatshard
        model = flatshard.FSDP(model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                               device_id=dev)
    elif offload:
        import flatshard
        model = flatshard.FSDP(
            model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}), device_id=dev,
            cpu_offload=flatshard.CPUOffload(offload_params=True),
            mixed_precision=flatshard.MixedPrecision(param_dtype=torch.bfloat16,
                                                     reduce_dtype=torch.bfloat16,
                                                     buffer_dtype=torch.bfloat16))
    elif name == "flatshard fully_shard":
        import flatshard
        for b in model.blocks:
            flatshard.fully_shard(b)
        flatshard.fully_shard(model)
    def make_opt(kind):
        return torch.optim.AdamW(model.parameters(), lr=1e-4, **{kind: True})

    if offload:  # the fp32 shards are on the host: flatshard's C AdamW, every core
        import flatshard.optim
        opt, fused = flatshard.optim.AdamW(model.parameters(), lr=1e-4,
                                           threads=os.cpu_count()), "flatshard C (host)"
    else:
        opt, fused = make_opt("fused"), "fused"
    gen = torch.Generator(device=dev).manual_seed(1)
    idx = torch.randint(0, vocab, (batch, seq), device=dev, generator=gen)
    tgt = torch.randint(0, vocab, (batch, seq), device=dev, generator=gen)
    if not tiny:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(idx).float().view(-1, vocab), tgt.view(-1))
        loss.backward()
        try:
            opt.step()
        except (RuntimeError, TypeError):  # a parameter type the fused kernel refuses
            if i or fused != "fused":
                raise
            opt, fused = make_opt("foreach"), "foreach"
            opt.step()
        opt.zero_grad(set_to_none=True)
        if not tiny:  # the host waits for the step's last kernel
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    peak = 0.0 if tiny else torch.cuda.max_memory_allocated() / 2**30
    if profile:
        profile_steps(model, opt, idx, tgt, vocab, tiny)
    print("RESULT " + json.dumps({
        "variant": name, "params": n_params, "step_ms": times[len(times) // 2],
        "peak_gib": peak, "optimizer": fused,
        "loss": float(loss)}))
    if dist.is_initialized():
        dist.destroy_process_group()


def profile_steps(model, opt, idx, tgt, vocab, tiny):
    """Two steps under torch.profiler: where a step's time goes (device
    kernels summed against the wall time, so a step bound by the host's
    launches shows), the launch count, and the top operators."""
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([] if tiny else [ProfilerActivity.CUDA])
    steps = 2
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            loss = F.cross_entropy(model(idx).float().view(-1, vocab), tgt.view(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if not tiny:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3 / steps
    ev = prof.events()
    kernels = [e for e in ev if getattr(e, "device_type", None) is not None
               and str(e.device_type).endswith("CUDA")]
    dev_ms = sum(e.device_time for e in kernels) / 1e3 / steps if kernels else 0.0
    launches = sum(1 for e in ev if e.name in ("cudaLaunchKernel", "cudaLaunchKernelExC",
                                              "cuLaunchKernel", "cuLaunchKernelEx")) / steps
    print("PROFILE " + json.dumps({"wall_ms": wall, "device_kernel_ms": dev_ms,
                                   "launches_per_step": launches,
                                   "device_events_per_step": len(kernels) / steps}))
    key = "self_cpu_time_total" if tiny else "self_device_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=48))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14,
                                    max_name_column_width=48))


# ---------------------------------------------------------------------------
# fused AdamW over 2^30 parameters (child process: `--adamw`)

def adamw_main(log2n, reps):
    import torch
    sys.path.insert(0, os.path.join(ROOT, "python"))
    from flatshard.runtime import cuda as fcuda

    n = 1 << log2n
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)

    def median_ms(fn):
        fn()
        ts = []
        for _ in range(reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b))
        ts.sort()
        return ts[len(ts) // 2]

    src = torch.ones(n, device=dev)
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    copy_gbs = 2 * 4 * n / copy_ms / 1e6
    del src, dst
    p = torch.randn(n, device=dev)
    g = torch.randn(n, device=dev) * 1e-3
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    step = [0]

    def ours():
        step[0] += 1
        fcuda.adam_step_(p, g, m, v, step[0], lr=1e-4, weight_decay=0.01)

    ours_ms = median_ms(ours)
    del m, v
    tp = torch.nn.Parameter(p)
    tp.grad = g
    opt = torch.optim.AdamW([tp], lr=1e-4, weight_decay=0.01, fused=True)
    torch_ms = median_ms(opt.step)
    res = {"n": n, "copy_ms": copy_ms, "copy_gbs": copy_gbs}
    for k, ms in (("flatshard", ours_ms), ("torch", torch_ms)):
        gbs = 28 * n / ms / 1e6
        res[k] = {"ms": ms, "gbs": gbs, "fraction": gbs / copy_gbs}
    print("RESULT " + json.dumps(res))


# ---------------------------------------------------------------------------
# driver

def save_log(args, name, text):
    """Each phase's whole output beside the JSON report (the table keeps tails)."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(args.json)), name), "a") as f:
            f.write(text + "\n")
    except OSError:
        pass


def result_of(out):
    for line in reversed(out.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return None


def last_error(out):
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (errs[-1] if errs else (lines[-1] if lines else "no output"))[:160]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-build", action="store_true")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"),
                                                   "gpu_check.json"))
    ap.add_argument("--variant")
    ap.add_argument("--adamw", action="store_true")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--log2n", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="check the script on CPU (no GPU)")
    ap.add_argument("--profile", default="",
                    help="comma-separated variants to profile after the table "
                         "(torch.profiler: device time against wall time, top operators)")
    args = ap.parse_args()
    if args.variant:
        return variant_main(args.variant, args.steps, warmup=3, tiny=args.tiny,
                            profile=args.profile == "this")
    if args.adamw:
        return adamw_main(args.log2n, reps=10)

    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    report = {"phases": {}}
    py = sys.executable
    if not args.skip_build:
        rc, out, secs = run([py, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                             "--no-index", "-e", "."], 240)
        if rc:  # no pip, or no permission: build in place, import from the tree
            print(out[-3000:])
            rc, out2, secs2 = run([py, "setup.py", "build_ext", "--inplace"], 240)
            out, secs = out + out2, secs + secs2
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [os.path.join(ROOT, "python")] + os.environ.get("PYTHONPATH", "").split(os.pathsep))
        save_log(args, "build.log", out)
        report["phases"]["build"] = {"rc": rc, "s": round(secs, 1),
                                     "tail": "" if rc == 0 else out[-1500:]}
        print(f"build: rc={rc} in {secs:.1f}s", flush=True)
        if rc:
            print(out[-3000:])
    rc, out, secs = run([py, "-c", "import sys, torch, flatshard, flatshard._C_cuda; "
                         "print('python', sys.version.split()[0], 'torch', torch.__version__, "
                         "'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"], 60)
    report["phases"]["import"] = {"rc": rc, "s": round(secs, 1), "summary": out.strip()[-300:]}
    print(out, flush=True)
    rc, out, secs = run([py, "-m", "flatshard", "doctor"], 60)
    report["doctor"] = out.strip()
    print(out, flush=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    rc, out, secs = run([py, "-m", "pytest", "-q", "-rs", "tests/test_cuda.py",
                         "tests/test_cuda_wrapper.py"], 200, env)
    save_log(args, "tests.log", out)
    summary = [ln for ln in out.splitlines() if " passed" in ln or " failed" in ln
               or " error" in ln]
    report["phases"]["tests"] = {"rc": rc, "s": round(secs, 1),
                                 "summary": summary[-1] if summary else last_error(out)}
    print(out[-6000:] if rc else "\n".join(out.splitlines()[-4:]), flush=True)

    rows = []
    for name in ("unwrapped", "torch FSDP2", "torch FSDP1", "flatshard FSDP",
                 "flatshard fully_shard", "flatshard FSDP + CPUOffload"):
        if left() < 45:
            rows.append({"variant": name, "error": "skipped: time budget"})
            continue
        rc, out, secs = run([py, __file__, "--variant", name, "--steps", str(args.steps)]
                            + (["--tiny"] if args.tiny else []), 120)
        res = result_of(out)
        save_log(args, "variants.log", f"== {name} (rc {rc})\n{out}")
        rows.append(res if res else {"variant": name, "error": last_error(out)})
        print(f"{name}: {rows[-1]} ({secs:.0f}s)", flush=True)
    report["model"] = rows

    adam = None
    if args.tiny:
        adam = {"error": "--tiny: no GPU, not measured"}
    elif left() > 40:
        rc, out, secs = run([py, __file__, "--adamw", "--log2n", str(args.log2n)], 150)
        adam = result_of(out)
        if adam is None:
            adam = {"error": last_error(out)}
        print(f"adamw: {adam} ({secs:.0f}s)", flush=True)
    report["adamw"] = adam
    profiles = {}
    for name in [v.strip() for v in args.profile.split(",") if v.strip()]:
        if left() < 40:
            break
        rc, out, secs = run([py, __file__, "--variant", name, "--steps", "3", "--profile", "this"]
                            + (["--tiny"] if args.tiny else []), 90)
        save_log(args, "profile.log", f"== {name} (rc {rc})\n{out}")
        prof = [ln for ln in out.splitlines() if ln.startswith("PROFILE ")]
        profiles[name] = json.loads(prof[-1][8:]) if prof else {"error": last_error(out)}
        print(f"profile {name}: {profiles[name]} ({secs:.0f}s)", flush=True)
    report["profile"] = profiles
    try:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    except OSError as e:
        print(f"could not write {args.json}: {e}")

    # the table, last
    print("\n== flatshard GPU check ==")
    for k, ph in report["phases"].items():
        print(f"{k}: rc={ph['rc']} in {ph['s']} s {ph.get('summary', '')}")
    base = next((r for r in rows if r.get("variant") == "unwrapped" and "step_ms" in r), None)
    fsdp2 = next((r for r in rows if r.get("variant") == "torch FSDP2" and "step_ms" in r), None)
    print("\n| variant (~1B GPT, bf16, world 1) | step ms | vs unwrapped | vs FSDP2 | "
          "peak GiB | optimizer |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "step_ms" not in r:
            print(f"| {r['variant']} | - | - | - | - | {r['error']} |")
            continue
        rel = f"{r['step_ms'] / base['step_ms']:.3f}" if base else "-"
        rel2 = f"{r['step_ms'] / fsdp2['step_ms']:.3f}" if fsdp2 else "-"
        print(f"| {r['variant']} ({r['params'] / 1e9:.2f}B) | {r['step_ms']:.1f} | {rel} | "
              f"{rel2} | {r['peak_gib']:.2f} | AdamW {r['optimizer']} |")
    if adam and "copy_gbs" in adam:
        print(f"\n| AdamW over 2^{args.log2n} fp32 params | ms | GB/s | / copy "
              f"({adam['copy_gbs']:.0f} GB/s) |")
        print("|---|---|---|---|")
        for k in ("flatshard", "torch"):
            a = adam[k]
            print(f"| {k} fused | {a['ms']:.2f} | {a['gbs']:.0f} | {a['fraction']:.2f} |")
    elif adam:
        print(f"\nAdamW: {adam.get('error')}")
    for name, pr in profiles.items():
        print(f"profile {name}: {pr}")
    print(f"\ntotal {time.monotonic() - START:.0f} s")


if __name__ == "__main__":
    main()
