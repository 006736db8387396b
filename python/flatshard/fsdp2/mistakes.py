"""What fully_shard hands flatshard's mistake checks (checks/): its
group's parameters, values and gradient sync, read through their fields.

  compare_init  before the group is built: the ranks' initial values, over
                each dim of the mesh (meta-device, tensor-parallel and
                self-gathering parameters left out)
  built         the group built: the originals it replaced, and on a 2-D
                mesh (or dp_mesh_dims' replicate dim) the replicas it must
                keep equal
  sync_off      set_requires_gradient_sync(False) on these states
"""
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import checks
from ..tensors import is_plain

WRAPPER = "fully_shard"
replicas_every = checks.replicas_every
_SYNC_OFF = checks.Watch(lambda st: st.requires_gradient_sync,
                         lambda st: st.group.sharded if st.group is not None else (),
                         lambda st: st.fqn or type(st.modules[0]).__name__,
                         "set_requires_gradient_sync(False)")


def compare_init(mesh, params, names, spmd, label):
    """label: the modules' classes (the names are relative to them: the
    model around them is not known yet)."""
    if spmd is not None:  # every parameter a DTensor of the full mesh
        return
    named = [(f"{n} (of {label})", p) for p, n in zip(params, names)
             if not p.is_meta and not isinstance(p, DTensor) and is_plain(p)]
    checks.compare_init([mesh.get_group(d) for d in range(mesh.ndim)], named, WRAPPER)


def built(state, params, names, every):
    g = state.group
    if g is None:
        return
    checks.replaced(params, names, WRAPPER, owner=state)
    rc = g.replicate_comm
    if rc is not None and rc.world_size > 1:
        what = "hybrid sharding: the ranks of the mesh's replicate dim hold the same shard"
        checks.watch_replicas(checks.Replicas(
            state, lambda st: st.group.sharded, checks.replicas.sharded_pieces, rc,
            dist.get_process_group_ranks(g.mesh.get_group(0)),
            lambda st: st.fqn or "<root>", what, every, g.local(0).device if g.sharded else None))


def sync_off(states):
    checks.sync_off(states, _SYNC_OFF)
