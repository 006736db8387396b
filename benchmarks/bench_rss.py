"""Resident memory (RSS) per rank of GPT-2 small training on CPU: flatshard
FULL_SHARD against the same model unwrapped and under torch FSDP1.

    OMP_NUM_THREADS=1 python benchmarks/bench_rss.py [--world 2] [--steps 3]
        [--modes unwrapped,torch_fsdp,flatshard] [--plan-worlds 2,4] [--phases]

GPT2Config() defaults (124M parameters, 12 GPT2Block units, fp32), built
locally, never downloaded; sequence 128, batch 2 per rank, torch's fused
AdamW, gloo. Each mode runs in its own processes, one after the other, so
each rank's peak (getrusage ru_maxrss) is its own. flatshard's model is built
on the meta device and materialized unit by unit (param_init_fn).

Per mode and rank: the peak RSS over the run, the RSS between steps (after
optimizer.step, gradients still held), the median step time (wall, and the
process's CPU time, steadier on a shared machine); for flatshard also the
planner's peak-RSS prediction (flatshard.plan: the runtime measured by
measure_runtime() before the model is built, activations measured in the
first forward) against the measured peak. --plan-worlds re-runs flatshard
on those world sizes for the planner check alone. --phases prints rank 0's
RSS, peak and C-heap use at every phase of flatshard's steps (wrap, each
unit's gather, forward and reduction, the loss, the optimizer step) and
marks where the peak rises.
"""
import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness import free_port

GIB = 2**30
SEQ, BATCH, LR = 128, 2, 1e-4


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_split():
    """(anonymous, file-backed) resident bytes: code pages of the libraries
    that running kernels faults in are file-backed."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("RssAnon", "RssFile", "RssShmem"):
                out[k] = int(v.split()[0]) * 1024
    return out.get("RssAnon", 0), out.get("RssFile", 0) + out.get("RssShmem", 0)


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _build(mode, rank):
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    cfg = GPT2Config()
    torch.manual_seed(0)
    if mode != "flatshard":
        return GPT2LMHeadModel(cfg), GPT2Block, cfg
    with torch.device("meta"):
        model = GPT2LMHeadModel(cfg)
    return model, GPT2Block, cfg


def _wrap(mode, model, block):
    if mode == "unwrapped":
        return model
    if mode == "torch_fsdp":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return TorchFSDP(model, auto_wrap_policy=ModuleWrapPolicy({block}),
                         sharding_strategy=ShardingStrategy.FULL_SHARD,
                         device_id=torch.device("cpu"))
    import flatshard

    def init(m):  # one module at a time, so no whole model is ever materialized
        m.to_empty(device="cpu", recurse=False)
        if m is not model.lm_head:
            model._init_weights(m)
        # the tie to_empty broke; lm_head comes before wte (breadth-first, as torch)
        model.lm_head.weight = model.transformer.wte.weight
    return flatshard.FullyShardedDataParallel(
        model, auto_wrap_policy=flatshard.ModuleWrapPolicy({block}),
        sharding_strategy=flatshard.ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"), param_init_fn=init)


class _MallInfo2(__import__("ctypes").Structure):
    _fields_ = [(n, __import__("ctypes").c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                 "uordblks", "fordblks", "keepcost")]


def heap_bytes():
    """(in use, free) bytes of the C library's heap, mapped blocks apart; None off glibc."""
    import ctypes
    try:
        f = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return None
    f.restype = _MallInfo2
    m = f()
    return m.uordblks + m.hblkhd, m.fordblks


class _Phases:
    """RSS and the process's peak at each phase of one step (rank 0)."""

    def __init__(self):
        self.rows, self.on = [], False

    def mark(self, what):
        if self.on:
            self.rows.append((what, rss_bytes(), peak_rss_bytes(), heap_bytes()))


def _trace_units(phases):
    from flatshard.fsdp.unit import UnitRuntime
    # the hook entry points, each marked after it ran (the engine's gather,
    # reshard and reduction happen inside them)
    for name, what in (("pre_forward", "gathered"), ("post_forward", "after forward"),
                       ("_gather_backward", "gathered for backward"),
                       ("_post_backward", "reduced")):
        orig = getattr(UnitRuntime, name)

        def wrapped(self, *a, _orig=orig, _what=what, **kw):
            r = _orig(self, *a, **kw)
            phases.mark(f"{_what} {self.name or '<root>'}")
            return r
        setattr(UnitRuntime, name, wrapped)


def _worker(rank, mode, world, port, steps, phases_on, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    import transformers  # noqa: F401  (the runtime baseline: Python, torch, transformers,
    import flatshard  # noqa: F401    flatshard, a process group)
    import flatshard.plan
    cold = rss_bytes()  # the imports alone
    # the runtime as the planner takes it: after two steps of a throwaway
    # model, so that what any training step pages in once counts as runtime
    # (a tree from before measure_runtime, run for comparison: the imports)
    measure = getattr(flatshard.plan, "measure_runtime", None)
    baseline = measure() if measure else cold
    split_baseline = rss_split()
    activations = None
    phases = _Phases()
    phases.on = phases_on and rank == 0
    if phases.on and mode == "flatshard":
        _trace_units(phases)
    phases.mark("runtime baseline")
    model, block, cfg = _build(mode, rank)
    phases.mark("model built")
    model = _wrap(mode, model, block)
    phases.mark("wrapped")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    after_wrap = rss_bytes()
    if phases.on and mode == "flatshard":
        for g in model._unit.groups:  # the root's whole gradient, made before it is reduced
            g.compute.register_hook(lambda grad: phases.mark("root gradient made"))
        model.lm_head.register_full_backward_pre_hook(lambda *a: phases.mark("logits grad"))
        model.lm_head.register_full_backward_hook(lambda *a: phases.mark("lm_head backward"))
        model.transformer.h[0].register_full_backward_hook(lambda *a: phases.mark("h.0 backward"))
    gen = torch.Generator().manual_seed(1 + rank)
    between, cleared, times, cpu = [], [], [], []
    for step in range(steps):
        phases.mark(f"step {step} start")
        idx = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if step == 0 and mode == "flatshard" and hasattr(flatshard.plan, "SavedActivations"):
            with flatshard.plan.SavedActivations(model) as act:
                out = model(input_ids=idx, labels=idx)
            activations = act.bytes
        else:
            out = model(input_ids=idx, labels=idx)
        phases.mark("loss")
        out.loss.backward()
        phases.mark("backward done")
        del out
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        # between steps, gradients still held (a loop that zero_grads first)
        between.append(rss_bytes())
        phases.mark("optimizer step")
        opt.zero_grad(set_to_none=True)
        cleared.append(rss_bytes())
        phases.mark("zero_grad")
    res = {"rank": rank, "baseline": baseline, "cold": cold, "after_wrap": after_wrap,
           "activations": activations, "split": (split_baseline, rss_split()),
           "peak": peak_rss_bytes(), "between": between[-1], "cleared": cleared[-1],
           "step_s": times, "cpu_s": cpu,
           "phases": phases.rows}
    if mode == "flatshard":
        shape = dict(batch_size=BATCH, seq_len=SEQ, hidden=cfg.n_embd, layers=cfg.n_layer,
                     heads=cfg.n_head, vocab=cfg.vocab_size)
        res["stats"] = flatshard.memory_stats(model, opt)
        p = flatshard.plan.predict(model, opt, runtime_bytes=baseline,
                                   activation_bytes=activations, **shape)
        est = flatshard.plan.predict(model, opt, runtime_bytes=baseline, **shape)
        # (None from a flatshard without the resident-memory prediction)
        res["plan_peak"] = getattr(p, "peak_rss", None)
        res["plan_peak_estimated"] = getattr(est, "peak_rss", None)
        res["plan_table"] = p.table(explain=False)
        res["plan_states"] = p.model_states
    queue.put(res)
    dist.barrier()
    dist.destroy_process_group()


def run(mode, world, steps, phases_on=False):
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(mode, world, free_port(), steps, phases_on, queue),
                       nprocs=world, start_method="spawn", join=True)
    return sorted((queue.get() for _ in range(world)), key=lambda r: r["rank"])


def _g(n):
    return f"{n / GIB:.2f}"


def _planner(r):
    if r.get("plan_peak") is None:
        return ""
    return (f"; planner peak {_g(r['plan_peak'])} GiB ({r['plan_peak'] / r['peak'] - 1:+.1%}; "
            f"with the activation estimate in place of the measured activations "
            f"{_g(r['plan_peak_estimated'])}, {r['plan_peak_estimated'] / r['peak'] - 1:+.1%})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", default="unwrapped,torch_fsdp,flatshard")
    ap.add_argument("--plan-worlds", default="2,4",
                    help="world sizes on which flatshard's planner is checked")
    ap.add_argument("--phases", action="store_true")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    lscpu = os.popen("lscpu | grep 'Model name'").read().split(":")[-1].strip()
    print(f"GPT-2 124M, seq {SEQ}, batch {BATCH}/rank, fused AdamW, gloo, {a.world} ranks, "
          f"{a.steps} steps; CPU: {lscpu}; torch {torch.__version__}")
    results = {}
    for mode in a.modes.split(","):
        results[mode] = run(mode, a.world, a.steps, a.phases and mode == "flatshard")
    print(f"\n{'mode':11} {'rank':>4} {'peak':>6} {'between':>8} {'cleared':>8} {'baseline':>9} "
          f"{'step s':>7} {'cpu s':>6}")
    print("(GiB RSS: peak; between steps after optimizer.step, and after zero_grad; the "
          "runtime before the model, flatshard.plan.measure_runtime(). Median step after the "
          "first: wall and process CPU s)")
    for mode, rows in results.items():
        for r in rows:
            step_s = statistics.median(r["step_s"][1:] or r["step_s"])
            cpu_s = statistics.median(r["cpu_s"][1:] or r["cpu_s"])
            print(f"{mode:11} {r['rank']:4d} {_g(r['peak']):>6} {_g(r['between']):>8} "
                  f"{_g(r['cleared']):>8} {_g(r['baseline']):>9} {step_s:7.2f} {cpu_s:6.2f}")
    fs = results.get("flatshard")
    if fs:
        r0 = fs[0]
        print("\nflatshard rank 0, memory_stats after the last step:")
        print("  " + "  ".join(f"{k}={v / 2**20:.0f}MiB" if isinstance(v, int) else f"{k}={v}"
                              for k, v in r0["stats"].items()))
        print(r0["plan_table"])
        print(f"activations measured in the first forward: {_g(r0['activations'] or 0)} GiB")
        for name in ("unwrapped", "torch_fsdp"):
            if name in results:
                print(f"peak ratio flatshard / {name}: "
                      f"{max(r['peak'] for r in fs) / max(r['peak'] for r in results[name]):.3f}")
        for r in fs:
            states = r["baseline"] + r["plan_states"]
            anon, file_ = (b - a for a, b in zip(*r["split"]))
            cold = r["cold"] + r["plan_states"]
            print(f"rank {r['rank']}: between steps {_g(r['between'])} GiB vs baseline + model "
                  f"states {_g(states)} GiB ({r['between'] / states - 1:+.1%}; against the "
                  f"imports alone, {_g(r['cold'])} GiB, {r['between'] / cold - 1:+.1%}); since "
                  f"the baseline, file-backed pages (library code run) {file_ / GIB:+.2f} GiB"
                  + _planner(r))
        if a.phases:
            print("\nrank 0: phase, RSS, peak so far, C heap in use and free (GiB)")
            last_peak = 0
            for what, rss, peak, heap in r0["phases"]:
                flag = "  <- peak rises" if peak > last_peak + 16 * 2**20 and last_peak else ""
                h = f" {_g(heap[0])} {_g(heap[1])}" if heap else ""
                print(f"  {what:28} {_g(rss)} {_g(peak)}{h}{flag}")
                last_peak = peak
    for w in [int(x) for x in a.plan_worlds.split(",") if x] if fs else []:
        if w == a.world:
            continue
        rows = run("flatshard", w, a.steps)
        for r in rows:
            print(f"{w} ranks, rank {r['rank']}: peak {_g(r['peak'])} GiB" + _planner(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
