"""SGD as a torch.optim.Optimizer subclass, fused in C: a param group's host
parameters in one call (_C.sgd_steps), device parameters one kernel each."""
import torch

from .. import _C
from ..errors import bad_type, bad_value
from ..runtime import cuda
from ..tensors import PLAIN_TYPES
from . import tune_cache
from .checks import (_call_closure, _check_pair, _check_range, _describe, _host_f32, _locals,
                     _state_local, _threads, _zeros_state)


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
        tune_cache.use()
        for gi, group in enumerate(self.param_groups):
            jobs = []  # the group's host parameters, stepped in one engine call
            momentum = group["momentum"] != 0
            for i, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                job = _plain_host_job(p, g, self.state, momentum)
                if job is not None:  # every step's case, checked in one pass
                    jobs.append(job)
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


def _plain_host_job(p, g, states, momentum):
    """The (param, grad, momentum_buffer, first, n) job of a plain host
    parameter past its first step with momentum (its buffer made), or
    without momentum; None for anything else, which the general path then
    takes (and names where it is wrong)."""
    if type(p) not in PLAIN_TYPES:  # a DTensor: its local tensors, on the general path
        return None
    buf = None
    if momentum:
        state = states.get(p)
        buf = state.get("momentum_buffer") if state else None
        if buf is None:
            return None
    n = p.numel()
    if not (_host_f32(p, n) and _host_f32(g, n) and (not momentum or _host_f32(buf, n))):
        return None
    return (p.data_ptr(), g.data_ptr(), buf.data_ptr() if momentum else 0, False, n)
