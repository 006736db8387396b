"""FSDP2's API on flatshard's core: `fully_shard`, and the names users
import beside it (FSDPModule, UnshardHandle and register_fsdp_forward_method
from module.py; torch's policy dataclasses).

    from flatshard import fully_shard, MixedPrecisionPolicy
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

Same contract as torch.distributed.fsdp.fully_shard: applied bottom-up, each
call makes one group of the module's parameters not already in a group,
swaps the module's class to an FSDPModule subclass (parameter names are
unchanged) and registers the parameters as DTensors sharded on dim 0 over the
mesh, so state_dict(), full_tensor() and clip_grad_norm_ work as with torch.
The collectives go through flatshard's Comm (runtime/comm.py; backend chosen by
FLATSHARD_COMM_BACKEND, "auto" by default; mesh.py makes them), one
all-gather and one reduce-scatter per group, and gradients are averaged
exactly on every backend. torch's MixedPrecisionPolicy, OffloadPolicy,
CPUOffloadPolicy and DeviceMesh objects are the ones accepted (flatshard
re-exports the policies).

A 2-D mesh gives hybrid sharding: shard over the inner dim, then an
all-reduce of the gradient shards over the outer dim. An int
reshard_after_forward k keeps the parameters sharded over groups of k ranks
between forward and backward, and backward gathers them within that group.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from ..errors import bad_type, bad_value, not_built
from ..noop import mixed_precision as noop_mp
from ..runtime.comm import self_comm
from ..tensors import check_plain
from . import dp_mesh, mistakes, outside_forward, torch_class
from .extension import gathers_itself
from .mesh import (check_mesh, check_reshard, check_reshard_divides, comm_over, mesh_device,
                   resolve_reshard)
from .module import FSDPModule, UnshardHandle, check_bool, register_fsdp_forward_method
from .param import ParamGroup
from .state import STATE_ATTR, FSDPState, state_of

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
           "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]


def fully_shard(module, *, mesh=None, reshard_after_forward=None, shard_placement_fn=None,
                mp_policy=MixedPrecisionPolicy(), offload_policy=OffloadPolicy(),
                ignored_params=None, dp_mesh_dims=None):
    """Shard `module`'s parameters (those not already in a group) over `mesh`
    on dim 0 (or the dim shard_placement_fn names); returns `module`, whose class is now an FSDPModule subclass.
    A list of modules makes one group of all their parameters (e.g. the
    final norm and the output head): each module's forward gathers it.

    mesh                   torch DeviceMesh on CPU: 1-D shards over it; 2-D
                           replicates over dim 0 and shards over dim 1 (HSDP).
                           None: the default process group's world. DTensor
                           (tensor-parallel) parameters are sharded again
                           over it, on the joined mesh (fsdp2/tp.py).
    reshard_after_forward  True: free the gathered parameters after forward
                           and gather again in backward; False: keep them
                           until backward ends; an int k: keep them sharded
                           over groups of k ranks in between; None: True for
                           every module but the root.
    shard_placement_fn     fn(param) -> Shard(dim) or None (Shard(0)): the dim
                           each parameter is sharded on (torch.chunk's split,
                           uneven splits of any dim included).
    mp_policy              torch's MixedPrecisionPolicy (param_dtype,
                           reduce_dtype, output_dtype, cast_forward_inputs;
                           torch 2.15's param_dtype_override_fn, called
                           once per parameter here: None or param_dtype
                           casts it, its own dtype keeps it; one group
                           computes in one dtype, so a group whose
                           parameters the override splits is refused with
                           a NotBuiltError naming them).
    offload_policy         OffloadPolicy() (none) or CPUOffloadPolicy().
    ignored_params         parameters left out of the group (neither sharded
                           nor reduced).
    dp_mesh_dims           torch's DataParallelMeshDims: `mesh` is the full
                           SPMD mesh, every parameter a DTensor on it
                           replicated on the dims named (at most one shard
                           dim and one replicate dim; replicate alone is DDP
                           over that dim, on CPU: fsdp2/dp_mesh.py).
    On a 2-D mesh (or dp_mesh_dims' replicate dim), every
    FLATSHARD_CHECK_REPLICAS_EVERY optimizer steps (default 1000; 0: never)
    the replicas compare a CRC-32C of each shard and warn
    (ReplicaDriftWarning) where one differs (flatshard/checks/replicas.py);
    fully_shard keeps torch's arguments, so this has no keyword here."""
    torch_class.check_container(module)
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise bad_value("module", module, "expected a module or a non-empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise bad_type("module", m, "an nn.Module or a list of nn.Modules")
        if state_of(m) is not None:
            raise torch_class.applied_twice(m)
    if len({id(m) for m in modules}) != len(modules):
        raise bad_value("module", module, "the list names a module twice")
    check_reshard(reshard_after_forward)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise bad_type("shard_placement_fn", shard_placement_fn, "a callable or None")
    _check_mp(mp_policy)
    _check_offload(offload_policy)
    ignored = _check_ignored(ignored_params)
    every = mistakes.replicas_every(None)
    spmd = None
    if dp_mesh_dims is not None:  # the data-parallel mesh within the full one
        mesh, spmd = dp_mesh.resolve(mesh, dp_mesh_dims)
        if isinstance(reshard_after_forward, int) and \
                not isinstance(reshard_after_forward, bool):
            raise not_built("reshard_after_forward", reshard_after_forward, "an int is not "
                            "supported with dp_mesh_dims (nor by torch)", "use True or False")
    params, aliases, names = _collect(modules, ignored)
    overrides = _param_dtype_overrides(mp_policy, params, names)
    label = ", ".join(type(m).__name__ for m in modules)
    noop_mp.fully_shard(label, mp_policy, params)
    dims = []  # each parameter's shard dim
    for p, name in zip(params, names):
        if spmd is not None and not isinstance(p, DTensor):
            raise bad_value("dp_mesh_dims", dp_mesh_dims, "When dp_mesh_dims is provided, all "
                            "parameters must be DTensors on the full SPMD mesh (e.g. via "
                            f"distribute_module). Got plain tensor for parameter '{name}'")
        if isinstance(p, DTensor):  # tensor parallel: its local tensor is sharded (tp.py)
            check_plain(p._local_tensor, f"parameter {name}'s local tensor", "fully_shard")
        elif gathers_itself(p):  # its class all-gathers for itself, or may (extension.py)
            if isinstance(reshard_after_forward, int) and \
                    not isinstance(reshard_after_forward, bool):
                raise not_built("reshard_after_forward", reshard_after_forward,
                                f"parameter {name} all-gathers through its class's "
                                "fsdp_pre_all_gather, which has no post-forward group (as "
                                "in torch)", "use True or False")
        else:
            check_plain(p, f"parameter {name}", "fully_shard")
        if p.dim() == 0:
            raise bad_value("module", label, f"parameter {name} is 0-d and dim-0 sharding "
                            "needs at least one dimension: fully_shard doesn't support scalar "
                            "parameters", f"Change {name} to a 1D tensor with numel equal to 1.")
        dims.append(_shard_dim(shard_placement_fn, p, name, gathers_itself(p)))
    if len({p.dtype for p in params}) > 1:
        found = sorted({str(p.dtype) for p in params})
        raise bad_value("module", label, f"its parameters have several dtypes "
                        f"({', '.join(found)}); one group needs one dtype",
                        "apply fully_shard to the submodules of each dtype first")
    # The checks above need no mesh: the default one is made below, and
    # making it is a collective where CUDA is visible over a gloo group
    # (torch's init_device_mesh then makes a group of its own).
    if mesh is None and dist.is_available() and dist.is_initialized():
        check_reshard_divides(reshard_after_forward, dist.get_world_size())
    on_cuda = any(p.device.type == "cuda" for p in params)
    mesh = check_mesh(mesh, "cuda" if on_cuda else "cpu")
    want = mesh_device(mesh)
    for p, name in zip(params, names):
        if p.device.type != "meta" and p.device != want:
            raise bad_value("module", label, f"parameter {name} is on {p.device}, and the "
                            f"mesh's collectives move {want} memory",
                            f"move the module to {want} first, or pass a matching mesh")
    raf, post_comm = resolve_reshard(reshard_after_forward, mesh)
    group = None
    if params:
        mistakes.compare_init(mesh, params, names, spmd, label)
        if spmd is not None and spmd.shard is None:  # DDP: replicated, nothing sharded
            if want.type != "cpu":
                raise not_built("dp_mesh_dims", dp_mesh_dims, "replicate names alone (DDP "
                                "over the mesh) on a CUDA mesh", "name a shard dim too")
            shard, replicate = self_comm(), comm_over(mesh.get_group(0), mesh)
        elif mesh.ndim == 2:
            shard = comm_over(mesh.get_group(1), mesh)
            replicate = comm_over(mesh.get_group(0), mesh)
        else:
            shard, replicate = comm_over(mesh.get_group(0), mesh), None
        group = ParamGroup(params, aliases, mesh, shard, replicate, mp_policy, names, dims,
                           spmd, overrides)
        group.post_comm = post_comm
        group.c.register_sharded()
    state = FSDPState(modules, group, raf, mp_policy)
    mistakes.built(state, params, names, every)
    for m in modules:
        m.__dict__[STATE_ATTR] = state
        m.__class__ = _fsdp_class(type(m))
    return modules if isinstance(module, (list, tuple)) else module


fully_shard.state = state_of


# ----------------------------------------------------------------------
# what fully_shard builds from


def _collect(modules, ignored):
    """Parameters of `modules` not already in a group (not under a submodule
    that fully_shard was applied to), unique, with every place each is
    registered: (params, aliases, names)."""
    params, aliases, names, seen = [], [], [], {}

    def walk(m, prefix):
        for attr, p in m._parameters.items():
            if p is None or id(p) in ignored:
                continue
            if id(p) in seen:
                aliases[seen[id(p)]].append((m, attr))
                continue
            seen[id(p)] = len(params)
            params.append(p)
            aliases.append([(m, attr)])
            names.append(prefix + attr)
        for cname, child in m._modules.items():
            if child is not None and state_of(child) is None:
                walk(child, f"{prefix}{cname}.")
    for i, module in enumerate(modules):
        walk(module, f"[{i}]." if len(modules) > 1 else "")
    return params, aliases, names


_CLASSES = {}


def _fsdp_class(cls):
    new = _CLASSES.get(cls)
    if new is None:
        namespace = torch_class.class_namespace(cls)
        namespace.update(outside_forward.guarded_methods(cls, FSDPModule))
        new = _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), namespace)
    return new


# ----------------------------------------------------------------------
# argument checks

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _check_mp(mp):
    if not isinstance(mp, MixedPrecisionPolicy):
        raise bad_type("mp_policy", mp, "a MixedPrecisionPolicy")
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        v = getattr(mp, name)
        if v is not None and v not in _DTYPES:
            raise bad_value(f"mp_policy.{name}", v, f"expected None or one of {_DTYPES}")
    check_bool("mp_policy.cast_forward_inputs", mp.cast_forward_inputs)
    fn = getattr(mp, "param_dtype_override_fn", None)  # torch 2.15's field
    if fn is not None and not callable(fn):
        raise bad_type("mp_policy.param_dtype_override_fn", fn,
                       "a callable fn(param) -> torch.dtype or None, or None")


def _param_dtype_overrides(mp, params, names):
    """torch 2.15's param_dtype_override_fn(param) for each parameter, once,
    when fully_shard is applied (as torch calls it), checked as torch checks
    it: None, param_dtype, or the parameter's own dtype. None: no override."""
    fn = getattr(mp, "param_dtype_override_fn", None)
    if fn is None:
        return None
    out = []
    for p, name in zip(params, names):
        d = fn(p)
        if d is not None and not isinstance(d, torch.dtype):
            raise bad_value("mp_policy.param_dtype_override_fn", d, "param_dtype_override_fn "
                            f"must return a torch.dtype or None but got {type(d)} for "
                            f"parameter {name}")
        if d is not None and d not in (mp.param_dtype, p.dtype):
            raise bad_value("mp_policy.param_dtype_override_fn", d, "param_dtype_override_fn "
                            "must return None, param_dtype, or the parameter's original dtype "
                            f"but got {d} for a parameter with dtype {p.dtype} and param_dtype "
                            f"{mp.param_dtype} (parameter {name})")
        out.append(d)
    return out


def _check_offload(policy):
    if not isinstance(policy, OffloadPolicy):
        raise bad_type("offload_policy", policy, "an OffloadPolicy or CPUOffloadPolicy")


def _check_ignored(ignored):
    if ignored is None:
        return set()
    if not isinstance(ignored, (set, frozenset, list, tuple)):
        raise bad_type("ignored_params", ignored, "a set of nn.Parameters or None")
    for p in ignored:
        if not isinstance(p, nn.Parameter):
            raise bad_type("ignored_params", p, "a set of nn.Parameters or None")
    return {id(p) for p in ignored}


def _shard_dim(fn, p, name, extension):
    """The dim shard_placement_fn(p) shards p on: torch's rules (None is
    Shard(0), a negative dim counts from the end, anything but a Shard is
    refused). Unlike torch, an uneven split of a dim other than 0 is built:
    it follows torch.chunk, as dim 0 does."""
    placement = fn(p) if fn is not None else None
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        if type(placement).__name__ == "ShardPlacementResult":
            raise not_built("shard_placement_fn", placement, f"parameter {name} asked for a "
                            "mesh of its own; every parameter of a group shards on the "
                            "group's mesh", "return a Shard(dim) or None")
        raise bad_value("shard_placement_fn", placement, f"Invalid shard_placement_fn result "
                        f"for parameter {name}", "return a Shard(dim) or None")
    d = placement.dim + p.dim() if placement.dim < 0 else placement.dim
    if not 0 <= d < p.dim():
        raise bad_value("shard_placement_fn", placement, f"Shard dim {placement.dim} is "
                        f"invalid for {p.dim()}D tensor: parameter {name} of shape "
                        f"{tuple(p.shape)}", f"a dim in [-{p.dim()}, {p.dim()})")
    if d and extension:
        raise not_built("shard_placement_fn", placement, f"parameter {name} all-gathers "
                        "through its class's fsdp_pre_all_gather, which flatshard shards on "
                        "dim 0 only", "return Shard(0) or None for it")
    return d
