"""Parameter offload whose optimizer step overlaps backward and the next
forward: `flatshard.overlap_offload(model, optimizer, OverlapOffload(...))`.

With parameter offload (the FSDP1 wrapper's CPUOffload(offload_params=True),
fully_shard over host parameters with CPUOffloadPolicy()) the shards, their
gradients and the AdamW state live in host memory. The sequential step waits
for the whole backward, steps every shard, and only then lets the next
forward gather. Here each unit's step is queued as soon as its reduced
gradient is in host memory (the point where its reduction lands and its
post-accumulate-grad hooks run, runtime/grad_hooks.py) and runs on the C
engine's host thread (csrc/engine/offload_pipe.c, the kernels of
csrc/optim/) while backward goes on; the unit's next gather waits in C for
that unit's step alone ([Note: step before gather] in offload_pipe.h), so
the next forward overlaps the steps of the units it reaches later. While
backward runs, at most max_units_in_flight units have steps queued or
running (each holds its gradients while backward makes the next ones): a
unit's hook waits for one to finish beyond that.

This module only hands the engine what it needs: the slots (one per FSDP1
unit or fully_shard group, in forward order), the engine groups to attach,
and each landed parameter's buffers as pointers. The queue, the bound, the
thread and the waits are the engine's.

[Note: clipping in the pipeline] Gradient clipping scales every gradient
by max_norm / total_norm, and the total norm needs every gradient of the
step, so no unit may step before the last gradient has landed. With
max_norm set, the hooks only note what landed; optimizer.step() then makes
the norm pass (the API's own clip: the wrapper's clip_grad_norm_, or
torch.nn.utils.clip_grad_norm_ over fully_shard's parameters, the very call
a sequential loop makes, so the bits are the same), and queues every unit's
step in forward order, all at once (every gradient of the step exists by
then: a bound would save nothing and only make step() wait). The steps then
overlap the next forward instead of
the backward: unit k's gather waits for unit k's step only. The total norm
is `pipeline.last_norm`. Calling the wrapper's clip yourself while the
pipeline is on is refused (it would clip after the steps, or twice).

Not detected, so not to be combined: anything else that changes the
gradients between backward and optimizer.step() (torch.nn.utils.clip_grad_norm_
called by hand on fully_shard's parameters, a GradScaler's unscale_): without
max_norm the steps have read the gradients by then. A loss scale belongs in
the loss (or the learning rate) with the pipeline on.

What stays the user's: optimizer.step() and zero_grad() in the loop as
before (step() returns once the steps are queued; zero_grad(set_to_none=
False) waits for them first, since it writes the gradients they read).
Anything else that reads the shards or the optimizer state outside a
gather (model.state_dict()/load_state_dict(), the optimizer's) waits for
every step first; so does pipeline.wait(). close() ends the pipeline and
restores the sequential step.

Imports fsdp/, fsdp2/ and optim/: it sits above them, as memory.py does.
"""
import math
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from . import _C
from .errors import bad_type, bad_value, not_built
from .fsdp.unit import fsdp_units
from .fsdp2.state import state_of
from .optim.adam import _Adam, _host_job
from .optim.checks import _call_closure, _check_pair, _locals, _state_local, _zeros_state


@dataclass(frozen=True)
class OverlapOffload:
    """Options of overlap_offload.

    max_units_in_flight  units whose steps may be queued or running at once
                         (>= 1): each holds its gradient shards until its
                         step ends, on top of the next backward's.
    max_norm             None, or clip the whole gradient's norm to this
                         (> 0) before any step ([Note: clipping in the
                         pipeline]).
    norm_type            the norm's p (> 0, or inf), as clip_grad_norm_'s.
    """
    max_units_in_flight: int = 2
    max_norm: Optional[float] = None
    norm_type: float = 2.0

    def __post_init__(self):
        m = self.max_units_in_flight
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise bad_value("OverlapOffload(max_units_in_flight=...)", m,
                            "expected an int >= 1")
        if self.max_norm is not None and (isinstance(self.max_norm, bool) or
                                          not isinstance(self.max_norm, (int, float)) or
                                          not self.max_norm > 0 or math.isinf(self.max_norm)):
            raise bad_value("OverlapOffload(max_norm=...)", self.max_norm,
                            "expected None or a finite number > 0")
        nt = self.norm_type
        if isinstance(nt, bool) or not isinstance(nt, (int, float)) or not nt > 0:
            raise bad_value("OverlapOffload(norm_type=...)", nt, "expected a number > 0 or inf")


class _Slot:
    """One unit (FSDP1) or shard group (fully_shard): its parameters as the
    optimizer sees them, and what gives its engine group (read at each use:
    a comm hook or a lazy init may make a new one)."""
    __slots__ = ("index", "params", "engine", "attached", "held")

    def __init__(self, index, params, engine):
        self.index, self.params, self.engine = index, params, engine
        self.attached = None  # the engine group attached to the pipe's slot
        self.held = []        # buffers the queued steps read, until they have run


def overlap_offload(model, optimizer, options=None):
    """Start the overlapped step for `model` (an FSDP1 wrapper root with
    CPUOffload(offload_params=True), or a root fully_shard module over host
    parameters, offload_policy=CPUOffloadPolicy()) stepped by `optimizer`
    (flatshard.optim.AdamW or Adam over exactly the model's parameters, state
    in memory). options: OverlapOffload() by default. Returns the
    OffloadPipeline; everything is checked before anything is changed."""
    options = OverlapOffload() if options is None else options
    if not isinstance(options, OverlapOffload):
        raise bad_type("options", options, "a flatshard.OverlapOffload")
    if not isinstance(optimizer, _Adam):
        raise bad_type("optimizer", optimizer, "flatshard.optim.AdamW or flatshard.optim.Adam "
                       "(the pipelined step runs their C kernel on the engine's thread)")
    if optimizer.offload is not None:
        raise not_built("optimizer", f"{type(optimizer).__name__}(offload=DiskOffload(...))",
                        "the pipelined step keeps the moments in host memory",
                        "build the optimizer with offload=None")
    if getattr(optimizer, "_overlap", None) is not None:
        raise bad_value("optimizer", type(optimizer).__name__, "it already steps a pipeline",
                        "close() that OffloadPipeline first")
    if model.__dict__.get("_offload_overlap") is not None:
        raise bad_value("model", type(model).__name__, "it already has an overlapped "
                        "offload", "close() that OffloadPipeline first")
    kind, slots = _slots(model)
    params = [p for s in slots for p in s.params]
    mine = {id(p) for p in params}
    theirs = [p for g in optimizer.param_groups for p in g["params"]]
    if {id(p) for p in theirs} != mine or len(theirs) != len(mine):
        raise bad_value("optimizer", type(optimizer).__name__, "its parameters must be exactly "
                        f"the model's sharded parameters ({len(mine)} of them; it has "
                        f"{len(theirs)})", "build it over model.parameters()")
    for gi, g in enumerate(optimizer.param_groups):
        if torch.is_tensor(g["lr"]):
            raise bad_type(f"optimizer.param_groups[{gi}]['lr']", g["lr"], "a float")
    for p in params:
        local = p._local_tensor if hasattr(p, "_local_tensor") else p
        if local.device.type != "cpu" or local.dtype != torch.float32:
            raise bad_value("model", kind, f"a parameter is {local.dtype} on {local.device}: "
                            "the pipelined step needs float32 shards in host memory",
                            _HOW[kind])
    return OffloadPipeline(model, optimizer, options, kind, slots)


_HOW = {"FSDP": "wrap with cpu_offload=CPUOffload(offload_params=True)",
        "fully_shard": "keep the parameters on the host: fully_shard(..., "
                       "offload_policy=CPUOffloadPolicy())"}


def _slots(model):
    """("FSDP" or "fully_shard", the slots in forward order: module order,
    which every rank walks alike)."""
    units = fsdp_units(model)
    if units:
        if units[0] is not model:
            raise bad_value("model", type(model).__name__, "it is not the root FSDP module",
                            "pass the outermost wrapper")
        strategy = model.sharding_strategy.name
        if strategy not in ("FULL_SHARD", "SHARD_GRAD_OP"):
            raise not_built("model", f"FSDP(sharding_strategy={strategy})", "the overlapped "
                            "step runs with FULL_SHARD and SHARD_GRAD_OP", "use one of those, "
                            "or the sequential step")
        for m in units:
            u = m._unit
            if not u.offload_params:
                raise bad_value("model", "FSDP", f"unit {u.name!r} has no parameter offload",
                                _HOW["FSDP"])
        slots = []
        for m in units:
            u = m._unit
            ps = [p for g in u.groups for p in (g.params if u.use_orig_params else (g.shard,))
                  if p.requires_grad]
            slots.append(_Slot(len(slots), ps, lambda u=u: u.c))
        return "FSDP", slots
    st = state_of(model)
    if st is None:
        raise bad_type("model", model, "an FSDP wrapper (with CPUOffload(offload_params=True))"
                       " or a fully_shard module")
    slots = []
    for m in model.modules():
        s = state_of(m)
        if s is None or s.group is None:
            continue
        g = s.group
        ps = [p for p in g.sharded if p.requires_grad]
        slots.append(_Slot(len(slots), ps, lambda g=g: g.c))
    if not slots:
        raise bad_value("model", "fully_shard", "it has no sharded parameters")
    return "fully_shard", slots


class OffloadPipeline:
    """The overlapped offload step of one model and its optimizer;
    overlap_offload makes it, from the checked model, optimizer and options
    (OverlapOffload), the model's kind ("FSDP" or "fully_shard") and its
    slots (one per unit or group, in forward order). last_norm: the total
    norm of the last clipped step (max_norm set), else None."""

    def __init__(self, model, optimizer, options, kind, slots):
        self.model, self.optimizer, self.options, self.kind = model, optimizer, options, kind
        self.slots = slots
        self.last_norm = None
        self._slot_of = {id(p): s for s in slots for p in s.params}
        self._group_of = {id(p): gi for gi, g in enumerate(optimizer.param_groups)
                          for p in g["params"]}
        self._landed = {}      # id(param) -> param: landed, step not queued (this step)
        self._queued = set()   # id(param): stepped (queued) in this step
        self._clipping = False
        self._counts = {"queued_at_landing": 0, "queued_at_step": 0}
        self.pipe = _C.OffloadPipe(options.max_units_in_flight, len(slots))
        landed = _weak_hook(self, "_on_landed")  # [Note: hooks hold their state weakly]
        self._handles = [p.register_post_accumulate_grad_hook(landed)
                         for s in slots for p in s.params]
        self._handles += [model.register_forward_pre_hook(self._before_forward, prepend=True),
                          model.register_state_dict_pre_hook(self._before_read),
                          model.register_load_state_dict_pre_hook(self._before_load)]
        optimizer._overlap = self
        model.__dict__["_offload_overlap"] = self

    # -- hooks -------------------------------------------------------------

    def _on_landed(self, p):
        """A parameter's reduced gradient is in host memory: its step is
        queued now (no clipping) or at optimizer.step()."""
        if id(p) in self._queued or id(p) in self._landed:
            raise bad_value("overlap_offload", self.kind, "a gradient was reduced twice in one "
                            "step: the pipelined step runs at the first reduction, so "
                            "gradients cannot be accumulated across backward passes that "
                            "sync them", "run the earlier micro-batches without gradient sync "
                            "(model.no_sync() / set_requires_gradient_sync(False)), or "
                            "call optimizer.step() after each backward")
        if self.options.max_norm is not None:
            self._landed[id(p)] = p
            return
        self._queue(self._slot_of[id(p)], [p], bounded=True)
        self._counts["queued_at_landing"] += 1

    def _before_forward(self, module, args):
        # A group whose unsharded buffers stayed live reads its shard without
        # a gather: its steps are waited for here.
        for s in self.slots:
            c = s.engine()
            if c is not None and c.is_unsharded and self.pipe.busy(s.index):
                self.pipe.wait(s.index)
        return None

    def _before_read(self, module, prefix, keep_vars):
        self.wait()

    def _before_load(self, module, state_dict, prefix, *args):
        self.wait()

    # -- the optimizer's side (flatshard.optim's step and zero_grad call these)

    def step(self, closure=None):
        """optimizer.step(): the norm pass and every unit's step queued in
        forward order (max_norm set), or the steps of parameters whose
        gradients did not land through a reduction queued; returns the
        closure's loss."""
        loss = _call_closure(closure)
        if self.options.max_norm is not None:
            self.last_norm = self._clip()
        for s in self.slots:
            due = [p for p in s.params if id(p) not in self._queued and p.grad is not None]
            if due:  # every gradient of the step exists: no bound to keep
                self._queue(s, due, bounded=False)
                self._counts["queued_at_step"] += len(due)
        self._landed.clear()
        self._queued.clear()
        return loss

    def before_zero_grad(self, set_to_none):
        """optimizer.zero_grad(set_to_none): zeroing in place (False) writes
        the gradients queued steps read, so it waits for them first."""
        if not set_to_none:
            self.wait()

    def _clip(self):
        o = self.options
        self._clipping = True
        try:
            if self.kind == "FSDP":
                return self.model.clip_grad_norm_(o.max_norm, o.norm_type)
            # the list (and its order) a sequential loop hands torch's clip
            params = [p for p in self.model.parameters() if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, o.max_norm, o.norm_type)
        finally:
            self._clipping = False

    def check_clip(self):
        """The wrapper's clip_grad_norm_ asks first: refused while the
        pipeline steps (it would clip after the steps, or twice)."""
        if not self._clipping:
            raise bad_value("clip_grad_norm_", self.kind, "the model's optimizer step is "
                            "pipelined (overlap_offload): the steps run before a clip after "
                            "backward could act", "pass OverlapOffload(max_norm=...) instead")

    # -- the engine's side ------------------------------------------------------

    def _queue(self, slot, params, bounded):
        self._release_done()
        opt = self.optimizer
        by_group = {}  # the optimizer's groups, in order: one engine call each
        for p in params:
            gi = self._group_of[id(p)]
            by_group.setdefault(gi, []).append(p)
        self._attach(slot)
        for gi, ps in by_group.items():
            group = opt.param_groups[gi]
            jobs = []
            for i, p in enumerate(ps):
                x, g = _locals(type(opt).__name__, gi, i, p, p.grad)
                _check_pair(type(opt).__name__, gi, i, x, g)
                state = opt.state[p]
                if not state:  # as flatshard.optim's step lays it out
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = _zeros_state(p, x)
                    state["exp_avg_sq"] = _zeros_state(p, x)
                    if group["amsgrad"]:
                        state["max_exp_avg_sq"] = _zeros_state(p, x)
                m = _state_local(state.get("exp_avg"), p)
                v = _state_local(state.get("exp_avg_sq"), p)
                mx = _state_local(state.get("max_exp_avg_sq"), p) if group["amsgrad"] else None
                job = _host_job(x, g, m, v, mx, state.get("step"), group["amsgrad"])
                if job is None:
                    raise bad_value("overlap_offload", type(opt).__name__, "a parameter's "
                                    "gradient or state is not a contiguous float32 host tensor "
                                    "of its size", "load state saved by flatshard.optim")
                jobs.append(job)
                slot.held.append((x, g, m, v, mx))
                self._queued.add(id(p))
            b1, b2 = group["betas"]
            self.pipe.submit(slot.index, jobs, lr=group["lr"], beta1=b1, beta2=b2,
                             eps=group["eps"], weight_decay=group["weight_decay"],
                             decoupled=opt._decoupled, maximize=group["maximize"],
                             threads=opt.threads, bounded=bounded)

    def _attach(self, slot):
        c = slot.engine()
        if c is not None and c is not slot.attached:
            self.pipe.attach(slot.index, c)
            slot.attached = c

    def _release_done(self):
        for s in self.slots:
            if s.held and not self.pipe.busy(s.index):
                s.held = []

    # -- the user's side ----------------------------------------------------

    def wait(self):
        """Until every queued step has run (then the shards and the
        optimizer state are final)."""
        self.pipe.wait(-1)
        for s in self.slots:
            s.held = []

    def held_grads(self):
        """The gradient tensors the pipeline holds for queued steps (those of
        steps that have run are let go at the next queue or wait)."""
        return [h[1] for s in self.slots for h in s.held]

    def stats(self):
        """The engine's counts (max_units, units_in_flight,
        peak_units_in_flight, grad_bytes_in_flight, peak_grad_bytes_in_flight,
        steps_run, submits_blocked, gathers_waited, step_s, wait_s) and the
        parameters queued at their gradient's landing (queued_at_landing)
        or at optimizer.step() (queued_at_step: clipping, or a gradient no
        reduction wrote)."""
        return dict(self.pipe.stats(), **self._counts)

    def close(self):
        """Every step run, the hooks removed: the optimizer steps
        sequentially again."""
        if self.optimizer._overlap is not self:
            return
        self.wait()
        for h in self._handles:
            h.remove()
        self.pipe.close()
        self.optimizer._overlap = None
        self.model.__dict__.pop("_offload_overlap", None)


def pipeline_of(model):
    """The OffloadPipeline running for `model`, or None."""
    return model.__dict__.get("_offload_overlap")


def _weak_hook(obj, method):
    """A parameter hook calling obj.<method>(param) while obj lives
    ([Note: hooks hold their state weakly] in runtime/grad_hooks.py)."""
    ref = weakref.ref(obj)

    def hook(param):
        o = ref()
        if o is not None:
            getattr(o, method)(param)
    return hook
