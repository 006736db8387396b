"""The sharded parameters of a fully_shard group (ShardedParams, a part of
fsdp2/param.py's ParamGroup): each parameter's dim-0 DTensor shard as
torch's fully_shard makes it, and what a user assigned to the modules since
(load_state_dict(assign=True), to_empty(), a cast, `param.data = ...`)
adopted as the new shards before the next gather ([Note: registration in
C], csrc/hooks/params.h). Reads the group's layout and options
(entries, shard_dims, meshes, placements, tp, ext), which param.py sets.
"""
import itertools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..errors import ConfigError, NotBuiltError
from ..tensors import is_plain
from .extension import Extension, has_extension


class ShardedParams:
    """The sharded DTensor parameters of a ParamGroup (param.py)."""

    def _shard(self, i, p):
        e = self.entries[i]
        with torch.no_grad():
            if i in self.ext:  # torch's way: rows of a zero-padded chunk, as the class expects
                padded = p.detach().new_zeros((e.chunk_rows, *p.shape[1:]))
                padded[:e.local_rows].copy_(
                    p.detach()[e.local_row_begin:e.local_row_begin + e.local_rows])
                local = padded.narrow(0, 0, e.local_rows)
            else:
                whole = p._local_tensor if i in self.tp else p
                local = whole.detach().narrow(self.shard_dims[i], e.local_row_begin,
                                              e.local_rows).clone(
                                                  memory_format=torch.contiguous_format)
        shape = self.global_shapes[i]
        d = DTensor.from_local(local, self.meshes[i], self.placements[i], run_check=False,
                               shape=shape, stride=_contiguous_stride(shape))
        return nn.Parameter(d, requires_grad=p.requires_grad)

    def local(self, i):
        return self.sharded[i]._local_tensor

    def sync_registered(self, changed=None):
        """Before a gather: adopt what was assigned to the modules since the
        shards were registered (load_state_dict(assign=True),
        set_model_state_dict on a meta model, module.to_empty(), a cast of a
        submodule, `param.data = ...`) as the new shards, as torch's
        fully_shard does; and a local tensor given the all-gather extension
        since (or one that lost it) takes its path from now on, as torch reads
        the extension at every all-gather (extension.py). Returns whether
        anything changed. The engine group's identity tests decide the plain
        case ([Note: registration in C]); what they leave open is decided here.
        changed: the engine group's answer, where the caller asked it already
        (the gather asks it first, without a Python frame when it is 0)."""
        if changed is None:
            changed = self.c.registration_changed()
        if not changed:
            return False
        if changed == 2:  # the same objects: has a local tensor's path changed?
            for local, gathered in zip(self.engine_locals, self.gathered):
                # (a plain local tensor's __dict__ is empty unless it was given attributes)
                if (local.__dict__ or not gathered) and self._own_path(local) == gathered:
                    break
            else:
                return False
        self.refresh_sharded()
        return True

    @staticmethod
    def _own_path(local):
        """Whether a sharded parameter with this local tensor all-gathers
        through the extension (extension.py)."""
        return has_extension(local) or not is_plain(local)

    def refresh_sharded(self):
        """Re-read the registered sharded parameters (after nn.Module._apply:
        to_empty, to, float...; or an assignment): they may be new objects,
        hold new local tensors or have a new dtype (then a new engine group
        for the new compute dtype). Every alias of a parameter gets the one
        registered first (a tie within the group survives assign=True)."""
        self.wait_unsharded()
        if self.c.is_unsharded:
            self.c.reshard()
        new = [self._assigned(i) for i in range(len(self.aliases))]
        dtypes = {p.dtype for p in new}
        if len(dtypes) > 1:
            found = ", ".join(f"{n}: {p.dtype}" for n, p in zip(self.names, new))
            raise ConfigError(
                f"flatshard: fully_shard group {self.label}: its parameters now have several "
                f"dtypes ({found}); one group needs one dtype (FSDP expects uniform original "
                "parameter dtype). Cast the whole FSDP module (module.to(dtype)), not a part")
        self.sharded = new
        device = next((p._local_tensor.device for p in new if not p._local_tensor.is_meta),
                      new[0]._local_tensor.device)
        old = self.reduce_dtype
        gathered = [i in self.tp or not self._own_path(p._local_tensor)
                    for i, p in enumerate(new)]
        switched = gathered != self.gathered
        if switched:  # the engine's group holds the gathered ones' room: a new one
            for i, (now, was) in enumerate(zip(gathered, self.gathered)):
                if was and not now and (self.shard_dims[i] or self.post_comm is not None):
                    why = (f"Shard({self.shard_dims[i]}) (shard_placement_fn)"
                           if self.shard_dims[i] else
                           f"reshard_after_forward={self.post_comm.world_size}")
                    raise NotBuiltError(
                        f"flatshard: fully_shard: parameter {self.names[i]}'s local tensor was "
                        "given fsdp_pre_all_gather / fsdp_post_all_gather after fully_shard, "
                        f"and the parameter is sharded with {why}, which that path does not "
                        "take (dim 0 only, no post-forward group, as in torch): shard it on "
                        "dim 0 with reshard_after_forward True or False")
            self.gathered = gathered
        self._build_engine(new[0].dtype, device, force=switched)
        if switched:
            self.ext = {i: Extension(p._local_tensor, self.names[i], self.aliases[i][0][0],
                                     self.mp, self.entries[i].chunk_rows)
                        for i, p in enumerate(new) if not gathered[i]}
        if self.reduce_dtype != old:
            self.accumulated = [a.to(self.reduce_dtype) if a is not None else None
                                for a in self.accumulated]
        self._shards_to_engine()
        self.c.register_sharded()  # every alias gets the one registered first
        self.full, self.unsharded = None, None
        for x in self.ext.values():
            x.reset()
        self.post_chunk = None

    def _assigned(self, i):
        """The parameter now registered as parameter i, checked to be a shard
        of it as fully_shard made them (mesh, placements, shape, rows)."""
        m, attr = self.aliases[i][0]
        p = m._parameters.get(attr)
        name = self.names[i]
        if not isinstance(p, DTensor):
            what = "removed" if p is None else f"replaced by a {type(p).__name__}"
            raise ConfigError(
                f"flatshard: parameter {name} of a fully_shard module was {what}; a parameter "
                "assigned after fully_shard must be a DTensor sharded as the one it replaces. "
                "Load with load_state_dict(sd, assign=True) where each value is "
                "distribute_tensor(full, model.state_dict()[key].device_mesh, "
                "model.state_dict()[key].placements), or use torch.distributed.checkpoint."
                "state_dict.set_model_state_dict")
        if p.shape != self.global_shapes[i] or p.device_mesh != self.meshes[i] or \
                tuple(p.placements) != tuple(self.placements[i]):
            raise ConfigError(
                f"flatshard: parameter {name} was assigned a DTensor of shape {tuple(p.shape)} "
                f"with placements {tuple(p.placements)} on {p.device_mesh}; fully_shard holds it "
                f"as shape {tuple(self.global_shapes[i])}, placements "
                f"{tuple(self.placements[i])} on {self.meshes[i]}. Distribute the new value to "
                "the old one's mesh and placements")
        rows, d = self.entries[i].local_rows, self.shard_dims[i]
        local = p._local_tensor
        if self.gathered[i] and (local.dim() == 0 or local.shape[d] != rows):
            raise ConfigError(
                f"flatshard: parameter {name} was assigned a DTensor whose local shard has "
                f"shape {tuple(local.shape)}; this rank holds {rows} of its dim {d} (torch."
                f"chunk's rule, Shard({d})). Build it with distribute_tensor or DTensor."
                "from_local of those")
        return p

    # The registration itself is the engine group's ([Note: registration in
    # C]): c.register_sharded() puts the sharded DTensor parameters in the
    # modules (after reshard), c.register_unsharded() the unsharded plain
    # nn.Parameters (between unshard and reshard, as torch's fully_shard
    # registers them), their requires_grad following the sharded parameter's
    # (the user may have changed it). Called directly, without a method here:
    # each is on every gather's and reshard's path.


_UIDS = itertools.count()
# DTensor() also runs DTensor.__init__, a no-op behind Dynamo's disable wrapper
_new_dtensor = DTensor.__new__


def _uid(p):
    """A number that stays with the original parameter object for life."""
    uid = getattr(p, "_flatshard_fsdp2_uid", None)
    if uid is None:
        uid = p._flatshard_fsdp2_uid = next(_UIDS)
    return uid


def _empty_shard(local):
    """A new gradient shard for a local tensor of a subclass: a plain tensor."""
    return torch.empty(local.shape, dtype=local.dtype, device=local.device)


def _like(local, param):
    """A DTensor over `local` with `param`'s mesh, placements and global shape
    (a sharded gradient): built from the parameter's spec directly, as
    torch's fully_shard does, without from_local's per-call checks."""
    spec = param._spec
    if local.dtype == spec.tensor_meta.dtype:  # __new__ builds it whole; __init__ adds nothing
        return _new_dtensor(DTensor, local, spec, requires_grad=False)
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                              shape=spec.shape, stride=spec.stride)


def _contiguous_stride(shape):
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(stride))
