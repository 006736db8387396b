"""Per-unit runtime: the torch hooks around one wrapped module.

The state machine and all data movement live in C (flatshard._C.Unit): this
file only receives torch's hook calls, reports them as events, and does the
torch-side work the actions ask for (parameter views, gradient tensors).

Hooks used (all public torch APIs):
  forward           FSDP.forward calls pre_forward / post_forward around
                    the wrapped module.
  pre-backward      a hook where backward reaches the unit's forward outputs
                    (runtime/trees.hook_before_backward): runs
                    before the unit's own gradient computation.
  post-backward     Tensor.register_post_accumulate_grad_hook on each full
                    buffer: runs once the unit's gradient is complete.
  end of backward   a callback queued on the autograd engine by the root.
Under torch.compile they run eagerly, as does the wrapper's forward around
the wrapped module (@eager.hook, runtime/eager.py).

The wrapper (api.py) sets each unit's UnitRuntime as the module's `_unit`
attribute; `unit_of` / `fsdp_units` find units by it, so the modules that
work on a wrapped model (summon, clip, state dicts, memory_stats) need not
import the wrapper class.
"""
import torch

from .. import _C
from ..errors import OutOfMemoryError, bad_value, is_alloc_failure
from ..options import BackwardPrefetch
from . import zero1
from ..runtime import eager
from ..runtime.grad_hooks import run_hooks
from ..runtime.heap import HEAP
from ..runtime.trees import hook_before_backward
from .oom import oom_report

_GRAD = _C.FLAG_GRAD_ENABLED


class UnitRuntime:
    def __init__(self, name, cunit, groups, use_orig_params, no_shard, backward_prefetch,
                 forward_prefetch, *, shard_optim=False, offload_params=False):
        """shard_optim: SHARD_OPTIM (ZeRO-1, zero1.py): the full buffers are
        gathered here and never resharded. offload_params: CPUOffload's
        rule on gradient accumulation (refuse_accumulation)."""
        eager.install(UnitRuntime)  # the hooks torch.compile runs eagerly
        self.name = name
        self.c = cunit
        self.groups = groups
        self.use_orig_params = use_orig_params
        self.no_shard = no_shard
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.shard_optim = shard_optim
        self.offload_params = offload_params
        # what a reshard hands back, for the heap trim ([Note: heap trim])
        self.gathered_bytes = cunit.gathered_bytes
        if cunit.comm.device is None:
            HEAP.watch_steps()
        self.root = None          # RootState, set at lazy init
        self.parts = [None] * len(groups)  # each group as a bucket member, made at first use
        self._sync_grads = True   # False inside no_sync()
        self.landing = []         # original parameters a deferred reduction writes (hooks)
        # The backward's hooks are the engine unit's ([Note: unit plain events]
        # in csrc/hooks/unit_events.c): its plain path, else the methods here.
        self.pre_backward_hook = _C.UnitHook(_C.UNIT_PRE_BACKWARD, cunit)
        self._hooks = [self.pre_backward_hook]
        for g in groups:
            if g.requires_grad:
                h = _C.UnitHook(_C.UNIT_POST_BACKWARD, cunit, g.index)
                g.compute.register_post_accumulate_grad_hook(h)
                self._hooks.append(h)
        self._hand_events(cunit)
        if shard_optim:
            self.c.unshard()  # whole from now on (collective: units are built in one order)
            zero1.register(self)
        if use_orig_params:
            self._use_sharded_params()
        else:
            self._drop_orig_params()

    # ------------------------------------------------------------------
    # the engine unit's plain events ([Note: unit plain events])

    def _hand_events(self, c):
        c.set_events(self, UnitRuntime._gather_backward, UnitRuntime._backward_views,
                     UnitRuntime._post_backward, UnitRuntime._plain_failed, run_hooks,
                     torch.empty_like, torch.Tensor)
        self.hand_plain()

    def set_engine(self, c):
        """A new engine unit (a comm hook's reduce dtype): the hooks and what
        the plain path reads follow it."""
        self.c = c
        for h in self._hooks:
            h.unit = c
        self._hand_events(c)
        if self.root is not None:
            self.root.hand_order()

    @property
    def sync_grads(self):
        """False inside no_sync(): backward accumulates without reducing."""
        return self._sync_grads

    @sync_grads.setter
    def sync_grads(self, value):
        self._sync_grads = value
        self.hand_plain()

    def hand_plain(self):
        """What the backward events do, decided here from what it depends on,
        whenever that changes (the root set at lazy init, no_sync, a new
        engine unit): [Note: unit plain events]."""
        c, root = self.c, self.root
        flags = 0
        if self.backward_prefetch is BackwardPrefetch.BACKWARD_PRE:
            flags |= _C.UNIT_PREFETCH_PRE
        elif self.backward_prefetch is BackwardPrefetch.BACKWARD_POST:
            flags |= _C.UNIT_PREFETCH_POST
        lp = bool(self.groups) and self.groups[0].lp is not None
        if (self.use_orig_params and not self.no_shard) or (self.no_shard and lp):
            flags |= _C.UNIT_VIEWS
        if root is not None and c.comm.device is None:
            if not (self.backward_prefetch is not None and root.ahead):
                flags |= _C.UNIT_PLAIN_PRE_BACKWARD
            if self._sync_grads and not self.use_orig_params and not self.shard_optim and \
                    not self.offload_params and not root.bucket.budget and \
                    not (self.no_shard and (lp or c.comm.world_size == 1)):
                flags |= _C.UNIT_PLAIN_POST_BACKWARD
        c.plain = flags
        c.latch = root.latch if root is not None else None

    def _plain_failed(self, e):
        """An engine failure on the plain path: an allocation failure is
        reported as out of memory (_call), anything else raised as it is."""
        if is_alloc_failure(e):
            self._out_of_memory(e, "backward")
        raise e

    # ------------------------------------------------------------------
    # parameter views

    def _drop_orig_params(self):
        """use_orig_params=False: the modules keep plain-tensor attributes in
        place of their parameters; only the flat shards are Parameters."""
        for g in self.groups:
            views = self._resting_views(g)
            for i, aliases in enumerate(g.aliases):
                for a in aliases:
                    del a.module._parameters[a.attr]
                    a.module.__dict__[a.attr] = views[i] if views is not None else None
            # The shard holds the values now: the original parameters keep
            # their shape and dtype (for names and checks) but not their
            # memory, which would otherwise be a whole unsharded model.
            for p in g.params:
                p.data = torch.zeros((), dtype=p.dtype, device=p.device).expand(p.shape)

    def _resting_views(self, g):
        """use_orig_params=False: what the modules show outside forward. The
        whole parameters where they are kept (NO_SHARD: the full buffer, the
        full-precision one under mixed precision; ZeRO-1), else None. The
        full-precision views of NO_SHARD + param_dtype are made once: they
        are put back after every forward."""
        if self.no_shard and g.lp is not None:
            if g.resting_views is None:
                g.resting_views = g.unsharded_views(g.full)
            return g.resting_views
        return g.unsharded_views() if self.no_shard or self.shard_optim else None

    def _use_sharded_params(self):
        """use_orig_params=True: each original parameter's data becomes its
        piece of the local shard (1-D; its own shape under NO_SHARD)."""
        for g in self.groups:
            for i, p in enumerate(g.params):
                p.data = g.piece(g.shard.detach(), i, self.no_shard)

    def _set_unsharded_views(self):
        # Instance attributes shadow _parameters during forward, which keeps
        # the registered parameters (and their order) untouched.
        # New views at every forward, although the buffer's storage object
        # stays: views kept from an earlier forward carry split and view
        # nodes with that forward's sequence numbers, and the autograd engine
        # runs ready nodes highest number first. Old nodes would wait until
        # the whole backward is done: every unit's gradient, reduction and
        # reshard at its very end, all units unsharded meanwhile.
        for g in self.groups:
            views = g.unsharded_views()
            for d, attr, i in g.targets:
                d[attr] = views[i]

    def _clear_unsharded_views(self):
        if not self.use_orig_params:
            if self.no_shard and self.groups and self.groups[0].lp is not None:
                self._drop_views_to_rest()  # NO_SHARD + param_dtype: back to fp32
            return  # the views stay as the module's attributes
        for g in self.groups:
            for d, attr, _ in g.targets:
                d.pop(attr, None)

    def _drop_views_to_rest(self):
        for g in self.groups:
            for v, aliases in zip(self._resting_views(g), g.aliases):
                for a in aliases:
                    a.module.__dict__[a.attr] = v

    # ------------------------------------------------------------------
    # unshard, with out-of-memory named

    def unshard(self, prefetch=False):
        """Gather this unit's compute buffers (outside the hook events: a
        prefetch, ZeRO-1's first gather). prefetch: on a device, the current
        stream waits for the gather only at the unit's next event ([Note:
        deferred collectives] in csrc/engine/unit.h)."""
        self._call(self.c.unshard, False, prefetch)

    def _event(self, ev, flags=0, group=-1, grad=None, out=None, accumulate=False, defer=False,
               bucket=None, along=None):
        """One engine call per hook event: the state machine's step and what
        it asks for (gather, reduce, free), done in C. along: engine units
        gathered in the same all-gather (RootState.unit_gather_ahead)."""
        try:
            return self.c.event(ev, flags, group, grad, out, accumulate, defer, along, bucket)
        except (RuntimeError, MemoryError) as e:
            if not is_alloc_failure(e):
                raise
            self._out_of_memory(e, "a hook event")

    def _call(self, fn, *args):
        """An allocation failure becomes an OutOfMemoryError carrying this
        rank's memory breakdown, and the other ranks are told (shm) instead
        of waiting for this one in a collective."""
        try:
            return fn(*args)
        except (RuntimeError, MemoryError) as e:
            if not is_alloc_failure(e):
                raise
            self._out_of_memory(e, fn.__name__)

    def _out_of_memory(self, e, what):
        msg = oom_report(self, e)
        # The others are told, in the engine's words, once ([Note: out of
        # memory on one rank]: where the engine failed, it told them already):
        # on shm their waits fail now; on the torch backend at the group's
        # timeout (or when this rank's process ends), quoting the cause.
        self.c.tell_out_of_memory(what, str(e).splitlines()[0] if str(e) else type(e).__name__)
        raise OutOfMemoryError(msg) from e

    # ------------------------------------------------------------------
    # forward

    def pre_forward(self):
        root = self.root
        self._event(_C.EV_PRE_FORWARD, _GRAD if torch.is_grad_enabled() else 0,
                    along=root.unit_gather_ahead(self, 1) if root.ahead else None)
        nxt = self.root.order.record(self)
        if self.forward_prefetch and nxt is not None and nxt.c.state == "IDLE":
            nxt.unshard(prefetch=True)
        self._set_unsharded_views()

    def post_forward(self, output):
        act = self._event(_C.EV_POST_FORWARD, _GRAD if torch.is_grad_enabled() else 0)
        self._clear_unsharded_views()
        if act & _C.ACT_HOOK_BACKWARD:
            hook_before_backward(output, self.pre_backward_hook)
        return output

    @eager.hook
    def abort_forward(self):
        """The wrapped forward raised: leave the unit IDLE and resharded."""
        if self.c.state == "FORWARD":
            self._event(_C.EV_POST_FORWARD, 0)
            self._clear_unsharded_views()

    # ------------------------------------------------------------------
    # backward

    # the pre-backward's steps that need Python (its sequence: C's, [Note:
    # unit plain events])

    def _gather_backward(self):
        """The gather with gather-ahead's units joined (the prefetch on, the
        root's RootState.unit_gather_ahead), or on a device: the engine's
        actions."""
        along = self.root.unit_gather_ahead(self, -1) \
            if self.backward_prefetch is not None and self.root.ahead else None
        return self._event(_C.EV_PRE_BACKWARD, 0, along=along)

    def _backward_views(self):
        """A checkpointed module recomputes its forward during backward: it
        must see the whole parameters, as in forward (views made with grad
        on: backward runs with it off)."""
        with torch.enable_grad():
            self._set_unsharded_views()

    @eager.hook
    def _post_backward(self, gi, full):
        g = self.groups[gi]
        grad, out, accumulate, defer, keep = None, None, False, False, None
        if self.sync_grads and full.grad is not None:
            grad, full.grad = full.grad, None
            out, accumulate, defer, keep = self._plan_reduce(g, grad)
        if defer:
            self.root.reduce_issued(self)
        part = self._bucket_part(gi, out, keep)
        # The parameters whose gradients this reduction writes (the original
        # ones with use_orig_params, else the flat shard) get their
        # post-accumulate-grad hooks run once the values are there
        # (runtime/grad_hooks.py): now, at the bucket's flush, or when a
        # deferred reduction is landed.
        written = () if out is None else g.params if self.use_orig_params else \
            () if g.shard is g.compute else (g.shard,)  # autograd runs the shard's own
        act = self._event(_C.EV_POST_BACKWARD, 0 if self.sync_grads else _C.FLAG_NO_SYNC, gi,
                          grad if out is not None else None, out, accumulate, defer,
                          self.root.bucket.c if part is not None else None)
        if out is not None and act & _C.ACT_REDUCE_GRAD and not accumulate:
            self._set_reduced(g, out, keep)
        if part is not None and act & _C.ACT_REDUCE_GRAD:
            part.written = written
            self.root.bucket.joined(part, g.reduce_dtype)
        elif written and act & _C.ACT_REDUCE_GRAD:
            if defer:
                self.landing += written
            else:
                run_hooks(written)
        if act & _C.ACT_RESHARD:
            self._clear_unsharded_views()
            self.c.released()  # the BACKWARD_POST prefetch, the heap's count

    def _bucket_part(self, gi, out, keep):
        """This group's reduction as a member of the root's bucket
        (runtime/bucket.py), or None: it reduces at once. Not when gradients
        the user set are added to the new one (that reads it)."""
        bucket = self.root.bucket if self.root is not None else None
        if bucket is None or not bucket.budget or out is None or not self.c.bucketable or \
                (keep is not None and any(k is not None for k in keep)):
            return None
        part = self.parts[gi]
        if part is None:
            part = self.parts[gi] = _BucketPart(self, self.groups[gi])
        return part if bucket.admits(part, part.group.reduce_dtype) else None

    def _new_out(self, g):
        """Where a first reduction lands: the shard gradient, or under
        SHARD_OPTIM the whole gradient, whose slice the optimizer sees
        (zero1.py)."""
        if self.shard_optim:
            return torch.empty(g.padded_numel, dtype=g.dtype, device=g.shard_device)
        return g.new_shard()

    def _shard_of(self, g, out):
        if self.shard_optim:
            return out.narrow(0, self.c.comm.rank * g.shard_numel, g.shard_numel)
        return out

    def _plan_reduce(self, g, grad):
        """Where the engine reduces `grad`: (out, accumulate, defer, keep).
        accumulate: into the gradient this unit left there. keep: gradients
        the user set (or kept) that _set_reduced adds to a new one. On a
        device the reduction is deferred ([Note: deferred collectives] in
        csrc/engine/unit.h) unless a tensor op must read its result now; the
        root keeps one in flight and waits for the rest at the end of
        backward (finalize). out None: nothing to reduce (one rank's
        NO_SHARD gradient is its own mean)."""
        if self.offload_params and zero1.holds_grad(self, g):
            self.refuse_accumulation()
        defer = self.c.comm.device is not None
        if not self.use_orig_params:
            cur = g.shard.grad
            if cur is None:
                if self.no_shard and self.c.comm.world_size == 1 and \
                        grad.dtype == g.dtype == g.reduce_dtype and \
                        grad.shape == g.shard.shape:
                    # One rank's mean gradient is its own: no copy. (Another
                    # reduce dtype rounds it through that dtype, as torch.)
                    g.shard.grad = grad
                    return None, False, False, None
                return self._new_out(g), False, defer, None
            if not self.shard_optim:
                return cur, True, defer, None
            if g.whole_grad is not None and zero1.is_slice_of(cur, g.whole_grad,
                                                              self.c.comm.rank):
                return g.whole_grad, True, defer, None
            return self._new_out(g), False, False, [cur]  # a gradient the user set
        current = [p.grad for p in g.params]
        if g.grad_buf is not None and all(c is v for c, v in zip(current, g.grad_views)):
            return (g.whole_grad if self.shard_optim else g.grad_buf), True, defer, None
        # gradients the user set or kept are added after, on this stream: no deferral
        return self._new_out(g), False, defer and all(c is None for c in current), current

    def _set_reduced(self, g, out, keep):
        """A new reduced gradient becomes the parameters' gradients, plus what
        the user had set or kept (added with autograd off: a gradient made
        with create_graph requires grad)."""
        if self.shard_optim:
            g.whole_grad = out
        buf = self._shard_of(g, out)
        if not self.use_orig_params:
            if keep is not None:
                with torch.no_grad():
                    buf.add_(keep[0])
            g.shard.grad = buf
            return
        views = [g.piece(buf, i, self.no_shard) for i in range(len(g.params))]
        if keep is not None:
            with torch.no_grad():
                for v, c in zip(views, keep):  # gradients the user set or kept
                    if c is not None:
                        v.add_(c.reshape(v.shape))
        for p, v in zip(g.params, views):
            p.grad = v
        g.grad_buf, g.grad_views = buf, views

    def land_reduced(self):
        """The current stream waits for this unit's deferred reductions; the
        hooks of the parameters they wrote run."""
        self.c.finish_reduce()
        self._run_landed_hooks()

    def _run_landed_hooks(self):
        if self.landing:
            written, self.landing = self.landing, []
            run_hooks(written)

    def finalize(self):
        """End of the backward pass: the current stream waits for deferred
        reductions, and whatever is still unsharded is freed."""
        act = self._event(_C.EV_FINALIZE, 0)  # deferred reductions are waited for first
        self._run_landed_hooks()
        if act & _C.ACT_RESHARD:
            self._clear_unsharded_views()
        # Between steps the host keeps only its model states: the pool's
        # cached blocks go back once no unit holds one ([Note: pool cache]).
        _C.pool_trim(True)
        if self.c.comm.device is None and HEAP.pending:
            HEAP.trim()

    def _reshard(self):
        self._clear_unsharded_views()
        if not self.shard_optim:  # ZeRO-1 keeps its parameters whole
            self.c.reshard()

    def refuse_accumulation(self):
        """CPUOffload(offload_params=True) keeps torch FSDP1's rule: no
        gradient accumulation across backwards outside no_sync()."""
        raise bad_value("cpu_offload", "CPUOffload(offload_params=True)", f"unit "
                        f"{self.name!r} already holds a reduced gradient, and gradients cannot "
                        "be accumulated across backward passes outside no_sync() with parameter "
                        "offload (torch FSDP's rule)", "call optimizer.zero_grad() after each "
                        "step, or run the earlier backward passes inside model.no_sync()")


class _BucketPart:
    """One group's reduction as a member of the root's ReduceBucket
    (runtime/bucket.py): its gradient tensors are set at the hook as
    always; the engine writes their values when the bucket is flushed."""

    __slots__ = ("unit", "group", "written")

    def __init__(self, unit, g):
        self.unit, self.group = unit, g
        self.written = ()  # the parameters whose hooks run once the flush wrote them

    # read at each use: a comm hook may give the unit a new engine object
    # and the group a new reduce dtype
    c = property(lambda self: self.unit.c)
    comm = property(lambda self: self.unit.c.comm)
    reduce_bytes = property(lambda self: self.group.padded_numel *
                            self.group.reduce_dtype.itemsize)

    def finish_reduce(self):
        """The engine wrote the gradients at the flush: their parameters'
        hooks run."""
        written, self.written = self.written, ()
        run_hooks(written)

    def drop_reduce(self):
        """A bucket given up: what the reduction was to write is not there."""
        g = self.group
        self.written = ()
        if self.unit.use_orig_params:
            for p in g.params:
                p.grad = None
            g.grad_buf = g.grad_views = None
        else:
            g.shard.grad = None


# [Note: unit events] A unit's events are the wrapper's forward steps, the
# pre-backward hook on its outputs, each flat buffer's post-accumulate-grad
# hook and the root's end of backward. The forward's events and the end of
# backward have one implementation each, in Python (the methods here; the
# root's RootState._finish_backward in fsdp/root.py, which calls finalize).
# The pre-backward is one sequence in C ([Note: unit plain events] in
# csrc/hooks/unit_events.c), which calls the steps here that need Python
# where hand_plain's flags say (_gather_backward, _backward_views). The
# post-backward has two: a plain path in C, which the _C.UnitHook objects
# run where hand_plain's flags allow, and _post_backward here, which holds
# the sequence again for every case and runs otherwise. Each method here
# makes one engine call (flatshard._C.Unit.event: the state machine's step
# and the gather, reduce or free it asks for, in C) and does the torch-side
# work the step's actions ask for (the parameter views, the gradient
# tensors); what _post_backward shares with the plain path (what follows a
# reshard) it calls in C. The cases a tree may need (gather-ahead, a
# prefetch, a bucket, a deferred reduction, a cast, no_sync) are branches
# on fields read in the same pass.


def unit_of(module):
    """The UnitRuntime of an FSDP module (the wrapper's `_unit`), or None for
    any other module."""
    unit = module.__dict__.get("_unit")
    return unit if isinstance(unit, UnitRuntime) else None


def fsdp_units(module, recurse=True):
    """FSDP modules under `module` (itself included; only itself with
    recurse=False), parents before children: the order every rank walks them
    in, so collectives line up."""
    mods = module.modules() if recurse else [module]
    return [m for m in mods if unit_of(m) is not None]
