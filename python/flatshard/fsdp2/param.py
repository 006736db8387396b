"""One fully_shard group: its parameters as dim-0 DTensor shards, gathered
and reduced by the engine's group (flatshard._C.ShardGroup, csrc/engine/shard_group.h).

The engine owns the layout (csrc/core/layout.h, DIM0: parameter i cut on its
shard dim, dim 0 or the one shard_placement_fn chose, into chunks of
ceil(size / world) rows, torch.chunk's rule, which is also DTensor's
Shard(d) rule), the all-gather with its copy-in and copy-out, the
reduce-scatter with its copy-in, the replicas' all-reduce, the scale and the
sharded gradients. This file keeps what only torch can do: the DTensor
shards and their registration, the unsharded parameters as views of the
engine's buffer, and the gradients torch hands over.

The unsharded parameters are leaf nn.Parameters that alias one flat buffer
per group. Resharding frees that buffer's storage and unsharding refills it
in place, so tensors autograd saved in forward see the data again in
backward. As in torch's fully_shard, the modules hold the unsharded
parameters (plain nn.Parameters) from unshard to reshard and the DTensor
shards otherwise; what was assigned to them meanwhile (load_state_dict with
assign=True, set_model_state_dict on a meta model, a cast) is adopted as the
new shards before the next gather.

ParamGroup is written in three files, one concern each: this one builds the
engine group and gathers and reshards; sharded.py (ShardedParams) holds the
sharded DTensor parameters and adopts what was assigned to the modules;
group_grads.py (GroupGrads) takes the gradients torch hands over and has
them reduced.
"""
import itertools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from .. import _C, torch_facts
from ..errors import NotBuiltError, is_alloc_failure
from ..options import quant_engine_args
from ..runtime.comm import custom_comm
from ..runtime.device import empty_fn
from ..runtime.grad_hooks import run_hooks
from ..tensors import (DTYPE_CODES, check_plain, compute_dtype, dtype_code, is_plain,
                       reduce_dtype)
from . import tp
from .extension import Extension, gathers_itself, has_extension
from .group_grads import GroupGrads
from .sharded import ShardedParams, _contiguous_stride, _empty_shard, _like, _new_dtensor, _uid


class ParamGroup(ShardedParams, GroupGrads):
    """params: unique parameters of one dtype (registration order);
    aliases[i]: every (module, attr) where params[i] is registered."""

    def __init__(self, params, aliases, mesh, comm, replicate_comm, mp_policy, names=None,
                 shard_dims=None, spmd=None, overrides=None):
        self.mesh = mesh
        # (each alias's module _parameters dict, name, parameter index), first
        # aliases first: what the engine group's registration stores into
        # ([Note: registration in C], csrc/hooks/params.h)
        self.slots = [(m._parameters, attr, i) for i, al in enumerate(aliases) for m, attr in al]
        # each parameter's param_dtype_override_fn answer (torch 2.15), or None
        self.overrides = list(overrides) if overrides is not None else [None] * len(params)
        self.comm = comm                 # flatshard Comm of the shard dim (the mesh's last)
        self.replicate_comm = replicate_comm  # HSDP: Comm of the replicate dim, else None
        # each parameter's shard dim (Shard(d) from shard_placement_fn; 0 by default)
        self.shard_dims = list(shard_dims) if shard_dims is not None else [0] * len(params)
        self.placements = [([Replicate()] if replicate_comm is not None else []) + [Shard(d)]
                           for d in self.shard_dims]
        self.aliases = aliases
        self.world = comm.world_size
        self.rank = comm.rank
        self.mp = mp_policy
        # DTensor parameters (tensor parallel): the engine sees their local
        # tensors, the shards are DTensors on the joined mesh (tp.py)
        label = names or [str(i) for i in range(len(params))]
        self.tp = {i: tp.spmd_spec(p, spmd, self.shard_dims[i], label[i]) if spmd is not None
                   else tp.tp_spec(p, mesh, self.shard_dims[i], replicate_comm is not None,
                                   label[i])
                   for i, p in enumerate(params) if isinstance(p, DTensor)}
        self.global_shapes = [p.shape for p in params]
        self.shapes = [p._local_tensor.shape if i in self.tp else p.shape
                       for i, p in enumerate(params)]
        # the mesh and placements of each sharded parameter
        self.meshes = [self.tp[i].mesh if i in self.tp else mesh for i in range(len(params))]
        for i, t in self.tp.items():
            self.placements[i] = list(t.placements)
        self.label = ",".join(names) if names else "fully_shard"
        self.names = names or [str(i) for i in range(len(params))]
        # Parameters whose class all-gathers for itself (extension.py), or
        # a subclass's that may once its local tensor is given the methods:
        # no room in the gather block nor in the unsharded buffer, but their
        # gradients take the reduce-scatter with the rest.
        self.gathered = [not gathers_itself(p) for p in params]
        self.c = None
        # The reduction's settings, handed to the engine group when they
        # change (_reduce_options, [Note: post-backward in C]): the divide
        # factor (set_gradient_divide_factor: None, the engine's rule),
        # force_sum (set_force_sum_reduction_for_comms), reduce_unused
        # (set_reduce_scatter_unused_params: trainable parameters without a
        # gradient take zeros in the reduce-scatter and get its result),
        # all_reduce (set_requires_all_reduce(False) on HSDP: reduce-scatter
        # only, into the engine's partial sum, until a backward that
        # all-reduces) and all_reduce_hook (set_all_reduce_hook: (hook,
        # stream) run on the reduce output).
        self._options = {"divide_factor": None, "force_sum": False, "reduce_unused": False,
                         "all_reduce": True, "all_reduce_hook": None}
        self.count_base = {}   # collectives (and copied bytes) of engine groups replaced
        self.keep_storage = False  # set_keep_unsharded_storage ([Note: kept storage])
        self.comm_quant = None  # FSDPModule.set_comm_quant: a CommQuant, or None
        # The state's events ([Note: event sequences] in
        # csrc/hooks/shard_events.c): its _C.Event hooks, the post-backward
        # the engine group's arrivals fall back on (the state, weakly; its
        # post-backward's steps; what watches), and what the post-backward
        # does (FSDPState.hand_options): handed to every engine group made.
        self.events = ()
        self.post_backward = None
        self.owner = None  # the state, weakly (attach): its flags follow `ext`
        self._plain = 0
        self._accumulated = ()
        self.check_grad_dtypes(params)
        self._build_engine(params[0].dtype, params[0].device)
        self.ext = {i: Extension(p, self.names[i], aliases[i][0][0], mp_policy,
                                 self.entries[i].chunk_rows)
                    for i, p in enumerate(params) if not self.gathered[i]}
        self.full = None       # flat unsharded buffer (compute dtype), made at first unshard
        self.unsharded = None  # its per-parameter leaf Parameters
        # [Note: accumulation dtype] Without gradient sync, unreduced gradients
        # are summed in the reduce dtype, as torch's fully_shard does: with
        # reduce_dtype=float32 under bf16 param_dtype in float32 (bf16 sums
        # would lose bits every microbatch); with reduce_dtype=None the
        # installed torch's rule decides (_build_engine): bf16 sums up to
        # torch 2.14, the parameters' own dtype from 2.15.
        self.accumulated = [None] * len(params)
        # Each original parameter's id for life (torch marks it the same way),
        # so that one tied between two groups is found at lazy init.
        self.uids = [_uid(p) for p in params]
        self.sharded = [self._shard(i, p) for i, p in enumerate(params)]
        for i in self.ext:  # a subclass whose shard lost its class can never gather itself
            if is_plain(self.local(i)) and not has_extension(self.local(i)):
                check_plain(params[i], f"parameter {self.names[i]}", "fully_shard")
        self._shards_to_engine()
        # int reshard_after_forward: after forward keep 1/k of the unsharded buffer,
        # gathered back in backward over a group of k ranks (post_comm).
        self.post_comm = None
        self.post_chunk = None
        self.reducing_hook = None  # the all-reduce hook the reduction left to finish runs
        self.custom = {}       # set_custom_all_gather / _reduce_scatter: kind -> object

    def _build_engine(self, dtype, device, force=False):
        """The engine's group for parameters of `dtype` (its compute and
        reduce dtypes are fixed at construction): made at init, and again
        when a cast changed them (model.to(torch.float64) after fully_shard)
        or the shard group's Comm changed (force)."""
        floating = dtype.is_floating_point
        compute = self._compute_dtype(dtype)
        # [Note: reduce dtype rule] (csrc/core/reduce_rule.h): with
        # reduce_dtype=None the installed torch's rule, over the parameters'
        # accumulation dtypes (their own: one group holds one dtype)
        reduce = reduce_dtype(torch_facts.reduce_dtype_rule(), self.mp.reduce_dtype, compute,
                              [dtype] * len(self.shapes)) if floating else dtype
        self.dtype = dtype
        if self.c is not None and not force and \
                (compute, reduce) == (self.compute_dtype, self.reduce_dtype):
            return
        if self.c is not None:
            for k, v in itertools.chain(self.c.counts.items(), self.c.copied.items()):
                self.count_base[k] = self.count_base.get(k, 0) + v
        self.compute_dtype, self.reduce_dtype = compute, reduce
        align = _C.align_numel(torch.empty((), dtype=compute).element_size())
        # each parameter as (outer, size of the shard dim, inner) for the engine
        views = [(int(torch.Size(s[:d]).numel()), s[d] if len(s) else 1,
                  int(torch.Size(s[d + 1:]).numel())) for s, d in zip(self.shapes, self.shard_dims)]
        self.c = _C.ShardGroup(
            self.label, self.comm, [v[1] for v in views], [v[2] for v in views], self.gathered,
            align, dtype_code(compute), dtype_code(reduce),
            empty=empty_fn(device) if self.comm.device is not None else None,
            replicate=self.replicate_comm, outer=[v[0] for v in views])
        if self.keep_storage:
            self.c.set_keep_storage(True)
        if self.comm_quant is not None:  # a new engine group takes the setting again
            self.c.set_comm_quant(*self.comm_quant.engine_args)
        if self.post_backward is not None:
            self.c.set_post_backward(*self.post_backward)
        for e in self.events:
            e.group = self.c
        self.c.plain = self._plain
        self.c.sums = any(a is not None for a in self._accumulated)
        self.entries = self.c.entries     # this rank's rows of each parameter (layout.c)
        self.offsets = self.c.offsets     # each parameter's start in the unsharded buffer
        self.full_alloc = self.c.full_alloc
        # what one reduction's input takes (a bucket's budget counts it)
        self.reduce_bytes = self.full_alloc * reduce.itemsize

    def _compute_dtype(self, dtype):
        """The group's one compute dtype for parameters of `dtype`
        (tensors.compute_dtype, each parameter's param_dtype_override_fn
        answer included). The engine's group gathers into one buffer of one
        dtype: parameters that the override keeps in their own dtype beside
        others cast to param_dtype are refused, naming them."""
        mine = [compute_dtype(self.mp.param_dtype, dtype, o) for o in self.overrides]
        if len(set(mine)) > 1:
            kept = [n for n, c in zip(self.names, mine) if c != self.mp.param_dtype]
            cast = [n for n, c in zip(self.names, mine) if c == self.mp.param_dtype]
            raise NotBuiltError(
                f"flatshard: fully_shard: mp_policy.param_dtype_override_fn keeps "
                f"{', '.join(kept)} in {dtype} and leaves {', '.join(cast)} in param_dtype "
                f"{self.mp.param_dtype}; one fully_shard group gathers in one dtype, so a group "
                "of both is not built. Apply fully_shard to the modules holding the kept "
                "parameters first (each its own group, e.g. fully_shard(block.norm, "
                "mp_policy=...)), then to the module around them")
        return mine[0] if mine else compute_dtype(self.mp.param_dtype, dtype)

    def check_grad_dtypes(self, params=None):
        """A grad_dtype set by hand on a parameter (or, before the first
        forward, on its shard) is its accumulation and reduce dtype under
        torch 2.15's rule ([Note: reduce dtype rule]); flatshard does not
        build that yet, and refuses it rather than reduce in another dtype."""
        for name, p in zip(self.names, params if params is not None else self.sharded):
            if torch_facts.has_grad_dtype_override(p):
                raise NotBuiltError(
                    f"flatshard: fully_shard: parameter {name} has grad_dtype={p.grad_dtype} "
                    "set, which torch's fully_shard takes as the dtype its gradients "
                    "accumulate and reduce in; flatshard does not build a grad_dtype of a "
                    "parameter's own yet. Leave grad_dtype unset and set "
                    "MixedPrecisionPolicy(reduce_dtype=...) for the group instead")

    # the registration (the engine group's: [Note: registration in C])
    registered_unsharded = property(lambda self: self.c.registered == 2)
    # trainable parameters at the last unshard: the gradient hooks that fire in this backward
    trainable = property(lambda self: self.c.trainable)

    # the engine's counts
    is_unsharded = property(lambda self: self.c.is_unsharded)
    pending = property(lambda self: True if self.c.gather_pending else None)
    n_all_gathers = property(lambda self: self._count("all_gather"))
    n_post_gathers = property(lambda self: self._count("post_gather"))
    n_reduce_scatters = property(lambda self: self._count("reduce"))
    n_deferred = property(lambda self: self._count("deferred_gather"))
    n_deferred_reduces = property(lambda self: self._count("deferred_reduce"))

    def rename(self, label):
        """The group's name in the ledger and in errors from now on (the
        module's path, once the root knows it; until then its parameters')."""
        self.label = label
        self.c.name = label

    def _count(self, kind):
        return self.c.counts[kind] + self.count_base.get(kind, 0)

    def sent_bytes(self, kind):
        """Bytes this group's collectives sent so far: "gather" or "reduce"
        (csrc/engine/engine.h, [Note: bytes sent])."""
        return self._count(f"sent_{kind}_bytes")

    def copied_bytes(self):
        """Bytes the engine's copies wrote for this group so far, by kind
        (copy_in, copy_out, reduce_in, reduce_out, cast: csrc/engine/shard_group.h,
        [Note: copy counts])."""
        return {k: v + self.count_base.get(k, 0) for k, v in self.c.copied.items()}

    # ------------------------------------------------------------------
    # the engine group's view of the shards

    def _shards_to_engine(self):
        locals_ = [self.local(i).detach() for i in range(len(self.sharded))]
        for i, t in enumerate(locals_):
            if not t.is_contiguous():  # the engine reads rows as one range
                with torch.no_grad():
                    self.sharded[i]._local_tensor = t = t.contiguous()
                locals_[i] = t
        self.c.set_shards(locals_, [dtype_code(t.dtype) for t in locals_])
        # what the engine reads, to see later whether the module swapped it
        self.engine_locals = [self.local(i) for i in range(len(self.sharded))]
        self.c.set_params(self.slots, self.sharded, self.engine_locals,
                          [g and is_plain(t) for g, t in zip(self.gathered, self.engine_locals)])
        # what reduce_grads reads ([Note: post-backward in C], csrc/hooks/grads.h)
        specs = [sp._spec if sp._local_tensor.dtype == sp._spec.tensor_meta.dtype else None
                 for sp in self.sharded]
        self.c.set_grads(DTYPE_CODES, torch.Tensor, specs, _new_dtensor, DTensor, _like,
                         _empty_shard, run_hooks)
        self._reduce_options()

    def _reduce_options(self):
        o = self._options
        partial = self.replicate_comm is not None and not o["all_reduce"]
        factor = o["divide_factor"]
        self.c.set_reduce_options(float(factor) if factor is not None else 0.0, o["force_sum"],
                                  not partial, o["all_reduce_hook"] is not None,
                                  o["reduce_unused"])

    def _option(name):
        def set_(self, value):
            self._options[name] = value
            self._reduce_options()
        return property(lambda self: self._options[name], set_)

    divide_factor = _option("divide_factor")
    force_sum = _option("force_sum")
    reduce_unused = _option("reduce_unused")
    all_reduce = _option("all_reduce")
    all_reduce_hook = _option("all_reduce_hook")
    del _option

    def attach(self, owner, steps, watch):
        """The state (a weak reference) whose post-backward's Python steps,
        each step(state), the engine group's sequence calls where they
        apply, and the callables that say a profiler or mode watches ([Note:
        post-backward sequence] in csrc/hooks/shard_events.c)."""
        self.owner = owner
        self.post_backward = (owner, steps, watch)
        self.c.set_post_backward(*self.post_backward)

    @property
    def ext(self):
        """The extension parameters: index -> Extension (extension.py)."""
        return self._ext

    @ext.setter
    def ext(self, value):
        self._ext = value
        # The state's events' options were handed for the extension
        # parameters there were (FSDPState.hand_options: Python's reshard
        # with one), and the post-forward's reshard and the plain
        # post-backward in C free without an extension's free
        # (Extension.free): a weight given the extension after lazy init
        # (refresh_sharded) would keep its gathered tensors.
        st = self.owner() if self.owner is not None else None
        if st is not None:
            st.hand_options()

    @property
    def plain(self):
        """What the state's post-backward does: _C.PB_* flags (its
        FSDPState.hand_options decides)."""
        return self._plain

    @plain.setter
    def plain(self, value):
        self._plain = self.c.plain = value

    @property
    def accumulated(self):
        """Each parameter's reduce-dtype sum of backwards without sync, or
        None ([Note: accumulation dtype]); a new list is assigned whenever
        one changes, so that the engine group knows whether any is kept."""
        return self._accumulated

    @accumulated.setter
    def accumulated(self, sums):
        self._accumulated = sums
        self.c.sums = any(a is not None for a in sums)

    def set_comm_quant(self, quant):
        """The engine group's gathers and reductions quantized as `quant`
        (a CommQuant, or None: off) says, from the next one on."""
        self.c.set_comm_quant(*quant_engine_args(quant))
        self.comm_quant = quant

    def set_custom(self, kind, obj):
        """The shard group's all-gathers ("all_gather") or reduce-scatters
        ("reduce_scatter") call `obj` (torch's AllGather / ReduceScatter):
        a new engine group over a Comm that calls it (runtime/comm.py)."""
        self.custom[kind] = obj
        self.wait_unsharded()
        if self.c.is_unsharded:
            self.reshard()
        group = self.mesh.get_group(self.mesh.ndim - 1)
        self.comm = custom_comm(group, self.custom.get("all_gather"),
                                self.custom.get("reduce_scatter"), self.reduce_dtype)
        self._build_engine(self.dtype, self.local(0).device, force=True)
        self._shards_to_engine()
        self.full, self.unsharded = None, None
        for x in self.ext.values():
            x.reset()

    # ------------------------------------------------------------------
    # unshard / reshard

    def _make_full(self):
        """The unsharded parameters: views of the flat buffer, or where the
        engine says the shards are the unsharded parameters (one rank, the
        compute dtype: csrc/engine/shard_group.h, [Note: direct layout]) views of
        the shards, the buffer then never filled."""
        device = self.local(0).device
        try:
            self.full = torch.empty(self.full_alloc, dtype=self.compute_dtype, device=device)
        except (RuntimeError, MemoryError) as e:
            if is_alloc_failure(e):  # the peers' gathers fail at once with it
                self.c.tell_out_of_memory("unshard", str(e).splitlines()[0])
            raise
        aliased = self.c.aliased
        # [Note: reduce dtype rule] torch 2.15's rule also gives each unsharded
        # parameter grad_dtype = its reduce dtype; where the gradient may be
        # summed outside the data-parallel dims first (tp.reduces_outside_dp)
        # autograd's cast to it comes before that sum, which then runs in the
        # reduce dtype (and so does an accumulation without sync, on the
        # leaf). Elsewhere the engine's cast at the reduce-scatter does the same.
        grad_dtype_leaves = {i for i, t in self.tp.items() if tp.reduces_outside_dp(t)} \
            if torch_facts.reduce_dtype_rule() == "grad_dtype" and \
            self.reduce_dtype != self.compute_dtype else ()
        self.unsharded = []
        for i, (off, shape, sp) in enumerate(zip(self.offsets, self.shapes, self.sharded)):
            if i in self.ext:  # made by its class at the first gather
                self.unsharded.append(None)
                continue
            n = int(torch.Size(shape).numel())
            view = self.local(i).view(shape) if aliased else \
                self.full.narrow(0, off, n).view(shape)
            if i in self.tp:  # the module computes on it as the DTensor it was
                view = tp.unsharded(view, self.tp[i])
            up = nn.Parameter(view, requires_grad=sp.requires_grad)
            if i in grad_dtype_leaves:
                up.grad_dtype = self.reduce_dtype
            self.unsharded.append(up)
        self.full.untyped_storage().resize_(0)
        self.c.set_full(self.full)
        self.c.set_unsharded(self.unsharded)

    def unshard(self, defer=False, along=()):
        """Gather the group (the engine's one all-gather with its copy-in and
        copy-out). defer (a prefetch): on a device Comm the caller's stream
        does not wait for the all-gather; the copy-out waits for it at
        wait_unsharded() (the next unshard, reshard, or the module's own
        forward). along: other groups on this host Comm, none gathered, none
        with an extension parameter or a post-forward chunk, gathered in the
        same all-gather (FSDPState.unshard picks them)."""
        if self.c.is_unsharded:  # a pending gather is waited for, unless this is a prefetch too
            if not defer:
                self.wait_unsharded()
            return
        if self.full is None:
            self._make_full()
        if self.post_chunk is not None:  # the smaller group holds it all: gather from there
            self.c.unshard_from(self.post_comm, self.post_chunk)
            self.post_chunk = None
            self.c.register_unsharded()
            return
        if self.ext:
            self._unshard_extensions()
        if along:
            for a in along:
                if a.full is None:
                    a._make_full()
            self.c.unshard(along=tuple(a.c for a in along))
            for a in along:
                a.c.register_unsharded()
        else:
            self.c.unshard(defer)
        self.c.register_unsharded()

    def _unshard_extensions(self):
        """Each extension parameter's own all-gather and rebuild (done at
        once, also on a device: the class's Python runs on the result)."""
        for i, x in self.ext.items():
            self.unsharded[i] = x.gather(
                self.comm, self.local(i), self._shard_mesh(), self.shapes[i],
                _contiguous_stride(self.shapes[i]), self.compute_dtype,
                self.sharded[i].requires_grad)
        self.c.set_unsharded(self.unsharded)

    def _shard_mesh(self):
        """The mesh of the shard dimension (torch passes it to the class)."""
        if self.mesh.ndim == 1:
            return self.mesh
        return self.mesh[self.mesh.mesh_dim_names[-1]]

    def wait_unsharded(self):
        """A deferred all-gather: the caller's stream waits for it, then the
        copy-out into the unsharded buffer is enqueued after it."""
        self.c.wait()

    def n_trainable(self):
        return sum(p.requires_grad for p in self.sharded)

    def set_keep_storage(self, keep):
        """Reshards keep (True) or free the unsharded storage from now on
        (csrc/engine/shard_group.h, [Note: kept storage])."""
        self.keep_storage = keep
        self.c.set_keep_storage(keep)

    def reshard(self):
        self.c.register_sharded()
        self.post_chunk = None
        if self.c.is_unsharded:
            self.c.reshard()  # a pending gather is waited for first
            if self.ext:
                for x in self.ext.values():
                    x.free()

    def reshard_to_post_forward(self):
        """Keep this rank's 1/k of the unsharded buffer (k: the post-forward
        group's size) and free the rest."""
        if not self.c.is_unsharded:
            return
        if self.c.aliased:  # the shards are the unsharded parameters: nothing to keep
            self.reshard()
            return
        self.wait_unsharded()
        keep = _C.layout_dim0_post_chunk(self.full_alloc, self.post_comm.world_size,
                                         self.post_comm.rank)
        chunk = self.full[keep].clone()
        self.reshard()
        self.post_chunk = chunk
