"""One flat group: the parameters of a unit that share (dtype, requires_grad),
laid out by the C layout code (csrc/core/layout.c) and copied in by C.

Vocabulary (FSDP2's): the *shard* is this rank's slice of the flat buffer,
kept between steps; the *full* buffer is the unsharded flat buffer, whose
storage is live only while the unit is unsharded. Under NO_SHARD the full
buffer shares the shard's storage.

Alignment: every parameter starts at a multiple of layout.h's FS_ALIGN_BYTES (_C.align_numel),
and every shard is a multiple of it too, so each parameter's view and each
rank's shard are 16-byte aligned (vector loads, and what NCCL prefers).
"""
import torch
import torch.nn as nn
from torch.distributed.fsdp import FlatParameter

from .. import _C
from ..tensors import dtype_code, reduce_dtype as rule_reduce_dtype

FLAT_PARAM = "_flat_param"


def mark_flat_param(shard, fqns, shapes, numels):
    """Make `isinstance(shard, FlatParameter)` true, for torch's class (which
    flatshard re-exports): its isinstance check reads `_is_flat_param`.
    Also torch's `_fqns`, `_shapes` and `_numels`: the original parameters'
    names (relative to the unit's module), shapes and sizes, which scripts
    read to map a flat parameter back to its parameters."""
    shard._is_flat_param = True
    shard._fqns = tuple(fqns)
    shard._shapes = tuple(shapes)
    shard._numels = tuple(numels)


def flat_param_name(index):
    """The name the flat shard of group `index` is registered under on the
    wrapped module (use_orig_params=False): _flat_param, _flat_param_1, ..."""
    return FLAT_PARAM if index == 0 else f"{FLAT_PARAM}_{index}"


def gathered_buffers(groups):
    """The gathered buffers of a unit's flat groups (full, and lp under mixed
    precision) that are live now; not the full buffer of NO_SHARD, which is
    the shard itself."""
    return [t for g in groups for t in (g.full, g.lp) if t is not None and
            t.untyped_storage().data_ptr() != g.shard.untyped_storage().data_ptr()]


class Alias:
    """One place a parameter is registered: module.<attr>, path fqn."""
    __slots__ = ("module", "attr", "fqn")

    def __init__(self, module, attr, fqn):
        self.module, self.attr, self.fqn = module, attr, fqn


class FlatGroup:
    def __init__(self, index, params, aliases, world_size, rank, shard_world, device,
                 param_dtype=None, reduce_dtype=None, host_shards=False, replicated=False):
        """params: unique nn.Parameters (same dtype and requires_grad), in
        registration order; aliases[i]: every Alias of params[i].
        shard_world is world_size, or 1 under NO_SHARD (nothing sharded).
        param_dtype/reduce_dtype: mixed precision (compute and gradient
        reduction dtypes; None keeps the parameters' dtype). host_shards:
        CPUOffload on a device: the shard (and its gradients) in host memory,
        pinned where a GPU is present; the unsharded buffers on `device`.
        replicated: NO_SHARD, whose full buffer is the shard itself (also
        under mixed precision, where only `lp` is made and freed)."""
        self.index = index
        self.params = params
        self.aliases = aliases
        self.dtype = params[0].dtype
        self.requires_grad = params[0].requires_grad
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        code = dtype_code(self.dtype)
        align = _C.align_numel(params[0].element_size())
        srank = rank if shard_world > 1 else 0
        layout, entries = _C.layout_flat(self.numels, shard_world, srank, align)
        self.shard_numel = layout.shard_numel
        self.padded_numel = layout.padded_numel
        self.unpadded_numel = layout.unpadded_numel
        self.entries = entries  # [_C.FlatEntry] (csrc/core/layout.h)

        # The shard is the optimizer-visible parameter when use_orig_params=False.
        self.shard_device = torch.device("cpu") if host_shards else device
        self.pinned = host_shards and torch.cuda.is_available()
        self.shard = nn.Parameter(self.new_shard(), requires_grad=self.requires_grad)
        with torch.no_grad():
            srcs = [p.detach().contiguous() for p in params]
            if self.shard.device.type == "cpu" and all(s.device.type == "cpu" for s in srcs):
                pieces = [(s.data_ptr(), code, e.param_offset, e.shard_offset, e.piece_numel)
                          for s, e in zip(srcs, entries) if e.piece_numel > 0]
                _C.gather_pieces(self.shard.data_ptr(), code, self.shard_numel, pieces)
            else:  # device memory: the same pieces, with torch's copies (once, at wrap)
                self.shard.zero_()
                for s, e in zip(srcs, entries):
                    if e.piece_numel > 0:
                        self.shard.narrow(0, e.shard_offset, e.piece_numel).copy_(
                            s.view(-1).narrow(0, e.param_offset, e.piece_numel))
            del srcs
        floating = self.dtype.is_floating_point
        self.compute_dtype = param_dtype if floating and param_dtype else self.dtype
        # FSDP1's rule under every torch ([Note: reduce dtype rule]): unset, the compute dtype
        self.reduce_dtype = rule_reduce_dtype("param_dtype", reduce_dtype, self.compute_dtype) \
            if floating else self.dtype
        mixed = self.compute_dtype != self.dtype
        if replicated:
            # A distinct leaf over the same storage, so that autograd
            # accumulates the local gradient here and not in the shard's .grad.
            self.full = self.shard.detach()
        else:
            self.full = torch.empty(self.padded_numel, dtype=self.dtype, device=device)
            self.full.untyped_storage().resize_(0)
        # [Note: mixed precision] in csrc/engine/unit.h: forward and backward run
        # on `lp`; `full` (full precision) is gathered only for summon/state dicts.
        self.lp = None
        if mixed:
            self.lp = torch.empty(self.padded_numel, dtype=self.compute_dtype, device=device)
            self.lp.untyped_storage().resize_(0)
        self.compute = self.lp if mixed else self.full
        self.compute.requires_grad_(self.requires_grad)
        # Split sizes over the full buffer, alignment gaps included: one
        # split per forward, then a view per parameter.
        sizes, pos = [], 0
        self.view_slots = []
        for e in entries:
            if e.flat_offset > pos:
                sizes.append(e.flat_offset - pos)
            self.view_slots.append(len(sizes))
            sizes.append(e.numel)
            pos = e.flat_offset + e.numel
        if self.padded_numel > pos:
            sizes.append(self.padded_numel - pos)
        self.split_sizes = sizes
        self.flat_shaped = [len(shape) == 1 for shape in self.shapes]
        # where the modules show parameter i: (module __dict__, name, i) per alias
        self.targets = [(a.module.__dict__, a.attr, i)
                        for i, al in enumerate(aliases) for a in al]
        # use_orig_params=True: gradient shard and the views handed out of it.
        self.grad_buf = None
        self.grad_views = None
        # NO_SHARD + param_dtype, use_orig_params=False: views of the full
        # buffer that the modules show outside forward (unit.py, made once).
        self.resting_views = None
        # SHARD_OPTIM (zero1.py): the whole averaged gradient; the shard's
        # gradient is a view of this rank's slice of it.
        self.whole_grad = None

    def new_shard(self):
        """An uninitialised shard-sized tensor where the shard lives (pinned
        host memory under CPUOffload on a device): for gradients."""
        return torch.empty(self.shard_numel, dtype=self.dtype, device=self.shard_device,
                           pin_memory=self.pinned)

    def unsharded_views(self, buf=None):
        """Views of the compute buffer (full, or lp under mixed precision; or
        `buf`) shaped as the original parameters. Made with autograd on, so
        gradients flow into compute.grad."""
        chunks = torch.split_with_sizes(self.compute if buf is None else buf, self.split_sizes)
        # a 1-D parameter's chunk is already its view: no view node for backward
        return [chunks[s] if flat else chunks[s].view(shape)
                for s, shape, flat in zip(self.view_slots, self.shapes, self.flat_shaped)]

    def piece(self, tensor, i, shaped):
        """Parameter i's piece of a shard-sized tensor (1-D, or its original
        shape when the whole parameter is local: NO_SHARD)."""
        e = self.entries[i]
        v = tensor.narrow(0, e.shard_offset, e.piece_numel)
        return v.view(self.shapes[i]) if shaped else v
