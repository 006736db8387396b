"""The mesh fully_shard shards a group over, and the Comms made from it: the
default mesh and the checks on a given one, the device its collectives move,
the Comm of each of its process groups (runtime/comm.py), and
reshard_after_forward: its type, and an int's group of ranks within the
shard dim, which holds the parameters between forward and backward.

fully_shard (api.py) and FSDPModule.set_reshard_after_forward (module.py)
call it; every Comm of fully_shard is made through comm_over, so a test that
replaces `comm_for` here sees them all.
"""
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import ConfigAssertionError, bad_type, bad_value, not_built
from ..runtime import cuda
from ..runtime.comm import backend_for_device, comm_for, requested_backend


_MESHES = {}


def check_mesh(mesh, device_type):
    """device_type: where the module's parameters are ('cpu' or 'cuda'),
    which picks the default mesh's device type."""
    if not (dist.is_available() and dist.is_initialized()):
        raise bad_value("mesh", mesh, "torch.distributed is not initialized",
                        "call torch.distributed.init_process_group('gloo') first")
    if mesh is None:
        key = (id(dist.group.WORLD), dist.get_world_size(), device_type)
        mesh = _MESHES.get(key)
        if mesh is None:
            mesh = _MESHES[key] = init_device_mesh(device_type, (dist.get_world_size(),))
    if not isinstance(mesh, DeviceMesh):
        raise bad_type("mesh", mesh, "a torch.distributed.device_mesh.DeviceMesh or None")
    if mesh.device_type not in ("cpu", "cuda"):
        raise not_built("mesh", mesh, f"device type {mesh.device_type!r}: flatshard shards "
                        "over CPU or CUDA meshes")
    if mesh.device_type == "cuda":
        if not cuda.available():
            raise not_built("mesh", mesh, "a CUDA mesh needs flatshard built with nvcc and a "
                            "CUDA device visible to torch")
    if mesh.ndim not in (1, 2):
        # ends with torch's words, which scripts match
        raise bad_value("mesh", mesh, f"a {mesh.ndim}-D mesh (1-D: FSDP; 2-D: hybrid, "
                        "replicate on dim 0 and shard on dim 1): fully_shard expects a 1D or 2D "
                        f"DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise ConfigAssertionError(
            f"flatshard: mesh={mesh!r} is not allowed; a 2-D mesh needs names for its "
            "dimensions (Please init the 2D mesh for HSDP with mesh_dim_names specified). "
            "Pass mesh_dim_names=('replicate', 'shard') to init_device_mesh")
    return mesh


def mesh_device(mesh):
    """The device the mesh's collectives move: CPU, or this rank's CUDA device."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def comm_over(group, mesh):
    """The Comm of one of the mesh's process groups, on the backend
    FLATSHARD_COMM_BACKEND asks for (runtime/comm.py; cached per group)."""
    device = mesh_device(mesh)
    backend = backend_for_device(requested_backend(None), device, "FLATSHARD_COMM_BACKEND")
    return comm_for(group, backend, device)


def check_reshard(value, none_ok=True):
    if value is None and none_ok or isinstance(value, (bool, int)):
        return value
    raise bad_type("reshard_after_forward", value, ("None, " if none_ok else "") +
                   "True, False or an int (the size of the group to reshard to)")


def check_reshard_divides(value, size):
    """An int reshard_after_forward against the shard dim's size."""
    if isinstance(value, bool) or not isinstance(value, int):
        return
    if not 1 <= value <= size or size % value:
        raise bad_value("reshard_after_forward", value, f"an int must divide the mesh's shard "
                        f"dim size {size}", "use a divisor such as the ranks per host, or a bool")


_SUBGROUPS = {}


def resolve_reshard(value, mesh):
    """None and bools pass; an int k gives False (k == 1), True (k == the
    shard size) or k with the Comm of this rank's group of k consecutive
    ranks of the shard dim, which holds the parameters between forward and
    backward."""
    if value is None or isinstance(value, bool):
        return value, None
    size = mesh.size(mesh.ndim - 1)
    check_reshard_divides(value, size)
    if value == 1:  # as torch warns: easily meant as True
        warnings.warn("flatshard: reshard_after_forward=1 (an int) reshards to groups of one "
                      "rank: the parameters stay whole after forward, as with False; pass True "
                      "to free them", stacklevel=3)
    if value in (1, size):
        return value == size, None
    ranks = dist.get_process_group_ranks(mesh.get_group(mesh.ndim - 1))
    me = ranks.index(dist.get_rank())
    block = tuple(ranks[me // value * value:(me // value + 1) * value])
    # this rank's own: ranks run as threads of one process (torch's threaded
    # process group) each make the group, and each gets its own object
    key = (dist.get_rank(), block)
    group = _SUBGROUPS.get(key)
    if group is None:
        group = _SUBGROUPS[key] = dist.new_group(list(block), use_local_synchronization=True)
    return value, comm_over(group, mesh)
