"""fully_shard on parameters that are DTensors already: tensor (or expert)
parallel ones, placed on a mesh of their own (parallelize_module(block,
mesh["tp"], ...)), then sharded again over the data-parallel mesh
(fully_shard(block, mesh=mesh["dp"])), as torch's fully_shard does; or
DTensors on a full SPMD mesh, replicated on the data-parallel dims that
fully_shard(mesh=mesh, dp_mesh_dims=...) names (spmd_spec: the shards stay on
that mesh, the shard dim's Replicate made Shard).

The engine shards, gathers and reduces each parameter's local tensor (this
rank's tensor-parallel piece) exactly as a plain parameter's; only the
DTensor wrappers differ:

- the sharded parameter is a DTensor on the two meshes joined (dp dims
  first, then the parameter's own), placed (dp placement, *its placements),
  where the dp placement is _StridedShard(d, split_factor) when the
  parameter's own placements already split dim d that many ways (so that
  full_tensor() and checkpoints see the right global layout);
- from unshard to reshard the module holds the gathered local tensor as a
  DTensor with the parameter's own spec, so the tensor-parallel forward
  runs unchanged;
- its gradient is a DTensor on the parameter's own mesh; a Partial
  placement is made Replicate (a sum over that mesh) before the local tensor
  is reduce-scattered over the data-parallel mesh.
"""
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import bad_value

from torch.distributed.tensor.placement_types import _StridedShard


@dataclass(frozen=True)
class TPSpec:
    """One DTensor parameter: its own spec (mesh, placements, global shape)
    and where its shards live (the joined mesh and placements)."""
    spec: object            # the parameter's DTensorSpec on its own mesh
    mesh: DeviceMesh        # the data-parallel mesh joined with its own
    placements: tuple       # (dp placements..., its own placements...)
    dp_dims: frozenset = frozenset()  # full SPMD mesh: its data-parallel dims


def _join(dp_mesh, own_mesh, name):
    """The mesh whose dims are dp_mesh's then own_mesh's (both slices of one
    root mesh), as torch's fully_shard joins them."""
    try:
        return DeviceMesh._concatenate([dp_mesh, own_mesh])
    except Exception as e:  # torch's words, about meshes that do not join
        raise bad_value("mesh", dp_mesh, f"parameter {name} is a DTensor on {own_mesh}, which "
                        f"does not join with the data-parallel mesh ({e})",
                        "slice both from one DeviceMesh, e.g. mesh['dp'] and mesh['tp']"
                        ) from None


def tp_spec(param, dp_mesh, shard_dim, replicated, name):
    """The TPSpec of DTensor `param` sharded on `shard_dim` over `dp_mesh`
    (replicated: its first dim replicates, HSDP)."""
    spec = param._spec
    if len(spec.placements) > 2:
        raise bad_value("module", name, f"parameter {name} has placements "
                        f"{tuple(spec.placements)}; fully_shard takes DTensor parameters of "
                        "1-D or 2-D meshes (tensor or expert parallel)",
                        "place it on at most two mesh dims")
    if any(not isinstance(p, (Shard, Replicate)) for p in spec.placements):
        raise bad_value("module", name, f"parameter {name} has placements "
                        f"{tuple(spec.placements)}", "Shard or Replicate placements only")
    mesh = _join(dp_mesh, spec.mesh, name)
    split = _split(tuple(spec.placements), spec.mesh.shape, shard_dim, -1)
    mine = _StridedShard(shard_dim, split_factor=split) if split > 1 else Shard(shard_dim)
    dp = (Replicate(), mine) if replicated else (mine,)
    return TPSpec(spec, mesh, dp + tuple(spec.placements))


def _split(placements, sizes, shard_dim, after):
    """How many ways the dims after index `after` already split shard_dim."""
    split = 1
    for j in range(after + 1, len(placements)):
        p = placements[j]
        if isinstance(p, (Shard, _StridedShard)) and p.dim == shard_dim:
            split *= sizes[j]
    return split


def spmd_spec(param, spmd, shard_dim, name):
    """The TPSpec of DTensor `param` on the full SPMD mesh (dp_mesh.SPMD):
    the shard dim's Replicate becomes Shard(shard_dim) (strided when later
    dims split shard_dim too), as torch's fully_shard places it."""
    spec = param._spec
    if spec.mesh is not spmd.mesh and spec.mesh != spmd.mesh:
        raise bad_value("module", name, f"parameter {name} is a DTensor on {spec.mesh}; with "
                        "dp_mesh_dims every parameter must be a DTensor on the mesh passed to "
                        "fully_shard", "distribute it on that mesh")
    orig = tuple(spec.placements)
    dp_dims = {i for i in (spmd.shard, spmd.replicate) if i is not None}
    for i in sorted(dp_dims):
        if not isinstance(orig[i], Replicate):
            dim = spmd.mesh.mesh_dim_names[i]
            raise bad_value("module", name, f"parameter {name} has placements {orig}: "
                            f"expected Replicate() on the data-parallel dim '{dim}' (index "
                            f"{i}) but got {orig[i]}", "replicate it on the data-parallel dims")
    if any(not isinstance(p, (Shard, Replicate)) for p in orig):
        raise bad_value("module", name, f"parameter {name} has placements {orig}",
                        "Shard or Replicate placements only")
    placements = list(orig)
    if spmd.shard is not None:  # (DDP: replicated on every data-parallel dim)
        split = _split(orig, spmd.mesh.shape, shard_dim, spmd.shard)
        placements[spmd.shard] = (_StridedShard(shard_dim, split_factor=split) if split > 1
                                  else Shard(shard_dim))
    return TPSpec(spec, spmd.mesh, tuple(placements), frozenset(dp_dims))


def unsharded(local, t):
    """The gathered local tensor as the module's parameter: a DTensor with
    the parameter's own spec (no autograd edge: the caller makes it a leaf)."""
    return DTensor(local, t.spec, requires_grad=False)


def reduces_outside_dp(t):
    """Whether the gradient may be summed over a mesh dim that is not
    data-parallel before the reduce-scatter (grad_local: a Replicate
    parameter's gradient can come Partial, as a SequenceParallel norm
    weight's), as torch's FSDPParam.may_reduce_grad_outside_dp tells."""
    return any(isinstance(p, Replicate) for i, p in enumerate(t.spec.placements)
               if i not in t.dp_dims)


def grad_local(grad, t):
    """The local tensor of an unsharded parameter's gradient, placed as the
    parameter (a Partial sum over its own mesh is completed first; on a full
    SPMD mesh the data-parallel dims keep theirs: the reduce-scatter sums
    them, as torch's fully_shard leaves them)."""
    if not isinstance(grad, DTensor):
        return grad
    want = tuple(t.spec.placements)
    if t.dp_dims:
        want = tuple(g if i in t.dp_dims else w
                     for i, (g, w) in enumerate(zip(grad.placements, want)))
    if tuple(grad.placements) != want:
        grad = grad.redistribute(placements=want)
    return grad._local_tensor
