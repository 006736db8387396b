"""Predicted against measured: the planner's breakdown for a wrapped model,
next to what each rank really holds.

    watch = flatshard.plan.watch(model)      # before the first forward
    ... one training step ...
    print(watch.report(optimizer))            # after optimizer.step()

The prediction is made from the unit structure alone (each flat buffer's
parameter sizes and dtypes, the strategy, world size, mixed precision and the
optimizer's kind) by core.py's arithmetic; the measurement comes from torch's
own storages (memory.memory_stats) and, for the gathered peak, from hooks
that sum the live gathered buffers at each unit's forward and gradient. On
CPU the model states (parameters, gradients, optimizer state) must match to
the byte. On CUDA the device total is compared with torch's allocator peak.

FLATSHARD_MEMORY_REPORT=1 makes `watch_from_env(model)` return a watch
(None otherwise); examples/train_small.py uses it.
"""
import gc
import inspect

import torch

from .. import _C, envvars
from .. import optim as fs_optim
from ..errors import bad_type, not_built
from ..fsdp.flat_param import gathered_buffers
from ..fsdp.unit import fsdp_units, unit_of
from ..memory import memory_stats, resident_bytes
from ..offload_pipeline import pipeline_of
from ..runtime.ahead import ahead_bytes
from .core import _plan, _resolve, plan
from .units import Group, Unit

ENV = "FLATSHARD_MEMORY_REPORT"
# memory_stats' roles -> the planner's lines that make them up.
CATEGORIES = (("params", ("params",)), ("grads", ("grads",)),
              ("optim", ("master", "moments", "optim_steps")))


def _fsdp_modules(model):
    if unit_of(model) is None:
        raise bad_type("model", model, "the root flatshard.FullyShardedDataParallel module")
    mods = fsdp_units(model)
    return mods[1:] + mods[:1]  # the root last, as the planner orders units


def optimizer_kind(optimizer):
    """torch's or flatshard's Adam/AdamW/SGD -> the planner's optimizer name."""
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, fs_optim.Adam, fs_optim.AdamW)):
        if any(g.get("amsgrad") for g in optimizer.param_groups):
            raise not_built("optimizer", type(optimizer).__name__, "amsgrad=True keeps a third "
                            "buffer the planner does not model")
        return "adamw"
    if isinstance(optimizer, (torch.optim.SGD, fs_optim.SGD)):
        return "sgd_momentum" if any(g.get("momentum") for g in optimizer.param_groups) else "sgd"
    raise bad_type("optimizer", optimizer, "torch's or flatshard's Adam, AdamW or SGD")


def measure_runtime(warm=True):
    """The process's resident bytes now, for plan(runtime_bytes=...): call
    it once, before the model is built. warm (the default): first run two
    training steps of a throwaway two-layer model on the CPU (forward,
    backward, a fused AdamW step), so that what any training step pages in
    or sets up once (torch's backward and optimizer code, the autograd
    engine's state, modules imported on first use) counts as runtime and
    not against the model. The global random state is left as it was, the
    throwaway tensors are freed and the C heap's free pages handed back
    before the reading; it costs a few milliseconds. warm=False: the plain
    reading (flatshard.memory.resident_bytes()[0])."""
    if not isinstance(warm, bool):
        raise bad_type("warm", warm, "True or False")
    if warm:
        with torch.random.fork_rng(devices=[]):
            _warm_up()
        gc.collect()
        _C.heap_trim()
    return resident_bytes()[0]


def _warm_up():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64))
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    except (RuntimeError, ValueError):  # a torch without the fused CPU step
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def predict(model, optimizer, **kw):
    """The planner's Plan for this wrapped model and optimizer (the same
    keyword arguments as flatshard.plan.plan may add an activation estimate)."""
    mods = _fsdp_modules(model)
    cfg = mods[-1]._cfg
    if cfg.use_orig_params:
        raise not_built("use_orig_params", True, "the planner models the flat shards the "
                        "optimizer sees with use_orig_params=False")
    units = [Unit(m._unit.name, [Group(list(g.numels), g.dtype.itemsize, g.requires_grad,
                                       g.dtype.is_floating_point) for g in m._unit.groups])
             for m in mods]
    comm = mods[-1]._unit.c.comm
    mp = cfg.mixed_precision
    # plan()'s defaults, with what the wrapped model says in place of them.
    args = {k: v.default for k, v in inspect.signature(plan).parameters.items()}
    args.update(params=sum(u.numel for u in units) or 1, units=len(units),  # known: none assumed
                world_size=comm.world_size,
                strategy=cfg.strategy, mixed_precision=mp.param_dtype if mp else None,
                reduce_dtype=mp.reduce_dtype if mp else None,
                optimizer=optimizer_kind(optimizer),
                backward_prefetch=cfg.backward_prefetch is not None,
                forward_prefetch=cfg.forward_prefetch,
                comm_backend=comm.backend if comm.backend in ("shm", "torch") else "torch",
                gather_ahead_bytes=ahead_bytes(comm))
    overlap = pipeline_of(model)  # overlap_offload's units in flight
    if overlap is not None:
        args.update(offload_params=True,
                    offload_pipeline=overlap.options.max_units_in_flight)
    disk = getattr(optimizer, "offload", None)  # flatshard.optim's DiskOffload
    if disk is not None:
        args.update(offload_optimizer="disk", disk_chunks=disk.buffers,
                    disk_chunk_bytes=disk.chunk_bytes)
    args.update(kw)
    return _plan(units, _resolve(args))


class Watch:
    """Hooks that record the peak of gathered buffers while training runs."""

    def __init__(self, model, hooks=True):
        self.model = model
        self.mods = _fsdp_modules(model)
        self.gathered_peak = None if not hooks else 0
        self.handles = []
        for m in self.mods if hooks else ():
            self.handles.append(m._fsdp_wrapped_module.register_forward_hook(self._sample))
            for g in m._unit.groups:
                if g.requires_grad:  # fires with the unit (and its prefetch) gathered
                    self.handles.append(g.compute.register_hook(self._sample_grad))
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()

    def _sample(self, *args):
        live = 0
        for m in self.mods:
            for t in gathered_buffers(m._unit.groups):
                live += t.untyped_storage().nbytes()
        self.gathered_peak = max(self.gathered_peak, live)

    def _sample_grad(self, grad):
        self._sample()
        return None

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def measure(self, optimizer):
        """{category: (predicted, measured)}; call after optimizer.step()."""
        p = predict(self.model, optimizer)
        mem = memory_stats(self.model, optimizer)
        # What is on disk is not in memory_stats: compare what stays in memory.
        out = {k: (sum(ln.bytes for ln in p.lines if ln.key in keys and ln.where != "disk"),
                   mem[k]) for k, keys in CATEGORIES}
        if self.gathered_peak is not None:
            out["gathered peak"] = (p["params_gathered"], self.gathered_peak)
        dev = next(self.model.parameters()).device
        if dev.type == "cuda":
            out["device total"] = (p.total("device"), torch.cuda.max_memory_allocated(dev))
        return out

    def report(self, optimizer, rank=None):
        """The measured-vs-predicted table of this rank, as text."""
        rows = self.measure(optimizer)
        if rank is None:
            rank = self.mods[-1]._unit.c.comm.rank
        lines = [f"flatshard memory, rank {rank}: predicted vs measured (bytes; model "
                 "states exact, gathered peak at most the prediction"
                 + (", device total within 10%)" if "device total" in rows else ")")]
        for k, (pred, meas) in rows.items():
            if k == "gathered peak":  # the two largest units: a bound when units differ
                ok = meas <= pred
            elif k == "device total":
                ok = abs(meas - pred) <= 0.1 * max(pred, 1)
            else:
                ok = pred == meas
            lines.append(f"  {k:<14}{pred:>16,}{meas:>16,}  {'ok' if ok else 'MISMATCH'}")
        return "\n".join(lines)


class SavedActivations:
    """Counts the bytes autograd saves for backward while active (each
    storage once), the parameters and flatshard's own buffers (shards,
    gathered units) apart: a measured activation figure for the planner.

        with flatshard.plan.SavedActivations(model) as act:
            loss = model(batch).loss
        plan = flatshard.plan.predict(model, opt, activation_bytes=act.bytes, ...)
    """

    def __init__(self, model):
        self.model = model
        self.bytes = 0
        self._seen = set()
        self._ctx = None

    def _owned(self):
        ptrs = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        for m in self.model.modules():
            unit = getattr(m, "_unit", None)
            for g in getattr(unit, "groups", ()):
                ptrs.update(t.untyped_storage().data_ptr() for t in (g.shard, g.full, g.lp)
                            if t is not None)
        return ptrs

    def _pack(self, t):
        s = t.untyped_storage()
        ptr = s.data_ptr()
        if ptr and ptr not in self._seen and ptr not in self._owned():
            self._seen.add(ptr)
            self.bytes += s.nbytes()
        return t

    def __enter__(self):
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        self._ctx = None


def check(model, optimizer):
    """Model states predicted vs measured on this rank, as text; call after
    optimizer.step() (gathered peaks need a watch from before the step)."""
    return Watch(model, hooks=False).report(optimizer)


def watch(model):
    """Start recording this rank's peaks; see Watch.report."""
    return Watch(model)


def watch_from_env(model):
    """A Watch when FLATSHARD_MEMORY_REPORT=1, else None."""
    return Watch(model) if envvars.read(ENV) == "1" else None
