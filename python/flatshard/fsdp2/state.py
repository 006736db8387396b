"""The per-module state of fully_shard: the hooks that unshard and reshard one
ParamGroup around forward and backward, and the root's end-of-backward pass.

Hooks (all public torch APIs):
  pre-forward    module forward pre-hook (prepended): lazy init at the first
                 forward (the first state to run is the root and claims every
                 state below it), input cast, unshard, forward prefetch.
  post-forward   module forward hook: reshard (reshard_after_forward), output
                 cast, and a Tensor hook on each output that requires grad.
  pre-backward   that output hook: unshard again (unless unshard_in_backward
                 is off) and backward prefetch; queues the root's callback.
  post-backward  register_post_accumulate_grad_hook on each unsharded
                 parameter: once every trainable parameter of the group has
                 its gradient, reduce-scatter (unless gradient sync is off)
                 and reshard (unless reshard_after_backward is off); the
                 sharded parameters' own post-accumulate-grad hooks run once
                 the reduction wrote their gradients (runtime/grad_hooks.py).
  end of backward  the root's callback on the autograd engine: groups whose
                 parameters did not all get a gradient (unused parameters) are
                 reduced and resharded here.
  state dict     state-dict and load-state-dict pre-hooks on the modules that
                 hold the group's parameters: reshard, so that both see the
                 DTensor shards (from unshard to reshard the modules hold the
                 unsharded parameters, as with torch's fully_shard).

Each hook opens torch's fully_shard profiler ranges ("FSDP::pre_forward
(fqn)", "FSDP::all_gather (fqn)", "FSDP::post_backward_reduce (fqn)", ...)
while a profiler runs, and the engine's collectives are counted in an active
CommDebugMode as torch's c10d ones would be (runtime/observe.py).

Under torch.compile the hook entry points (marked @eager.hook) run eagerly,
as torch's fully_shard's do: Dynamo breaks the graph where torch's nn.Module
code calls them and compiles the modules' own forwards (runtime/eager.py).
"""
import functools
import operator
import weakref

import torch

from .. import _C, torch_facts
from ..errors import MetaDeviceError
from ..noop import mixed_precision as noop_mp
from ..runtime import eager, observe
from ..runtime.trees import cast_floating, grad_tensors, hook_before_backward, map_tensors
from . import finalize, torch_state, unused
from . import root as roots
from .root import STATE_ATTR, state_of  # noqa: F401  (their importers read them here)

_profiling, _depth = observe.profiling, observe.dispatch_depth  # observe.watching, frameless


def _cast(dtype, tree):
    return tree if dtype is None else cast_floating(tree, dtype)


class _InputsDone(torch.autograd.Function):
    """The identity on a state's forward inputs; its backward tells that
    forward's _Forward that the module's backward is done with them ([Note:
    frozen parameters] in FSDPState)."""

    @staticmethod
    def forward(ctx, fwd, *tensors):
        ctx.fwd = fwd
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.fwd.inputs_done()
        return (None,) + grads


class _Forward:
    """One forward of a state with frozen parameters (or reducing unused
    ones: fsdp2/unused.py) whose inputs require grad ([Note: frozen
    parameters] in FSDPState), and the pre-backward hook
    on its outputs: from there until the same backward reaches the forward's
    inputs, the state's parameters are still to be read. A forward that no
    backward runs through (its graph dropped: a loss only logged) holds
    nothing back."""
    __slots__ = ("state",)

    def __init__(self, state):
        self.state = state

    @eager.hook
    def __call__(self, grad):
        st = self.state
        if self not in st.reading:
            st.reading.append(self)
        return st.pre_backward_hook(grad)

    def inputs_done(self):
        st = self.state
        if self in st.reading:
            st.reading.remove(self)
        if st.reshard_due and not st.reading:
            st.reshard_due = False
            st.group.reshard()
        unused.module_backward_done(st)  # [Note: unused parameters]


def _issued(g):
    """The collectives g's engine has issued so far, in observe.KINDS' order:
    all-gathers (over the shard group, or the post-forward group),
    reduce-scatters, and under HSDP one all-reduce after each reduce-scatter."""
    rs = g.n_reduce_scatters
    return (g.n_all_gathers + g.n_post_gathers, rs,
            rs if g.replicate_comm is not None else 0)


def _issued_all(groups):
    """_issued summed over groups gathered together (each group's gather
    counts as the one all-gather torch would issue for it)."""
    return tuple(map(sum, zip(*map(_issued, groups))))


def _plain(name, doc):
    """A flag of the state that hand_options reads, as a property whose
    setter hands the engine group its plain events anew: whoever changes it
    (FSDPModule's setters, lazy init) only assigns it."""
    field = "_" + name

    def set_(self, value):
        self.__dict__[field] = value
        self.hand_options()
    return property(operator.attrgetter(field), set_, doc=doc)


class FSDPState:
    def __init__(self, modules, group, reshard_after_forward, mp_policy):
        eager.install(FSDPState)  # the hooks torch.compile runs eagerly
        eager.install(_Forward)
        self.modules = modules            # one, or the list given to fully_shard (one group)
        self.group = group                # ParamGroup, or None (no parameters of its own)
        self.reshard_after_forward_arg = reshard_after_forward  # None: decided at lazy init
        # the flags hand_options reads (the properties below), before any is handed
        self._reshard_after_forward = reshard_after_forward
        self._reshard_after_backward = True
        self._requires_gradient_sync = True
        self._unshard_in_backward = True
        self._unshard_async_op = False
        self._forward_prefetch = None
        self._backward_prefetch = None
        self._lean = False
        self.is_last_backward = True
        self.post_optim_event = None
        self.mp = mp_policy
        self.is_root = None
        self.decided = False              # lazily initialized as torch's state is (lazy_init)
        self.root = None
        self.states = None                # the root's: every state of its tree
        self.tree = None                  # the root's: runtime.root.Root, set at lazy init
        self.fqn = ""                     # the modules' names in the root's tree (profiler)
        self.label = ""                   # " (fqn)": the suffix of this state's ranges
        self.param_fqns = None            # the group's parameters' names there (lazy init)
        self.prefetched = []              # the root's: implicitly prefetched this forward
        self.next_state = None            # the state that ran after this one last forward
        self.watching = None              # frozen parameters: this forward's _Forward
        self.reading = []                 # ... those this backward reached, not their inputs
        self.reshard_due = False          # ... a reshard waiting for them
        # [Note: manual finalization] (finalize.py): the root's mode, the mode
        # of the backward under way until finalized, an asynchronous
        # finalization not waited for; each state's post-backward left pending
        self.manual_finalization = False
        self.manual_active = None
        self.reduction = None
        self.post_backward_pending = False
        self.handles = []
        pre, post = self._events(group)  # [Note: one sequence per event]
        for module in modules:
            self.handles += [
                module.register_forward_pre_hook(pre, prepend=True, with_kwargs=True),
                module.register_forward_hook(post),
            ]
        # state_dict() and load_state_dict() see the sharded parameters, as
        # with torch: the modules holding this group's parameters reshard first.
        holders = {} if group is None else {id(m): m for al in group.aliases for m, _ in al}
        for m in holders.values():
            self.handles += [m.register_state_dict_pre_hook(self._to_sharded_hook),
                             m.register_load_state_dict_pre_hook(self._to_sharded_hook)]

    # ------------------------------------------------------------------
    # the flags hand_options reads ([Note: one sequence per event]): assigned,
    # they are handed to the engine group

    reshard_after_forward = _plain("reshard_after_forward", "True, False or an int; None "
                                   "until lazy init decides (True but for the root)")
    reshard_after_backward = _plain("reshard_after_backward", "False: the group stays "
                                    "gathered after backward (set_reshard_after_backward)")
    requires_gradient_sync = _plain("requires_gradient_sync", "False: backward accumulates "
                                    "unreduced gradients (set_requires_gradient_sync)")
    unshard_in_backward = _plain("unshard_in_backward", "False: no gather in backward "
                                 "(set_unshard_in_backward)")
    unshard_async_op = _plain("unshard_async_op", "the hooks' gathers issued with async_op "
                              "(FSDPModule._set_unshard_async_op)")
    forward_prefetch = _plain("forward_prefetch", "None: implicit (see _implicit), else the "
                              "states of the user's list")
    backward_prefetch = _plain("backward_prefetch", "as forward_prefetch, in backward")
    lean = _plain("lean", "the C plain path allowed at all: decided at lazy init "
                  "(root.decide_plain)")

    # ------------------------------------------------------------------
    # torch's private names (torch_state.py)

    _fsdp_param_group = property(torch_state.param_group)
    _fsdp_param_groups = property(lambda self: [] if self.group is None else
                                  [torch_state.param_group(self)])
    _is_root = property(torch_state.is_root)
    _state_ctx = property(torch_state.state_ctx)
    _lazy_init = torch_state.lazy_init
    _modules_to_run_forward = property(torch_state.modules_to_run_forward)

    def post_backward_now(self):
        """The group's post-backward outside autograd (torch's
        FSDPParamGroup.post_backward called by hand): what it holds is
        reduced unless gradient sync is off, and it is resharded; the
        sharded gradients are in place on return."""
        self._end_backward()
        root = self.root or self
        if root.tree is not None:
            root.tree.bucket.flush()
        root.finish_reducing()

    def _end_backward(self):
        """What the end of backward does for this state: a group that got
        gradients (unused parameters aside) is reduced and resharded now,
        one that got none resharded."""
        if self.reading or self.reshard_due:
            self.forget_held_reshard()
        g = self.group
        if g is None:
            return
        if g.c.arrived or (self.requires_gradient_sync and g.has_unsharded_grads()):
            g.c.post_backward()  # its sequence: [Note: post-backward sequence]
        elif self.reshard_after_backward and (g.registered_unsharded or g.c.is_unsharded or
                                              g.post_chunk is not None):
            g.reshard()

    # ------------------------------------------------------------------
    # lazy init

    def lazy_init(self, claimable=False):
        """Decide the root and its tree, as torch's first forward (or
        _lazy_init) does: this state is the root and claims every state in
        its modules' trees. Once decided, a state is left as it is. Refused
        as torch refuses them, before anything changes (_check_root): a
        root of several modules, a state below already decided.
        claimable: FSDPModule.unshard's before any forward, whose tree
        serves the gather and is decided by none (torch's unshard decides
        no root): it leaves out states decided already, and a later lazy
        init, of this state or of one above it, claims its states as if it
        had not been made."""
        if self.decided or (claimable and self.is_root is not None):
            return
        roots.decide(self, claimable)

    def _span(self, name):
        """torch's range `name` of this state's group while a profiler runs
        (none for a state without parameters: torch has no group there)."""
        if self.group is None:
            return observe.NOTHING
        return observe.span(name, self.label)

    # ------------------------------------------------------------------
    # unshard with the post-backward hooks attached

    def unshard(self, defer=False, along=()):
        """defer: a prefetch (the caller's stream waits at the next
        unshard of this state, see ParamGroup.unshard). along: states whose
        gathers join this one's on the host, one all-gather for all ([Note:
        coalesced gathers] in csrc/engine/engine.h): the prefetches of a
        host Comm."""
        g = self.group
        if g is None:
            return
        if g.c.is_unsharded:  # waits for a pending gather, unless this is a prefetch too
            with (observe.span("FSDP::all_gather_copy_out", self.label)
                  if not defer and g.pending else observe.NOTHING):
                g.unshard(defer)
            return
        if g.post_chunk is None:  # parameters assigned since: the new shards
            changed = g.c.registration_changed()
            if changed:
                g.sync_registered(changed)
        if g.full is None:
            self._check_materialized()
        joined = [st for st in along if st._joins(g)] if along and not defer else None
        if joined:
            groups = tuple(st.group for st in joined)
            with observe.counted_span(_issued_all, (g,) + groups, g.comm, "FSDP::all_gather",
                                      self.label):
                g.unshard(along=groups)
            for st in joined:
                st._hook_grads()
        elif _profiling() or _depth():
            with observe.counted_span(_issued, g, g.comm, "FSDP::all_gather", self.label):
                g.unshard(defer)
        else:
            g.unshard(defer)
        if g.c.needs_hooks:
            self._hook_grads()

    def _before_gather(self):
        g = self.group
        if g.post_chunk is None:  # parameters assigned since: the new shards
            changed = g.c.registration_changed()
            if changed:
                g.sync_registered(changed)
        if g.full is None:
            self._check_materialized()

    def _check_materialized(self):
        """Before the first gather: no parameter left on the meta device."""
        g = self.group
        meta = [n for i, n in enumerate(g.names) if g.local(i).is_meta]
        if meta:  # torch: a RuntimeError; MetaDeviceError is one
            raise MetaDeviceError(
                f"flatshard: fully_shard module {type(self.modules[0]).__name__} still has its "
                f"parameters on the meta device ({', '.join(meta)}); FSDP parameters should be "
                "materialized from meta device before training: load them with "
                "load_state_dict(sd, assign=True) or torch.distributed.checkpoint.state_dict."
                "set_model_state_dict, or call module.to_empty(device='cpu') and "
                "reset_parameters() on its submodules, before the first forward or unshard")

    def _joins(self, g):
        """Whether this state's gather can go in group g's all-gather (made
        ready for it if so): a host Comm shared with g, nothing gathered yet,
        no parameter class that gathers for itself, no post-forward chunk."""
        h = self.group
        if h is None or h is g or h.comm is not g.comm or h.comm.device is not None or \
                h.is_unsharded or h.ext or h.post_chunk is not None:
            return False
        self._before_gather()
        return not h.is_unsharded and not h.ext  # (sync_registered may have rebuilt it)

    def _hook_grads(self):
        """Post-accumulate-grad hooks on trainable unsharded parameters that
        have none yet."""
        g = self.group  # (new unsharded parameters, or a frozen one unfrozen: the group says)
        for i in g.c.take_unhooked():
            g.unsharded[i].register_post_accumulate_grad_hook(self._arrival(i))

    def _arrival(self, i):
        """Parameter i's post-accumulate-grad hook: its gradient has
        arrived; once every trainable parameter's has, the post-backward
        (flatshard._C.Arrival: counted by the engine group, whose plain
        post-backward runs there: [Note: post-backward sequence] in
        csrc/hooks/shard_events.c). It holds the
        group weakly ([Note: hooks hold their state weakly] in
        runtime/grad_hooks.py)."""
        return eager.wrap(_C.Arrival(self.group.c, i))

    def _events(self, group):
        """The hooks torch calls for this state's events, flatshard._C.Event
        objects, whose sequences are C's ([Note: one sequence per event]),
        calling the steps below that need Python where their options
        (hand_options) say; the engine group's arrivals run the
        post-backward ([Note: post-backward sequence] there).
        Returns the forward pre-hook and hook."""
        c = None if group is None else group.c
        if group is not None:
            group.attach(weakref.ref(self), (
                FSDPState._accumulate_grads, FSDPState._reduce_grads,
                FSDPState._reshard_after_backward, FSDPState._keep_unsynced,
                functools.partial(FSDPState._span, name="FSDP::post_backward_reshard")),
                (_profiling, _depth))
        pb = _C.Event(_C.EVENT_PRE_BACKWARD, c, hook_grads=self._hook_grads,
                      span=functools.partial(self._span, "FSDP::pre_backward"),
                      step=self._gather_backward, prefetch=self._prefetch_backward)
        self.pre_backward_hook = eager.wrap(pb)
        po = _C.Event(_C.EVENT_POST_FORWARD, c, hook_grads=self._hook_grads,
                      span=functools.partial(self._span, "FSDP::post_forward"),
                      step=self._reshard_post_forward, root_end=self._end_forward,
                      watching=self._take_watching, cast=self._cast_output,
                      pre_backward=self.pre_backward_hook, hook_outputs=hook_before_backward,
                      grad_enabled=torch.is_grad_enabled, tensor=torch.Tensor)
        self.post_forward_hook = eager.wrap(po)
        pf = _C.Event(_C.EVENT_PRE_FORWARD, c, hook_grads=self._hook_grads,
                      span=functools.partial(self._span, "FSDP::pre_forward"),
                      step=self._gather_forward, watching=self._watch_forward,
                      prefetch=self._prefetch_forward, begin=self._begin_forward,
                      opts=_C.OPT_BEGIN | _C.OPT_STEP)  # until lazy init hands them
        self.pre_forward_hook = eager.wrap(pf)
        if group is not None:
            group.events = (pf, po, pb)  # given the engine group anew when it is made again
        self.events = (pf, po, pb)
        return self.pre_forward_hook, self.post_forward_hook

    def hand_options(self):
        """What each event's sequence does beyond its plain steps, handed
        to the events whenever one of the flags it reads is assigned (their
        properties, _plain: lazy init, FSDPModule's setters) or the group
        gains an extension ([Note: one sequence per event]):
          the post-forward's options (_C.OPT_*): the reshard in C, or
            Python's (an int reshard_after_forward's chunk, an extension's
            free); the root's end of forward; the output cast;
          the pre-forward's and pre-backward's: the gather in C, which
            needs a lean state (not the root, host Comms, no gather-ahead,
            no cast: root.decide_plain) without a parameter that gathers
            itself or is tensor-parallel, a bool reshard_after_forward, no
            prefetch list for the pass and no async_op, else Python's; the
            begin (lazy init, the root, the order, the input cast: not
            lean); the prefetch (a list, a device's implicit one);
          the post-backward's (the engine group's _C.PB_*): gradient sync,
            reshard after backward, both in C with a lean state as above
            (the reduction also without a bucket), torch's accumulate range.
        What can change within a step the C sequences check at each call."""
        g, root = self.group, self.root
        raf = self.reshard_after_forward
        whole = isinstance(raf, bool)
        lean = self.lean and g is not None and not g.ext and not g.tp
        post = (_C.OPT_ROOT if self.is_root else 0) | \
            (_C.OPT_CAST if self.mp.output_dtype is not None else 0)
        if g is not None and raf is True:
            post |= _C.OPT_STEP if g.ext or g.tp else _C.OPT_RESHARD
        elif g is not None and raf is not False and raf is not None:
            post |= _C.OPT_STEP
        device = root is not None and root.states is not None and any(
            st.group is not None and st.group.comm.device is not None for st in root.states)
        gather = lean and whole and not self.unshard_async_op
        fwd = (0 if self.lean else _C.OPT_BEGIN) | \
            (_C.OPT_PREFETCH_OUT if self.forward_prefetch is not None or device else 0)
        if g is not None and not (gather and self.forward_prefetch is None):
            fwd |= _C.OPT_STEP
        pre = 0
        if g is not None and self.unshard_in_backward:
            pre |= _C.OPT_GATHER
            if not (gather and self.backward_prefetch is None):
                pre |= _C.OPT_STEP
        if self.backward_prefetch is not None:
            pre |= _C.OPT_PREFETCH_OUT
        elif device:
            pre |= _C.OPT_PREFETCH_IN  # a device's implicit prefetch (_implicit)
        if g is not None and unused.watched(g):  # [Note: unused parameters] in unused.py
            fwd, post = fwd | _C.OPT_WATCH, post | _C.OPT_WATCH
        pf, po, pb = self.events
        pf.opts, po.opts, pb.opts = fwd, post, pre
        if root is not None and root.tree is not None:
            pb.latch = root.tree.latch
        if g is not None:  # [Note: post-backward sequence] in csrc/hooks/shard_events.c
            pb = (_C.PB_SYNC if self.requires_gradient_sync else 0) | \
                (_C.PB_RESHARD if self.reshard_after_backward else 0) | \
                (_C.PB_RANGE if torch_facts.post_backward_accumulate_range() else 0)
            if lean and whole:
                pb |= _C.PB_RESHARD_C | (0 if root.tree.bucket.budget else _C.PB_REDUCE_C)
            g.plain = pb

    @eager.hook
    def _to_sharded_hook(self, *args, **kwargs):
        self.reshard()

    def _unshard_and_wait(self, along=()):
        """The pre-forward and pre-backward gather: with
        _set_unshard_async_op(True) issued as async_op and waited for at
        once, as torch does (its point there is which stream allocates).
        along: the states this hook prefetches, whose host gathers join."""
        if self.unshard_async_op:
            self.unshard(defer=True)
            if self.group is not None:
                self._wait_gather()
        else:
            self.unshard(along=along)

    def _wait_gather(self):
        """The copy-out of a deferred all-gather (a device Comm's prefetch or
        async_op), in torch's range when one is pending. A gather that is not
        deferred does its copy-out inside the engine's unshard call, in
        "FSDP::all_gather"."""
        g = self.group
        with (observe.span("FSDP::all_gather_copy_out", self.label)
              if g.pending else observe.NOTHING):
            g.wait_unsharded()

    def reshard(self):
        if self.group is not None:
            self.group.reshard()

    def gather_ahead(self, st, step):
        """Root only: roots.gather_ahead."""
        return roots.gather_ahead(self, st, step)

    # ------------------------------------------------------------------
    # implicit prefetch (devices only)

    @staticmethod
    def _implicit(st):
        """Without a prefetch list set by the user, on a device: the state
        that ran next in the previous forward (or, in backward, before), as
        torch's FSDP2 overlaps them by default. Its all-gather is deferred,
        so it runs beside this module's compute. Host collectives are
        synchronous: nothing to overlap, none."""
        if st is None or st.group is None or st.group.comm.device is None:
            return []
        return [st]

    @staticmethod
    def _prefetch(states, pass_type):
        """Issue the deferred gather of each state, in torch's range. On a
        host Comm the states not gathered yet are gathered in one all-gather
        ([Note: coalesced gathers] in csrc/engine/engine.h); none given, nothing."""
        if not states:  # the host's implicit prefetch, every backward hook
            return
        host = [st for st in states if st.group is not None and
                st.group.comm.device is None and not st.group.is_unsharded]
        if len(host) > 1:
            with observe.span("FSDP::", pass_type, "_prefetch for ", host[0].fqn):
                host[0].unshard(along=host[1:])
        for st in states:
            with observe.span("FSDP::", pass_type, "_prefetch for ", st.fqn):
                st.unshard(defer=True)

    # ------------------------------------------------------------------
    # forward

    # [Note: one sequence per event] Each event has one sequence of steps,
    # in C ([Note: event sequences] in csrc/hooks/shard_events.c): torch
    # calls the state's _C.Event objects (_events), whose sequence takes
    # each step where its options (handed by hand_options where what they
    # follow changes) and the fields it reads at each call say, and calls
    # the methods below for the steps that need Python, each one step, not
    # the event: lazy init and the root's start and end of forward (the
    # root), the forward order's record, torch's profiler ranges and
    # CommDebugMode's counts (while one watches), the casts of mixed
    # precision, the gathers with states joined (gather-ahead, a prefetch
    # list), async_op or a device, the prefetches, frozen parameters' watch.
    # The post-backward runs from the engine group's arrivals, one sequence
    # in C too ([Note: post-backward sequence] there).

    # the pre-forward's steps that need Python (its sequence: _events)

    def _begin_forward(self, args, kwargs):
        """Lazy init, the root's start of forward, the forward order's
        record, the input cast: (args, kwargs) cast, or None."""
        self.lazy_init()
        root = self.root or self
        if self.is_root:
            finalize.check_forward(self)
            with observe.span("FSDP::root_pre_forward"):
                ev, self.post_optim_event = self.post_optim_event, None
                if ev is not None:
                    ev.synchronize()
                self.tree.order.begin()
                self.prefetched = []
        self.next_state = root.tree.order.record(self)
        if self.mp.cast_forward_inputs and self.mp.param_dtype is not None:
            with observe.span("FSDP::cast_forward_inputs"):
                return _cast(self.mp.param_dtype, (args, kwargs))
        return None

    def _gather_forward(self):
        """The gather with gather-ahead's or the prefetch list's states
        joined (their groups' all-gather one), or as async_op."""
        root = self.root or self
        along = self.forward_prefetch
        if along is None:  # none set: on a host Comm, the next states' gathers join
            along = root.gather_ahead(self, 1)
            if along:
                root.prefetched += along  # resharded after forward if they did not run
        self._unshard_and_wait(along)

    def _watch_forward(self, args, kwargs):
        """Frozen parameters, or a group reducing unused ones: this
        forward's inputs watched ([Note: frozen parameters]); (args, kwargs)
        to use, or None."""
        self.watching = None
        if not torch.is_grad_enabled():
            return None
        return self._watch_inputs(args, kwargs)

    def _prefetch_forward(self):
        """The user's forward prefetch list, or on a device the implicit one."""
        if self.forward_prefetch is not None:
            self._prefetch(self.forward_prefetch, "forward")
        elif self.next_state is not None:
            states = self._implicit(self.next_state)
            if states:
                root = self.root or self
                root.prefetched += [st for st in states if not st.group.is_unsharded]
                self._prefetch(states, "forward")

    # the post-forward's steps that need Python (its sequence: _events)

    def _reshard_post_forward(self):
        """An int reshard_after_forward's chunk kept, or (an extension's free
        with it) the whole reshard."""
        raf = self.reshard_after_forward
        if isinstance(raf, int) and not isinstance(raf, bool):
            self.group.reshard_to_post_forward()
        else:
            self.reshard()

    def _end_forward(self):
        """The root's end of forward: keep the forward's order; reshard the
        prefetched states that did not run."""
        self.tree.order.end()
        for st in self.prefetched:
            if not self.tree.order.ran(st) and st.reshard_after_forward is not False:
                st.reshard()
        self.prefetched = []

    def _take_watching(self):
        """Frozen parameters: this forward's _Forward (the outputs'
        pre-backward hook), or None where none watched the inputs."""
        fwd, self.watching = self.watching, None
        return fwd

    def _cast_output(self, output):
        with observe.span("FSDP::cast_forward_outputs"):
            noop_mp.output(self, self.mp.output_dtype, output)  # its first forward only
            return _cast(self.mp.output_dtype, output)

    # ------------------------------------------------------------------
    # backward

    # the pre-backward's steps that need Python (its sequence: _events)

    def _gather_backward(self):
        """The gather again, with gather-ahead or the prefetch list's states
        joined, or as async_op."""
        along = self.backward_prefetch
        root = self.root or self
        self._unshard_and_wait(root.gather_ahead(self, -1) if along is None else along)

    def _prefetch_backward(self):
        """The user's backward prefetch list, or a device's implicit one."""
        if self.backward_prefetch is not None:
            self._prefetch(self.backward_prefetch, "backward")
        else:
            root = self.root or self
            self._prefetch(self._implicit(root.tree.order.previous(self)), "backward")

    # [Note: frozen parameters] A group's post-backward runs when its trainable
    # parameters' gradients have arrived. A frozen parameter used before a
    # trainable one in forward (a frozen layer under a trained adapter or
    # head) is read again later in backward, for the gradient of its input:
    # resharding at the post-backward would free it first. So where a group
    # has frozen parameters, each forward's inputs that require grad pass
    # through _InputsDone, whose backward runs once the module's backward has
    # reached them (torch's fully_shard hooks every group's inputs so), and
    # that forward's outputs get its _Forward as their pre-backward hook. The
    # reduction is not delayed, only the reshard: while this backward has
    # reached the outputs of a forward and not yet its inputs (else at the
    # end of backward). Each forward counts on its own, in the backward that
    # runs through it: two forwards before two backwards, or a forward whose
    # graph is dropped unused, hold back no other backward's reshard. A group
    # without frozen parameters pays nothing.

    def _watch_inputs(self, args, kwargs):
        tensors = grad_tensors((args, kwargs))
        if not tensors:  # nothing upstream: a frozen use needs no gradient
            return args, kwargs
        self.watching = _Forward(self)
        out = iter(_InputsDone.apply(self.watching, *tensors))
        ids = {id(t) for t in tensors}
        return map_tensors(lambda t: next(out) if id(t) in ids else t, (args, kwargs))

    def forget_held_reshard(self):
        """The end of a backward (or of a failed one): no forward's inputs are
        awaited any more, no reshard is held back for them."""
        self.reading.clear()
        self.reshard_due = False

    # the post-backward's steps that need Python (its sequence: C's, [Note:
    # post-backward sequence] in csrc/hooks/shard_events.c), each given the
    # state by the engine group (it holds the state weakly)

    def _accumulate_grads(self):
        """This backward's gradients added to the sums kept without sync, in
        torch's range where this torch has it."""
        with (self._span("FSDP::post_backward_accumulate")
              if torch_facts.post_backward_accumulate_range() else observe.NOTHING):
            self.group.accumulate_unsharded_grads()  # (torch 2.15's autograd: no range)

    def _reduce_grads(self):
        """The reduction where C's does not apply: torch's ranges and
        CommDebugMode's counts, the reduction in flight landed first (a
        device's), the bucket, resharding in the same call unless a frozen
        parameter may still be read."""
        g, root = self.group, self.root or self
        # the previous group's, before this one is issued (torch labels its
        # wait "(fqn)" even for the root's empty fqn)
        with (observe.span("FSDP::post_backward_rs_wait (", self.fqn, ")")
              if root.tree.reduced else observe.NOTHING):
            root.finish_reducing()
        with observe.counted_span(_issued, g, g.comm, "FSDP::post_backward_reduce", self.label):
            if g.reduce_grads(defer=True, bucket=root.tree.bucket,
                              reshard=self.reshard_after_backward and not self.reading):
                root.tree.inflight.issued(self, g.finish_reduce)
        root.tree.reduced = True

    def _reshard_after_backward(self):
        """The reshard where C's does not apply: held while a frozen
        parameter may still be read, an extension's free with it."""
        if self.reading:
            self.reshard_due = True
        else:
            self.group.reshard()

    def _keep_unsynced(self):
        """No gradient sync: the gradients kept as reduce-dtype sums."""
        self.group.to_accumulated_grads()

    def finish_reducing(self):
        """Root only: land the reduction left in flight, if any."""
        if self.tree is not None:
            self.tree.inflight.land()

    @eager.hook
    def _finalize(self):
        """Root only, once the autograd engine is done with this backward
        (roots.end_of_backward)."""
        roots.end_of_backward(self)
