"""Fused CPU optimizers: AdamW, Adam and SGD as torch.optim.Optimizer subclasses.

Same arguments, state names and state_dict format as torch's, so a torch
script swaps the class and keeps its checkpoints. Each step is one pass of C
(csrc/optim/optim_cpu.c) per parameter, split over up to `threads` threads
with the GIL released; on flatshard's flat shards one call updates a whole
shard. Adam, AdamW and SGD hand a param group's host parameters to C in one
call (_C.adam_steps, which also counts their steps; _C.sgd_steps), so a model
of many small tensors pays a tuple of pointers per parameter, not a Python
call into C each. How the loop runs (SIMD width, unrolling, prefetch, copy
stores, thread split) is measured per size class in each process
(csrc/optim/optim_tune.c, tune_report()).
Parameters and gradients must be contiguous fp32 tensors, on the CPU or on a
CUDA device, where each step is one fused kernel per parameter
(csrc/cuda/optim.cu, through runtime/cuda.py) enqueued on the current stream;
anything else is refused with an error naming the parameter.

`adamw_step_` is the functional form, which can also write a bf16/fp16 copy
of the updated parameters in the same pass.

AdamW/Adam(offload=DiskOffload(path)) keep their moments on a local disk and
stream them through the update in chunks (disk_offload.py).

The package: the optimizers (here) and their disk offload (disk_offload.py).
Imports: the leaves, runtime/cuda.py and state/safe_load.py (the check of
state file names); nothing of fsdp/, fsdp2/, plan/ or memory.py: an
optimizer works on any parameters, sharded or not.
"""
import torch

from .. import _C
from ..errors import bad_type, bad_value
from ..runtime import cuda
from ..tensors import check_plain, dtype_code, is_dense
from . import disk_offload
from .disk_offload import DiskOffload

try:  # fully_shard's parameters (and tensor-parallel ones) are DTensors
    from torch.distributed.tensor import DTensor
except ImportError:  # a build of torch without distributed
    DTensor = None

__all__ = ["AdamW", "Adam", "SGD", "DiskOffload", "tune_report"]


# [Note: state in huge pages] A step streams every byte of the optimizer
# state through the core once; on the host that runs at memory speed only if
# the hardware prefetcher keeps ahead, and it stops at every page boundary:
# 512 of them per 2 MiB with small pages, one with a huge page. So host state
# of 2 MiB and more gets a zero-filled mapping of its own, in huge pages
# where the system has transparent huge pages at all (_C.mapped_storage),
# unmapped when the tensor goes. Measured on AMD EPYC (Zen 4), AdamW over
# 2^24 and 2^26 fp32 parameters, the two placements interleaved in one
# process: 2-3% faster a step on average, within the noise of any one run
# (benchmarks/RESULTS.md). Smaller state, and state on a device, comes from
# torch as before.
_MAPPED_MIN_BYTES = 2 << 20


def _zeros_like(p):
    """Zeros shaped like parameter p, for its optimizer state."""
    nbytes = p.numel() * p.element_size()
    if p.device.type != "cpu" or nbytes < _MAPPED_MIN_BYTES or not p.is_contiguous():
        return torch.zeros_like(p, memory_format=torch.preserve_format)
    storage = _C.mapped_storage(nbytes)
    return torch.empty(0, dtype=p.dtype).set_(storage, 0, p.shape, p.stride())


# [Note: DTensor parameters] fully_shard's parameters are DTensors, each rank
# holding its shard as the DTensor's local tensor. Every update here is
# elementwise, so each rank steps its own local tensors, exactly as a step of
# the whole parameter would, provided the gradient and the state are laid out
# as the parameter is (mesh, placements, global shape): a Partial gradient (not
# reduced yet) or state of another layout is refused by name. The state is
# made as DTensors of the parameter's layout, as torch's optimizers make it,
# so torch.distributed.checkpoint saves and loads it.

def _locals(owner, gi, i, p, g):
    """(the tensor the kernel steps, its gradient's): the parameter itself, or
    a DTensor parameter's local tensors ([Note: DTensor parameters])."""
    if DTensor is None or not isinstance(p, DTensor):
        return p, g
    if not (isinstance(g, DTensor) and _same_layout(g, p)):
        raise bad_value(f"{owner}: group {gi} gradient {i}", _describe(g),
                        f"a DTensor laid out as its parameter ({p.placements} of shape "
                        f"{tuple(p.shape)}): a Partial gradient is reduced first")
    return p._local_tensor, g._local_tensor


def _same_layout(t, p):
    return t.shape == p.shape and t.placements == p.placements and \
        t.device_mesh == p.device_mesh


def _state_local(t, p):
    """A state tensor as the kernel takes it: a DTensor state of a DTensor
    parameter's layout is its local tensor; anything else (a plain tensor
    for a DTensor parameter, a state of another layout) comes back as it is,
    for the checks to refuse by name."""
    if DTensor is not None and isinstance(t, DTensor) and isinstance(p, DTensor) and \
            _same_layout(t, p):
        return t._local_tensor
    return t


def _zeros_state(p, local):
    """Zero state for parameter p whose kernel tensor is `local`."""
    z = _zeros_like(local)
    if local is p:
        return z
    return DTensor.from_local(z, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _threads(threads):
    if threads is None:
        return torch.get_num_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise bad_value("threads", threads, "expected a positive int or None (torch's count)")
    return threads


_CPU, _CPU_CUDA = ("cpu",), ("cpu", "cuda")


def _check_tensor(owner, what, i, t, cuda_ok=False):
    devices = _CPU_CUDA if cuda_ok else _CPU
    if is_dense(t, torch.float32, devices):
        return
    if torch.is_tensor(t):
        check_plain(t, f"{what} {i}", owner)
    if not torch.is_tensor(t) or t.dtype != torch.float32 or t.device.type not in devices \
            or not t.is_contiguous() or t.is_sparse:
        raise bad_type(f"{owner}: {what} {i}", _describe(t),
                       f"a contiguous float32 {' or '.join(d.upper() for d in devices)} tensor "
                       "(dense gradients)")


def _check_pair(owner, gi, i, p, g):
    """A parameter and its gradient g: fp32, contiguous, on one device (CPU
    or CUDA)."""
    if is_dense(p, torch.float32, _CPU) and is_dense(g, torch.float32, _CPU):
        return  # every step's case (on the host), checked without building a message
    _check_tensor(owner, f"group {gi} parameter", i, p, cuda_ok=True)
    _check_tensor(owner, f"group {gi} gradient", i, g, cuda_ok=True)
    if g.device != p.device:
        raise bad_value(f"{owner}: group {gi} gradient {i}", str(g.device),
                        f"expected it on the parameter's device, {p.device}")
    if p.is_cuda and not cuda.built():
        raise bad_type(f"{owner}: group {gi} parameter {i}", str(p.device),
                       "a CPU tensor: flatshard was built without nvcc (no CUDA kernels)")


def _check_range(owner, name, value, lo=0.0, hi=None, hi_open=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= lo and \
        (hi is None or (value < hi if hi_open else value <= hi))
    if not ok:
        bound = f"in [{lo}, {hi})" if hi_open else (f">= {lo}" if hi is None else
                                                     f"in [{lo}, {hi}]")
        raise bad_value(f"{owner}({name}=...)", value, f"expected a number {bound}")


def _call_closure(closure):
    """torch's contract: the closure re-evaluates the loss with autograd on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


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
    this process (tune_report()). variant: a variant name that forces one
    instead (for tests and measurements); every variant gives the same bits."""
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
    _C.adam_step(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                 max_exp_avg_sq.data_ptr() if max_exp_avg_sq is not None else 0, copy_ptr,
                 copy_code, n, lr=lr, beta1=betas[0], beta2=betas[1], eps=eps,
                 weight_decay=weight_decay, step=int(step), decoupled=decoupled,
                 maximize=maximize, threads=_threads(threads), simd=simd, variant=variant)


def tune_report():
    """What this process measured to choose its loop variants: one dict per
    size class (kind, size_log2, copy, amsgrad, threads_max, simd_max), with
    the variant chosen, how it was timed, and every candidate's best time in
    ns per element. The first step of each class calibrates it, its next
    steps race its thread splits and the default loop, and it is listed once
    those are done."""
    return _C.optim_tune_records()


def describe_tuning(records=None):
    """tune_report() as text lines: per class, the choice, then each stage's
    candidates, fastest first (what `python -m flatshard doctor` prints)."""
    lines = []
    for r in tune_report() if records is None else records:
        what = ("AdamW/Adam" if r["kind"] == "adam" else "SGD") + \
            (" + amsgrad" if r["amsgrad"] else "") + \
            ("" if r["copy"] == "none" else f" + {r['copy']} copy")
        lines.append(f"{what}, 2^{r['size_log2']} elements ({r['tuned_numel']:,} timed on "
                     f"{r['timed_on']}), up to {r['threads_max']} threads, {r['simd_max']}: "
                     f"chosen {r['chosen']}" + ("" if r["tuned"] else " (default: no memory "
                                                 "to time the candidates)"))
        for stage in dict.fromkeys(c["stage"] for c in r["candidates"]):
            cands = sorted((c for c in r["candidates"] if c["stage"] == stage),
                           key=lambda c: c["ns_per_elem"])
            lines.append(f"  {stage:>11}: " + ", ".join(
                f"{c['variant']} {c['ns_per_elem']:.3f}" for c in cands) + " ns/element")
    return lines


class _Adam(torch.optim.Optimizer):
    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, maximize=False, threads=None, offload=None):
        name = type(self).__name__
        if torch.is_tensor(lr):
            raise bad_type(f"{name}(lr=...)", lr, "a float (tensor learning rates are not "
                           "supported by the fused CPU kernel)")
        _check_range(name, "lr", lr)
        _check_range(name, "eps", eps)
        _check_range(name, "weight_decay", weight_decay)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise bad_type(f"{name}(betas=...)", betas, "a pair (beta1, beta2)")
        for b in betas:
            _check_range(name, "betas", b, 0.0, 1.0, hi_open=True)
        for flag, value in (("amsgrad", amsgrad), ("maximize", maximize)):
            if not isinstance(value, bool):
                raise bad_type(f"{name}({flag}=...)", value, "True or False")
        self.threads = _threads(threads)
        self.offload = disk_offload.check(name, offload, amsgrad)
        self._disk = None  # DiskState, made at the first use (the groups are final then)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=None, capturable=False,
                        differentiable=False, fused=None)
        super().__init__(params, defaults)

    # -- disk offload (disk_offload.py) ------------------------------------

    def _all_params(self):
        return [p for group in self.param_groups for p in group["params"]]

    def _disk_state(self):
        numels = [p.numel() for p in self._all_params()]
        if self._disk is None:
            self._disk = disk_offload.DiskState(self.offload, numels)
        elif numels != self._disk.numels:
            raise bad_value(f"{type(self).__name__}(offload=...)", "add_param_group",
                            "the parameters changed after the state files were laid out",
                            "give the optimizer all its parameter groups when building it")
        return self._disk

    @torch.no_grad()
    def _disk_step(self):
        disk, name, index, calls = self._disk_state(), type(self).__name__, 0, []
        for gi, group in enumerate(self.param_groups):
            if group["amsgrad"]:
                disk_offload.check(name, self.offload, True)
            segments = []
            for i, p in enumerate(group["params"]):
                if DTensor is not None and isinstance(p, DTensor):
                    raise bad_type(f"{name}(offload=DiskOffload(...)): group {gi} parameter {i}",
                                   "a DTensor", "plain tensors: the disk offload steps whole "
                                   "parameters; keep the state in memory (offload=None) for "
                                   "fully_shard's DTensor parameters")
                off = disk.offsets[index]
                index += 1
                if p.grad is None:  # moments copied through, untouched (torch: no update)
                    segments.append((p.data_ptr(), 0, p.numel(), off, 0))
                    continue
                _check_tensor(name, f"group {gi} parameter", i, p)
                _check_tensor(name, f"group {gi} gradient", i, p.grad)
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                state["step"] += 1
                segments.append((p.data_ptr(), p.grad.data_ptr(), p.numel(), off,
                                 int(state["step"].item())))
            b1, b2 = group["betas"]
            calls.append((segments, dict(lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                                         weight_decay=group["weight_decay"],
                                         decoupled=self._decoupled, maximize=group["maximize"],
                                         threads=self.threads)))
        disk.step(calls)

    def offloaded_state(self, param):
        """{"exp_avg", "exp_avg_sq"} of `param`, read back from the disk
        (with offload=DiskOffload; for checks and conversions)."""
        if self.offload is None:
            raise bad_value("offloaded_state", "offload=None", "this optimizer keeps its "
                            "state in memory", "read optimizer.state[param]")
        ids = [id(p) for p in self._all_params()]
        if id(param) not in ids:
            raise bad_value("offloaded_state", f"<tensor {tuple(param.shape)}>",
                            "it is not a parameter of this optimizer")
        m, v = self._disk_state().read(ids.index(id(param)))
        return {"exp_avg": m.view_as(param), "exp_avg_sq": v.view_as(param)}

    def state_dict(self):
        sd = super().state_dict()
        if self.offload is not None:
            sd["disk_offload"] = self._disk_state().pin()
        return sd

    def load_state_dict(self, state_dict):
        if self.offload is None:
            return super().load_state_dict(state_dict)
        rest = {k: v for k, v in state_dict.items() if k != "disk_offload"}
        disk = self._disk_state()
        disk.adopt(state_dict.get("disk_offload"))
        super().load_state_dict(rest)

    @torch.no_grad()
    def step(self, closure=None):
        """One fused update of every parameter with a gradient; `closure`
        (optional) re-evaluates the model and returns the loss, as in torch."""
        loss = _call_closure(closure)
        if self.offload is not None:
            self._disk_step()
            return loss
        name = type(self).__name__
        for gi, group in enumerate(self.param_groups):
            amsgrad = group["amsgrad"]
            jobs = []  # the group's host parameters, stepped in one engine call
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                x, g = _locals(name, gi, i, p, g)
                _check_pair(name, gi, i, x, g)
                state = self.state[p]
                if not state:
                    # torch's layout: a float32 scalar step (on the host, so that
                    # reading it never waits for a device) and moments like the param.
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = _zeros_state(p, x)
                    state["exp_avg_sq"] = _zeros_state(p, x)
                    if amsgrad:
                        state["max_exp_avg_sq"] = _zeros_state(p, x)
                m = _state_local(state.get("exp_avg"), p)
                v = _state_local(state.get("exp_avg_sq"), p)
                mx = _state_local(state.get("max_exp_avg_sq"), p) if amsgrad else None
                job = None if x.is_cuda else _host_job(x, g, m, v, mx, state.get("step"), amsgrad)
                if job is not None:
                    jobs.append(job)
                else:
                    self._step_one(x, g, m, v, mx, state, group)
            if jobs:
                b1, b2 = group["betas"]
                _C.adam_steps(jobs, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                              weight_decay=group["weight_decay"], decoupled=self._decoupled,
                              maximize=group["maximize"], threads=self.threads)
        return loss

    def _step_one(self, x, g, m, v, mx, state, group):
        """One parameter on its own (x, g, m, v, mx: the tensors the kernel
        steps): on a device, or with state that is not the plain host layout
        (whose checks then name what is wrong)."""
        state["step"] += 1
        step_fn, extra = (cuda.adam_step_, {}) if x.is_cuda else \
            (adamw_step_, dict(threads=self.threads))
        step_fn(x, g, m, v, int(state["step"].item()), lr=group["lr"], betas=group["betas"],
                eps=group["eps"], weight_decay=group["weight_decay"],
                decoupled=self._decoupled, maximize=group["maximize"],
                max_exp_avg_sq=mx, **extra)


def _host_job(p, g, m, v, mx, st, amsgrad):
    """A host parameter's update as _C.adam_steps takes it: (param, grad,
    exp_avg, exp_avg_sq, max_exp_avg_sq, step, n) pointers and size; None
    unless its gradient and state are what that call needs (contiguous fp32
    host tensors of its size; the step count a float32 host scalar, as
    torch keeps it). The C side increments the count."""
    n = p.numel()
    if g.numel() != n or not (_host_f32(m, n) and _host_f32(v, n) and _host_f32(st, 1)) or \
            (amsgrad and not _host_f32(mx, n)):
        return None
    return (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
            mx.data_ptr() if amsgrad else 0, st.data_ptr(), n)


def _host_f32(t, n):
    return is_dense(t, torch.float32, _CPU) and t.numel() == n


def _describe(t):
    if not torch.is_tensor(t):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" + \
        ("" if t.is_contiguous() else ", non-contiguous")


class AdamW(_Adam):
    """torch.optim.AdamW's math (decoupled weight decay), fused in C.

    params, lr, betas, eps, weight_decay, amsgrad, maximize: torch's
    arguments and meanings. threads: threads of one step (default: torch's
    intra-op count). offload: None (moments in memory, torch's state layout), or
    DiskOffload(path): exp_avg and exp_avg_sq live in files under path and
    stream through the update in chunks (disk_offload.py); state_dict()
    then refers to the current file and load_state_dict() adopts it."""


class Adam(_Adam):
    """torch.optim.Adam's math (L2 weight decay added to the gradient), fused in C.
    params, lr, betas, eps, weight_decay, amsgrad, maximize, threads, offload:
    as AdamW's."""
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, *, maximize=False, threads=None, offload=None):
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize,
                         threads=threads, offload=offload)


class SGD(torch.optim.Optimizer):
    """torch.optim.SGD's math (momentum, dampening, nesterov, weight decay), fused in C.
    params, lr, momentum, dampening, weight_decay, nesterov, maximize: torch's
    arguments and meanings. threads: threads of one step (default: torch's
    intra-op count)."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, maximize=False, threads=None):
        for n, v in (("lr", lr), ("momentum", momentum), ("dampening", dampening),
                     ("weight_decay", weight_decay)):
            _check_range("SGD", n, v)
        for flag, value in (("nesterov", nesterov), ("maximize", maximize)):
            if not isinstance(value, bool):
                raise bad_type(f"SGD({flag}=...)", value, "True or False")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise bad_value("SGD(nesterov=True)", nesterov, "nesterov needs momentum > 0 and "
                            "dampening == 0")
        self.threads = _threads(threads)
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                        foreach=None, differentiable=False, fused=None)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        """One fused update of every parameter with a gradient; `closure`
        (optional) re-evaluates the model and returns the loss, as in torch."""
        loss = _call_closure(closure)
        for gi, group in enumerate(self.param_groups):
            jobs = []  # the group's host parameters, stepped in one engine call
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                x, g = _locals("SGD", gi, i, p, g)
                _check_pair("SGD", gi, i, x, g)
                buf, first = None, False
                if group["momentum"] != 0:  # without momentum, no state (as torch)
                    state = self.state[p]
                    if state.get("momentum_buffer") is None:
                        state["momentum_buffer"] = _zeros_state(p, x)
                        first = True
                    buf = _state_local(state["momentum_buffer"], p)
                if x.is_cuda:
                    cuda.sgd_step_(x, g, buf, lr=group["lr"], momentum=group["momentum"],
                                   dampening=group["dampening"],
                                   weight_decay=group["weight_decay"],
                                   nesterov=group["nesterov"], maximize=group["maximize"],
                                   first_step=first)
                    continue
                n = x.numel()
                if g.numel() != n:
                    raise bad_value(f"SGD: group {gi} gradient {i}", tuple(g.shape),
                                    f"expected {n} elements, as its parameter")
                if buf is not None and not _host_f32(buf, n):  # e.g. a loaded state
                    raise bad_value(f"SGD: group {gi} momentum_buffer {i}",
                                    _describe(buf), f"a contiguous float32 CPU tensor of "
                                    f"{n} elements, as its parameter")
                jobs.append((x.data_ptr(), g.data_ptr(),
                             buf.data_ptr() if buf is not None else 0, first, n))
            if jobs:
                _C.sgd_steps(jobs, lr=group["lr"], momentum=group["momentum"],
                             dampening=group["dampening"], weight_decay=group["weight_decay"],
                             nesterov=group["nesterov"], maximize=group["maximize"],
                             threads=self.threads)
        return loss
