"""Adam and AdamW as torch.optim.Optimizer subclasses, fused in C: a param
group's host parameters in one call (_C.adam_steps), device parameters one
fused kernel each, moments on disk with offload=DiskOffload(path)."""
import torch

from .. import _C
from ..errors import bad_type, bad_value
from ..runtime import cuda
from ..tensors import PLAIN_TYPES
from . import disk_offload, tune_cache
from .checks import (DTensor, _call_closure, _check_pair, _check_range, _check_tensor,
                     _host_f32, _locals, _state_local, _threads, _zeros_state)
from .functional import adamw_step_


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
        self._overlap = None  # the OffloadPipeline that steps it (offload_pipeline.py)
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
        if self._overlap is not None:  # the pipelined steps write the state
            self._overlap.wait()
        sd = super().state_dict()
        if self.offload is not None:
            sd["disk_offload"] = self._disk_state().pin()
        return sd

    def load_state_dict(self, state_dict):
        if self._overlap is not None:
            self._overlap.wait()
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
        if self._overlap is not None:  # overlapped with backward (offload_pipeline.py)
            return self._overlap.step(closure)
        loss = _call_closure(closure)
        if self.offload is not None:
            self._disk_step()
            return loss
        name = type(self).__name__
        tune_cache.use()
        for gi, group in enumerate(self.param_groups):
            amsgrad = group["amsgrad"]
            jobs = []  # the group's host parameters, stepped in one engine call
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                job = _plain_host_job(p, g, state) if state and not amsgrad else None
                if job is not None:  # every step's case, checked in one pass
                    jobs.append(job)
                    continue
                x, g = _locals(name, gi, i, p, g)
                if not state:
                    _check_pair(name, gi, i, x, g)
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
                job = _host_job(x, g, m, v, mx, state.get("step"), amsgrad)
                if job is not None:
                    jobs.append(job)
                else:  # on a device, or something to refuse by name
                    _check_pair(name, gi, i, x, g)
                    self._step_one(x, g, m, v, mx, state, group)
            if jobs:
                b1, b2 = group["betas"]
                _C.adam_steps(jobs, lr=group["lr"], beta1=b1, beta2=b2, eps=group["eps"],
                              weight_decay=group["weight_decay"], decoupled=self._decoupled,
                              maximize=group["maximize"], threads=self.threads)
        return loss

    def zero_grad(self, set_to_none=True):
        if self._overlap is not None:  # in place: the pipelined steps still read them
            self._overlap.before_zero_grad(set_to_none)
        super().zero_grad(set_to_none)

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


def _plain_host_job(p, g, state):
    """_host_job's tuple for a plain host parameter whose state exists (no
    amsgrad), or None for anything else, which the general path then takes
    (and names where it is wrong): no DTensor unwrapping on the way."""
    if type(p) not in PLAIN_TYPES:  # a DTensor: its local tensors, on the general path
        return None
    return _host_job(p, g, state.get("exp_avg"), state.get("exp_avg_sq"), None,
                     state.get("step"), False)


def _host_job(p, g, m, v, mx, st, amsgrad):
    """A host parameter's update as _C.adam_steps takes it: (param, grad,
    exp_avg, exp_avg_sq, max_exp_avg_sq, step, n) pointers and size; None
    unless the parameter, its gradient and state are what that call needs
    (contiguous fp32 host tensors of its size; the step count a float32
    host scalar, as torch keeps it). The C side increments the count."""
    n = p.numel()
    if not (_host_f32(p, n) and _host_f32(g, n) and _host_f32(m, n) and _host_f32(v, n) and
            _host_f32(st, 1)) or (amsgrad and not _host_f32(mx, n)):
        return None
    return (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(),
            mx.data_ptr() if amsgrad else 0, st.data_ptr(), n)


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
