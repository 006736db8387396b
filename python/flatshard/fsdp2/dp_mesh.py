"""fully_shard(dp_mesh_dims=...): torch's way of naming the data-parallel
dimensions of a full SPMD mesh (DataParallelMeshDims: `shard`, and
`replicate` for HSDP) whose parameters are DTensors on it already
(replicated on those dims, placed as the user chose on the others).

resolve() makes torch's checks, then returns the data-parallel mesh that
flatshard's collectives run over (the shard dim, or (replicate, shard)) and
where those dims sit in the full mesh. The parameters then go the way of
tensor-parallel ones (tp.py): their local tensors through the engine, the
shards DTensors on the full mesh with the shard dim's placement replaced, and
from unshard to reshard the parameters as they were, so the model computes
on DTensors, inputs included, as under torch. Replicate names alone are
DDP over that dim: the group shards over a Comm of the rank alone
(runtime/comm.py self_comm) and all-reduces over the replicas. Not built:
several names flattened into one dim, refused with a NotBuiltError naming
dp_mesh_dims.
"""
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from .. import torch_facts
from ..errors import bad_type, bad_value, not_built

DataParallelMeshDims = torch_facts.data_parallel_mesh_dims()
if DataParallelMeshDims is None:  # torch before 2.13 has no dp_mesh_dims: the same dataclass
    @dataclass
    class DataParallelMeshDims:
        """torch 2.13's names of a full SPMD mesh's data-parallel dimensions."""
        shard: "str | tuple[str, ...] | None" = None
        replicate: "str | tuple[str, ...] | None" = None


def _names(v):
    return () if v is None else (v,) if isinstance(v, str) else tuple(v)


@dataclass(frozen=True)
class SPMD:
    """Where the data-parallel dims sit in the full mesh."""
    mesh: object            # the DeviceMesh the parameters are DTensors on
    shard: object           # index of the shard dim, or None (DDP)
    replicate: object       # index of the replicate dim (HSDP), or None


def resolve(mesh, dp_mesh_dims):
    """torch's checks of dp_mesh_dims against `mesh`; -> (the data-parallel
    DeviceMesh: 1-D, or 2-D (replicate, shard); SPMD)."""
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        raise bad_type("dp_mesh_dims", dp_mesh_dims, "a DataParallelMeshDims or None")
    shard, replicate = _names(dp_mesh_dims.shard), _names(dp_mesh_dims.replicate)
    if not shard and not replicate:
        raise bad_value("dp_mesh_dims", dp_mesh_dims, "at least one of shard or replicate must "
                        "be set in dp_mesh_dims")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise bad_type("mesh", mesh, "the full SPMD DeviceMesh that dp_mesh_dims names the "
                       "dimensions of")
    names = None if mesh is None else mesh.mesh_dim_names
    if names is None:
        raise bad_value("mesh", mesh, "mesh must have mesh_dim_names when dp_mesh_dims is "
                        "provided")
    for n in shard + replicate:
        if n not in names:
            raise bad_value("dp_mesh_dims", dp_mesh_dims, f"Mesh dim name '{n}' not found in "
                            f"mesh.mesh_dim_names {names}")
    if len(shard) > 1 or len(replicate) > 1:
        raise not_built("dp_mesh_dims", dp_mesh_dims, "several names flattened into one "
                        "data-parallel dim are not built", "name one mesh dim for shard and "
                        "at most one for replicate")
    if not shard:  # DDP over the replicate dim: sharded over nothing
        return mesh[replicate[0]], SPMD(mesh, None, names.index(replicate[0]))
    s = names.index(shard[0])
    if not replicate:
        return mesh[shard[0]], SPMD(mesh, s, None)
    r = names.index(replicate[0])
    dp = DeviceMesh._concatenate([mesh[replicate[0]], mesh[shard[0]]])
    return dp, SPMD(mesh, s, r)
