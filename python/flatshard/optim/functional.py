"""The functional step on flat buffers (adamw_step_) and what the run-time
tuning of the C loop measured (tune_report, describe_tuning)."""
import torch

from .. import _C
from ..errors import bad_type, bad_value
from ..tensors import dtype_code
from . import tune_cache
from .checks import _check_tensor, _threads


def adamw_step_(param, grad, exp_avg, exp_avg_sq, step, *, lr, betas=(0.9, 0.999), eps=1e-8,
                weight_decay=1e-2, decoupled=True, maximize=False, max_exp_avg_sq=None,
                out_copy=None, threads=None, simd="auto", variant=None):
    """One fused step on flat buffers (all contiguous fp32 CPU of one size).
    step: the step number after this update (1 on the first). out_copy: a
    bf16/fp16 tensor of the same size that receives the updated parameters.
    threads: the most threads the step may use (default: torch's intra-op
    count). simd: the widest instruction set it may use: 'auto' (the best this
    CPU has), 'avx512', 'avx2' or 'scalar' (the reference loop). Within those
    caps the loop variant is the one measured fastest for this size class in
    this machine (measured before the class's first step, or read from the
    cache file: tune_cache.py; tune_report()). variant: a variant name that
    forces one instead (for tests and measurements); every variant computes
    one formula with fused multiply-adds and gives the same bits."""
    n = param.numel()
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg),
                    ("exp_avg_sq", exp_avg_sq)) + ((("max_exp_avg_sq", max_exp_avg_sq),)
                                                   if max_exp_avg_sq is not None else ()):
        _check_tensor("adamw_step_", name, 0, t)
        if t.numel() != n:
            raise bad_value(f"adamw_step_: {name}", tuple(t.shape), f"expected {n} elements")
    copy_ptr, copy_code = 0, _C.BF16
    if out_copy is not None:
        if out_copy.dtype not in (torch.bfloat16, torch.float16) or out_copy.numel() != n or \
                not out_copy.is_contiguous() or out_copy.device.type != "cpu":
            raise bad_type("adamw_step_: out_copy", f"{out_copy.dtype} {tuple(out_copy.shape)}",
                           f"a contiguous bfloat16/float16 CPU tensor of {n} elements")
        copy_ptr, copy_code = out_copy.data_ptr(), dtype_code(out_copy.dtype)
    tune_cache.use()
    _C.adam_step(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                 max_exp_avg_sq.data_ptr() if max_exp_avg_sq is not None else 0, copy_ptr,
                 copy_code, n, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                 weight_decay=weight_decay, step=int(step), decoupled=decoupled,
                 maximize=maximize, threads=_threads(threads), simd=simd, variant=variant)


def tune_report():
    """The loop variants this process uses: one dict per size class (kind,
    size_log2, copy, amsgrad, threads_max, simd_max), with the variant
    chosen, its source ("measured" on scratch buffers before the class's
    first step, "steps": on the class's own first steps, live_steps of
    them, whose elements the timed runs updated, or "cache": read from the
    cache file), tune_s (seconds spent choosing; on the steps, what the
    timed runs took beyond the stage's fastest), stored (written to the
    cache file), busy (measured or stored while the machine was busy:
    provisional, measured again when it is not), and every measured
    candidate's score in ns per element with the rounds it ran. A class
    still being measured on its steps is not listed yet."""
    return _C.optim_tune_records()


def describe_tuning(records=None):
    """tune_report() as text lines: per class, the choice, then each stage's
    candidates, fastest first (what `python -m flatshard doctor` prints)."""
    lines = []
    for r in tune_report() if records is None else records:
        what = ("AdamW/Adam" if r["kind"] == "adam" else "SGD") + \
            (" + amsgrad" if r["amsgrad"] else "") + \
            ("" if r["copy"] == "none" else f" + {r['copy']} copy")
        how = ("read from the cache file" if r["source"] == "cache" else
               (f"measured on its first {r['live_steps']} step(s), which took "
                f"{r['tune_s'] * 1e3:.1f} ms longer than the winner would have"
                if r["source"] == "steps" else
                f"measured in {r['tune_s'] * 1e3:.1f} ms on scratch buffers") +
               (", stored" if r["stored"] else "") + (" (busy machine)" if r["busy"] else "") +
               (", cut short" if r.get("cut_short") else ""))
        lines.append(f"{what}, 2^{r['size_log2']} elements (first step {r['tuned_numel']:,}), "
                     f"up to {r['threads_max']} threads, {r['simd_max']}: chosen {r['chosen']}, "
                     + (how if r["tuned"] else "the default (no memory to measure on)"))
        for stage in dict.fromkeys(c["stage"] for c in r["candidates"]):
            cands = sorted((c for c in r["candidates"] if c["stage"] == stage),
                           key=lambda c: c["ns_per_elem"])
            rounds = max(c["rounds"] for c in cands)
            lines.append(f"  {stage:>11} ({rounds} rounds): " + ", ".join(
                f"{c['variant']} {c['ns_per_elem']:.3f}"
                + (f" ({c['rounds']})" if c["rounds"] < rounds else "") for c in cands)
                + " ns/element")
    return lines
