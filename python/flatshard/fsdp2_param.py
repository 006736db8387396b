"""One fully_shard group: its parameters as dim-0 DTensor shards, one flat
all-gather to unshard them and one reduce-scatter for their gradients.

Layout (csrc/layout.h, DIM0): parameter i is cut on dim 0 into chunks of
ceil(dim0 / world) rows (torch.chunk's rule, which is also DTensor's Shard(0)
rule, so the local tensors are exactly what DTensor expects). A rank's
all-gather input ("block") holds its chunk of every parameter, each padded
to the common row count; the C core copies shards into the block
(dim0_copy_in, casting to the compute dtype) and parameters out of the
gathered blocks (dim0_copy_out). Gradients take the reverse road: every
rank's chunk of each unsharded gradient is copied into its block of the
reduce-scatter input, cast to the reduce dtype, and the C core's
reduce-scatter averages them (SUM then divide in C, on every backend).

On a device Comm (CUDA) the same copies are segment tables for
flatshard.cuda's pack/unpack kernels (one launch per 64 segments, casting on
the way, on the current stream; device.pack runs the same tables on the
host).

The unsharded parameters are leaf nn.Parameters that alias one flat buffer
per group. Resharding frees that buffer's storage (resize to 0) and
unsharding refills it in place, so tensors autograd saved in forward see the
data again in backward.
"""
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from . import _C
from .comm import all_gather_into, all_reduce_, dtype_code, reduce_scatter_into
from .device import pack as device_pack, unpack as device_unpack
from .flat_param import ALIGN_BYTES
from .fsdp2_extension import Extension, has_extension


def _entry_from(entry, local_row_begin):
    """The same entry with another first row: dim0_copy_in reads rows from
    local_row_begin of its source, which is 0 for a rank's own shard."""
    return (entry.dim0, entry.row_numel, entry.chunk_rows, entry.block_offset, local_row_begin,
            entry.local_rows)


def _chunk_segments(tensors, offsets, src, entry, at):
    """Segments writing src (a rank's rows of one parameter, flat) and the
    zero padding of its chunk at `at` (device path of dim0_copy_in)."""
    held, padded = entry.local_rows * entry.row_numel, entry.chunk_rows * entry.row_numel
    if held:
        tensors.append(src)
        offsets.append(at)
    if padded > held:
        tensors.append(padded - held)  # an int: that many zeros
        offsets.append(at + held)


class ParamGroup:
    """params: unique parameters of one dtype (registration order);
    aliases[i]: every (module, attr) where params[i] is registered."""

    def __init__(self, params, aliases, mesh, comm, replicate_comm, mp_policy, names=None):
        self.mesh = mesh
        self.comm = comm                 # flatshard Comm of the shard dim (the mesh's last)
        self.replicate_comm = replicate_comm  # HSDP: Comm of the replicate dim, else None
        self.placements = ([Replicate()] if replicate_comm is not None else []) + [Shard(0)]
        self.aliases = aliases
        self.world = comm.world_size
        self.rank = comm.rank
        self.dtype = params[0].dtype
        self.shapes = [p.shape for p in params]
        floating = self.dtype.is_floating_point
        self.compute_dtype = (mp_policy.param_dtype or self.dtype) if floating else self.dtype
        self.reduce_dtype = (mp_policy.reduce_dtype or self.compute_dtype) if floating \
            else self.dtype
        dim0s = [s[0] for s in self.shapes]
        rows = [int(torch.Size(s[1:]).numel()) for s in self.shapes]
        align = max(1, ALIGN_BYTES // torch.empty((), dtype=self.compute_dtype).element_size())
        # Entries for every rank: the reduce-scatter input holds each rank's block.
        self.rank_entries = []
        for r in range(self.world):
            layout, entries = _C.layout_dim0(dim0s, rows, self.world, r, align)
            self.rank_entries.append(entries)
        self.block_numel = layout.block_numel
        self.entries = self.rank_entries[self.rank]
        # Parameters whose class all-gathers for itself (fsdp2_extension.py):
        # no room in the gather block nor in the unsharded buffer, but their
        # plain gradients take the reduce-scatter with the rest.
        names = names or [str(i) for i in range(len(params))]
        self.ext = {i: Extension(p, names[i], aliases[i][0][0], mp_policy,
                                 self.entries[i].chunk_rows)
                    for i, p in enumerate(params) if has_extension(p)}
        if self.ext:
            layout, self.gather_entries = _C.layout_dim0(
                dim0s, [0 if i in self.ext else r for i, r in enumerate(rows)], self.world,
                self.rank, align)
            self.gather_block_numel = layout.block_numel
        else:
            self.gather_entries, self.gather_block_numel = self.entries, self.block_numel
        # Offsets of each unsharded parameter in the flat unsharded buffer.
        self.offsets, pos = [], 0
        for i, p in enumerate(params):
            self.offsets.append(pos)
            if i not in self.ext:
                pos += -(-p.numel() // align) * align
        self.full_numel = pos
        # Padded so that any divisor of the world can split it (int reshard_after_forward).
        self.full_alloc = -(-pos // (align * self.world)) * align * self.world
        self.full = None       # flat unsharded buffer (compute dtype), made at first unshard
        self.unsharded = None  # its per-parameter leaf Parameters
        self.is_unsharded = False
        self.pending = None    # a deferred all-gather: (mark, its buffers, the copy-out)
        self.n_deferred = 0
        self.reducing = None   # a reduce-scatter to finish: (mark, its buffers, which grads)
        # [Note: accumulation dtype] Without gradient sync, unreduced gradients
        # are summed in the reduce dtype (float32 under bf16 param_dtype), as
        # torch's FSDP2 does: bf16 sums would lose bits every microbatch.
        self.accumulated = [None] * len(params)
        self.n_deferred_reduces = 0
        self.sharded = [self._shard(i, p) for i, p in enumerate(params)]
        self.divide_factor = None
        # int reshard_after_forward: after forward keep 1/k of the unsharded buffer,
        # gathered back in backward over a group of k ranks (post_comm).
        self.post_comm = None
        self.post_chunk = None
        self.n_post_gathers = 0
        self.n_all_gathers = 0
        self.n_reduce_scatters = 0

    # ------------------------------------------------------------------
    # sharded parameters

    def _shard(self, i, p):
        e = self.entries[i]
        with torch.no_grad():
            if i in self.ext:  # torch's way: rows of a zero-padded chunk, as the class expects
                padded = p.detach().new_zeros((e.chunk_rows, *p.shape[1:]))
                padded[:e.local_rows].copy_(
                    p.detach()[e.local_row_begin:e.local_row_begin + e.local_rows])
                local = padded.narrow(0, 0, e.local_rows)
            else:
                local = p.detach()[e.local_row_begin:e.local_row_begin + e.local_rows].clone()
        d = DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                               shape=self.shapes[i], stride=_contiguous_stride(self.shapes[i]))
        return nn.Parameter(d, requires_grad=p.requires_grad)

    def local(self, i):
        return self.sharded[i]._local_tensor

    def refresh_sharded(self):
        """After nn.Module._apply (to_empty, to, float...): re-read the
        registered sharded parameters, which may be new objects."""
        self.wait_unsharded()
        for i, aliases in enumerate(self.aliases):
            m, attr = aliases[0]
            p = m._parameters[attr]
            self.sharded[i] = p
            for m2, a2 in aliases[1:]:
                m2._parameters[a2] = p
        if self.full is not None:
            self.full, self.unsharded = None, None
            self.is_unsharded = False
        for x in self.ext.values():
            x.reset()
        self.post_chunk = None

    def register_sharded(self):
        for p, aliases in zip(self.sharded, self.aliases):
            for m, attr in aliases:
                m._parameters[attr] = p

    # ------------------------------------------------------------------
    # unshard / reshard

    def _make_full(self):
        device = self.local(0).device
        self.full = torch.empty(self.full_alloc, dtype=self.compute_dtype, device=device)
        self.unsharded = []
        for i, (off, shape, sp) in enumerate(zip(self.offsets, self.shapes, self.sharded)):
            if i in self.ext:  # made by its class at the first gather
                self.unsharded.append(None)
                continue
            n = int(torch.Size(shape).numel())
            self.unsharded.append(nn.Parameter(self.full.narrow(0, off, n).view(shape),
                                               requires_grad=sp.requires_grad))
        self.full.untyped_storage().resize_(0)

    def unshard(self, defer=False):
        """One all-gather of every rank's block (the shards cast to the
        compute dtype in C), then each parameter copied out of the gathered
        blocks into the unsharded buffer, also in C. defer (a prefetch): on a
        device Comm the caller's stream does not wait for the all-gather; the
        copy-out waits for it at wait_unsharded() (the next unshard, reshard,
        or the module's own forward)."""
        if self.is_unsharded:  # a pending gather is waited for, unless this is a prefetch too
            if not defer:
                self.wait_unsharded()
            return
        if self.full is None:
            self._make_full()
        es = self.full.element_size()
        self.full.untyped_storage().resize_(self.full_alloc * es)
        if self.post_chunk is not None:  # the smaller group holds it all: gather from there
            all_gather_into(self.post_comm, self.full, self.post_chunk,
                            tag="fully_shard.unshard_post_forward")
            self.post_chunk = None
            self.n_post_gathers += 1
            self.is_unsharded = True
            self.set_views()
            return
        self._unshard_extensions()
        code = dtype_code(self.compute_dtype)
        block = torch.empty(self.gather_block_numel, dtype=self.compute_dtype,
                            device=self.full.device)
        gathered = torch.empty(self.gather_block_numel * self.world, dtype=self.compute_dtype,
                               device=self.full.device)
        if self.comm.device is not None:
            self._unshard_device(block, gathered, defer)
            self.is_unsharded = True
            self.set_views()
            return
        for i, e in enumerate(self.gather_entries):
            if i in self.ext:
                continue
            src = self.local(i).detach().contiguous()
            _C.dim0_copy_in(block.data_ptr(), code, src.data_ptr(), dtype_code(src.dtype),
                            _entry_from(e, 0))
        all_gather_into(self.comm, gathered, block, tag="fully_shard.unshard")
        self.n_all_gathers += 1
        base = self.full.data_ptr()
        for i, e in enumerate(self.gather_entries):
            if i not in self.ext:
                _C.dim0_copy_out(base + self.offsets[i] * es, code, gathered.data_ptr(), code,
                                 self.world, self.gather_block_numel, e)
        self.is_unsharded = True
        self.set_views()

    def _unshard_device(self, block, gathered, defer):
        tensors, offsets = [], []
        for i, e in enumerate(self.gather_entries):
            if i not in self.ext:
                _chunk_segments(tensors, offsets, self.local(i).detach().contiguous().view(-1),
                                e, e.block_offset)
        device_pack(block, tensors, offsets)
        mark = all_gather_into(self.comm, gathered, block, tag="fully_shard.unshard",
                               defer=defer)
        self.n_all_gathers += 1
        outs, offsets = [], []
        for i, e in enumerate(self.gather_entries):
            for r in range(self.world):
                # rank r's rows of parameter i, from layout.c (fs_dim0_rows)
                theirs = self.rank_entries[r][i]
                begin, rows = theirs.local_row_begin, theirs.local_rows
                if rows and i not in self.ext:
                    outs.append(self.full.narrow(0, self.offsets[i] + begin * e.row_numel,
                                                 rows * e.row_numel))
                    offsets.append(r * self.gather_block_numel + e.block_offset)
        if mark is None:
            device_unpack(gathered, outs, offsets)
        else:  # block and gathered live until the caller's stream waited for the gather
            self.pending = (mark, block, gathered, outs, offsets)
            self.n_deferred += 1

    def _unshard_extensions(self):
        """Each extension parameter's own all-gather and rebuild (done at
        once, also on a device: the class's Python runs on the result)."""
        for i, x in self.ext.items():
            self.unsharded[i] = x.gather(
                self.comm, self.local(i), self._shard_mesh(), self.shapes[i],
                _contiguous_stride(self.shapes[i]), self.compute_dtype,
                self.sharded[i].requires_grad)

    def _shard_mesh(self):
        """The mesh of the shard dimension (torch passes it to the class)."""
        if self.mesh.ndim == 1:
            return self.mesh
        return self.mesh[self.mesh.mesh_dim_names[-1]]

    def wait_unsharded(self):
        """A deferred all-gather: the caller's stream waits for it, then the
        copy-out into the unsharded buffer is enqueued after it."""
        if self.pending is None:
            return
        mark, _, gathered, outs, offsets = self.pending
        self.pending = None
        self.comm.wait_mark(mark)
        device_unpack(gathered, outs, offsets)

    def n_trainable(self):
        return sum(p.requires_grad for p in self.sharded)

    def set_views(self):
        """The unsharded parameters shadow the registered (sharded) ones as
        instance attributes: module.weight is the full tensor in forward,
        while named_parameters() keeps giving the DTensors. requires_grad
        follows the sharded parameter's (the user may have changed it)."""
        for up, sp, aliases in zip(self.unsharded, self.sharded, self.aliases):
            if up.requires_grad != sp.requires_grad:
                up.requires_grad_(sp.requires_grad)
            for m, attr in aliases:
                m.__dict__[attr] = up

    def clear_views(self):
        for aliases in self.aliases:
            for m, attr in aliases:
                m.__dict__.pop(attr, None)

    def reshard(self):
        self.wait_unsharded()  # its buffers go back only after the caller's stream waited
        self.clear_views()
        self.post_chunk = None
        if self.is_unsharded:
            self.full.untyped_storage().resize_(0)
            for x in self.ext.values():
                x.free()
            self.is_unsharded = False

    def reshard_to_post_forward(self):
        """Keep this rank's 1/k of the unsharded buffer (k: the post-forward
        group's size) and free the rest."""
        if not self.is_unsharded:
            return
        self.wait_unsharded()
        k = self.post_comm.world_size
        n = self.full_alloc // k
        chunk = self.full.narrow(0, self.post_comm.rank * n, n).clone()
        self.reshard()
        self.post_chunk = chunk

    # ------------------------------------------------------------------
    # gradients

    def has_unsharded_grads(self):
        return self.unsharded is not None and (
            any(p.grad is not None for p in self.unsharded) or
            any(a is not None for a in self.accumulated))

    def accumulate_unsharded_grads(self):
        """Add this backward's gradients onto the reduce-dtype sums kept from
        earlier backwards without sync [Note: accumulation dtype]."""
        for i, p in enumerate(self.unsharded or ()):
            if self.accumulated[i] is not None and p.grad is not None:
                self.accumulated[i] += p.grad
                p.grad = None

    def to_accumulated_grads(self):
        """No sync this time: keep gradients of another dtype than the
        reduce dtype as reduce-dtype sums [Note: accumulation dtype]."""
        for i, p in enumerate(self.unsharded or ()):
            if p.grad is not None and p.grad.dtype != self.reduce_dtype:
                self.accumulated[i] = p.grad.to(self.reduce_dtype)
                p.grad = None

    def reduce_grads(self, defer=False):
        """Reduce-scatter the unsharded gradients (averaged over the data-
        parallel ranks, or divided by the set factor) into the sharded
        parameters' .grad (DTensors), accumulating onto what is there.
        defer: on a device Comm the caller's stream does not wait for the
        reduce-scatter; finish_reduce() (the root calls it before the next
        group's reduction and at the end of backward) waits and lands the
        result. Returns whether one is left to finish."""
        grads = [a if a is not None else p.grad for a, p in zip(self.accumulated, self.unsharded)]
        if all(g is None for g in grads):
            return False
        self.accumulated = [None] * len(grads)
        rdt = self.reduce_dtype
        device = self.full.device
        alloc = torch.empty if all(g is not None for g in grads) else torch.zeros
        rs_in = alloc(self.block_numel * self.world, dtype=rdt, device=device)
        rcode, es = dtype_code(rdt), rs_in.element_size()
        tensors, offsets = [], []
        for i, g in enumerate(grads):
            if g is None:
                continue
            g = g.contiguous()
            for r in range(self.world):
                e = self.rank_entries[r][i]
                if self.comm.device is not None:
                    _chunk_segments(tensors, offsets, g.view(-1).narrow(
                        0, min(e.local_row_begin * e.row_numel, g.numel()),
                        e.local_rows * e.row_numel), e, r * self.block_numel + e.block_offset)
                    continue
                _C.dim0_copy_in(rs_in.data_ptr() + r * self.block_numel * es, rcode,
                                g.data_ptr(), dtype_code(g.dtype), e)
        if tensors:
            device_pack(rs_in, tensors, offsets)
        out = torch.empty(self.block_numel, dtype=rdt, device=device)
        factor = self.divide_factor
        mark = reduce_scatter_into(self.comm, out, rs_in, average=factor is None,
                                   tag="fully_shard.reduce_grad",
                                   defer=defer and self.comm.device is not None)
        self.n_reduce_scatters += 1
        for i, g in enumerate(grads):
            if g is not None:
                self.unsharded[i].grad = None  # packed into rs_in: not needed any more
        self.reducing = (mark, rs_in, out, [g is not None for g in grads])
        if mark is None:
            self.finish_reduce()
            return False
        self.n_deferred_reduces += 1
        return True

    def finish_reduce(self):
        """The second half of reduce_grads: wait for a deferred reduce-scatter,
        then the cross-replica all-reduce, the divide factor, and the sharded
        gradients."""
        if self.reducing is None:
            return
        mark, _, out, has_grad = self.reducing
        self.reducing = None
        self.comm.wait_mark(mark)
        factor = self.divide_factor
        if self.replicate_comm is not None:
            all_reduce_(self.replicate_comm, out, average=factor is None,
                        tag="fully_shard.all_reduce_grad")
        if factor is not None:
            out.div_(factor)
        for i, e in enumerate(self.entries):
            if not has_grad[i]:
                continue
            sp = self.sharded[i]
            local = self.local(i)
            g = out.narrow(0, e.block_offset, e.local_rows * e.row_numel).view(local.shape).to(local.dtype, copy=True)
            if sp.grad is None:
                sp.grad = DTensor.from_local(g, self.mesh, self.placements, run_check=False,
                                             shape=self.shapes[i],
                                             stride=_contiguous_stride(self.shapes[i]))
            else:
                sp.grad._local_tensor.add_(g)


def _contiguous_stride(shape):
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))
