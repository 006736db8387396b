"""fully_shard(dp_mesh_dims=...): torch's way of naming the data-parallel
dimensions of a full SPMD mesh (DataParallelMeshDims: `shard`, and
`replicate` for HSDP) whose parameters are DTensors on it already.

Not built. In torch the parameters stay DTensors on the full mesh through
forward and backward (replicated on the data-parallel dimensions, placed as
the user chose on the others), so the model computes on DTensors, inputs
included; flatshard's fully_shard shards and gathers plain tensors. Taking
the DTensors' local tensors would run, but a script written for torch's
dp_mesh_dims, which feeds DTensor inputs, would then mix DTensors with plain
tensors. So every dp_mesh_dims is refused with a NotBuiltError naming it,
after torch's own checks (its ValueErrors: no dimension named, a mesh
without dimension names, a name the mesh lacks). Without other dimensions
on the mesh, the same sharding is fully_shard with the data-parallel mesh
itself (1-D, or 2-D (replicate, shard) for HSDP) and plain parameters.
"""
from dataclasses import dataclass

from ..errors import bad_type, bad_value, not_built

try:
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # torch before 2.13 has no dp_mesh_dims: the same dataclass
    @dataclass
    class DataParallelMeshDims:
        """torch 2.13's names of a full SPMD mesh's data-parallel dimensions."""
        shard: "str | tuple[str, ...] | None" = None
        replicate: "str | tuple[str, ...] | None" = None


def _names(v):
    return () if v is None else (v,) if isinstance(v, str) else tuple(v)


def check(mesh, dp_mesh_dims):
    """torch's checks of dp_mesh_dims against `mesh`, then the refusal."""
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
    raise not_built("dp_mesh_dims", dp_mesh_dims, "with it the parameters are DTensors on the "
                    "full SPMD mesh through forward and backward, and flatshard shards and "
                    "gathers plain tensors", "without other (tensor-parallel) dimensions, pass "
                    "the data-parallel mesh itself (1-D, or 2-D (replicate, shard) for HSDP), "
                    "plain parameters and no dp_mesh_dims")
