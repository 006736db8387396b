"""FSDP2's API on flatshard's core: `fully_shard` and `FSDPModule`.

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
FLATSHARD_COMM_BACKEND, "auto" by default), one all-gather and one
reduce-scatter per group, and gradients are averaged exactly on every
backend. torch's MixedPrecisionPolicy, OffloadPolicy, CPUOffloadPolicy and
DeviceMesh objects are the ones accepted (flatshard re-exports the policies).

A 2-D mesh gives hybrid sharding: shard over the inner dim, then an
all-reduce of the gradient shards over the outer dim. An int
reshard_after_forward k keeps the parameters sharded over groups of k ranks
between forward and backward, and backward gathers them within that group.
"""
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.fsdp import UnshardHandle as _TorchUnshardHandle
from torch.distributed.tensor import DTensor, Shard

from ..errors import ConfigAssertionError, bad_type, bad_value, not_built
from ..runtime import cuda
from ..runtime.comm import backend_for_device, comm_for, requested_backend, self_comm
from ..tensors import check_plain
from . import dp_mesh, torch_class
from .extension import gathers_itself
from .param import ParamGroup
from .state import STATE_ATTR, FSDPState, state_of

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
           "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


class UnshardHandle(_TorchUnshardHandle):
    """What unshard(async_op=True) returns. On a CUDA device the all-gather
    may still be running: wait() makes the current stream wait for it (so
    does the module's next forward). On CPU it has completed already."""

    _state = None  # the FSDPState whose deferred all-gather wait() waits for

    def wait(self):
        st, self._state = self._state, None
        if st is not None and st.group is not None:
            st.group.wait_unsharded()
        return None


class FSDPModule:
    """Mixed into the class of every module fully_shard was applied to."""

    def _fsdp_state(self):
        return self.__dict__[STATE_ATTR]

    def _get_fsdp_state(self):
        """torch's name for this module's state (fsdp2/torch_state.py)."""
        state = state_of(self)
        if state is None:
            raise AssertionError(f"No FSDP state found on {self}")
        return state

    def _fsdp_modules(self, recurse):
        mods = self.modules() if recurse else [self]
        return [m for m in mods if isinstance(m, FSDPModule)]

    def _groups(self, recurse):
        """The parameter groups of this FSDP module (and those inside it)."""
        groups = (m._fsdp_state().group for m in self._fsdp_modules(recurse))
        return [g for g in groups if g is not None]

    def unshard(self, async_op=False):
        """All-gather this module's parameters and register the unsharded
        ones until reshard() (or the next reshard point of the step). With
        `async_op=True` an UnshardHandle is returned: on a CUDA device the
        all-gather runs beside later work until its wait() (or the module's
        forward); on CPU it has completed already."""
        _check_bool("async_op", async_op)
        st = self._fsdp_state()
        if st.root is None:
            st.lazy_init()
        st.unshard(defer=async_op)
        if not async_op:
            return None
        handle = UnshardHandle()
        handle._state = st
        return handle

    def reshard(self):
        self._fsdp_state().reshard()

    def _set_unshard_async_op(self, async_op):
        """torch's private switch, which its own code paths call: the
        pre-forward and pre-backward gathers of this module and the FSDP
        modules inside it are issued with async_op and waited for at once."""
        _check_bool("async_op", async_op)
        for m in self._fsdp_modules(True):
            m._fsdp_state().unshard_async_op = async_op

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """`requires_gradient_sync=False`: backward accumulates unreduced
        gradients locally (gradient accumulation without communication);
        True again reduces them all at the next backward. `recurse`: also
        for the FSDP modules inside this one."""
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        _check_bool("recurse", recurse)
        for m in self._fsdp_modules(recurse):
            m._fsdp_state().requires_gradient_sync = requires_gradient_sync

    def set_is_last_backward(self, is_last_backward):
        """Accepted for torch's API (`is_last_backward`: a bool). flatshard's
        reductions finish inside the backward that issues them, so no
        backward leaves work pending."""
        _check_bool("is_last_backward", is_last_backward)
        self._fsdp_state().is_last_backward = is_last_backward

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        """Change `reshard_after_forward` (True, False or an int, as in
        fully_shard) for this module and, with `recurse`, those inside it."""
        _check_reshard(reshard_after_forward, none_ok=False)
        _check_bool("recurse", recurse)
        for m in self._fsdp_modules(recurse):
            st = m._fsdp_state()
            if st.group is None:
                raf = reshard_after_forward
            else:
                raf, st.group.post_comm = _resolve_reshard(reshard_after_forward, st.group.mesh)
            st.reshard_after_forward = st.reshard_after_forward_arg = raf

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        """`reshard_after_backward=False` keeps the parameters gathered after
        backward (e.g. between micro-batches); `recurse` as above."""
        _check_bool("reshard_after_backward", reshard_after_backward)
        _check_bool("recurse", recurse)
        for m in self._fsdp_modules(recurse):
            m._fsdp_state().reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules):
        """Gather these FSDP `modules` right after this one's forward gather."""
        self._fsdp_state().forward_prefetch = _check_modules("modules", modules)

    def set_modules_to_backward_prefetch(self, modules):
        """Gather these FSDP `modules` right after this one's backward gather."""
        self._fsdp_state().backward_prefetch = _check_modules("modules", modules)

    def set_post_optim_event(self, event):
        """The root's next forward first waits for `event` (synchronize())."""
        if not callable(getattr(event, "synchronize", None)):
            raise bad_type("event", event, "an event with a synchronize() method (torch.Event)")
        self._fsdp_state().post_optim_event = event

    def set_gradient_divide_factor(self, factor):
        """This module's gradients are summed over the data-parallel ranks
        and divided by `factor` instead of averaged. As in torch, only this
        module's own group: call it on each FSDP module that should use it."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)):
            raise bad_type("factor", factor, "a positive number (int or float)")
        if not factor > 0:
            raise bad_value("factor", factor, "expected a positive number")
        g = self._fsdp_state().group
        if g is not None:
            g.divide_factor = float(factor)

    def set_unshard_in_backward(self, unshard_in_backward):
        """`unshard_in_backward=False`: never gather this module in backward
        (for modules whose parameters backward does not use)."""
        _check_bool("unshard_in_backward", unshard_in_backward)
        self._fsdp_state().unshard_in_backward = unshard_in_backward

    def reset_iter_state(self):
        """After an exception aborted a forward or backward: call it on the
        root, then train on. A reduction in flight is waited for (its
        gradients land, as in torch); every group is resharded; what the
        failed iteration left is dropped: its unreduced gradients, those
        accumulated without gradient sync or without the replicas'
        all-reduce (HSDP), the parameters whose gradients
        had arrived, the reshards it held back for frozen parameters, and
        the root's end-of-backward callback, which the autograd engine
        dropped. On a module that is not the root: a
        RuntimeError, as in torch."""
        st = self._fsdp_state()
        if st.is_root is False:
            raise RuntimeError("flatshard: reset_iter_state must be called on the root FSDP "
                               "module")
        if st.is_root:
            st.tree.abandon_backward()  # its reduce-scatter never ran: nothing to wait for
            st.finish_reducing()
            st.prefetched = []
        for s in st.states or [st]:
            s.ready.clear()
            s.forget_held_reshard()  # frozen parameters: forwards the failed backward reached
            g = s.group
            if g is None:
                continue
            g.reshard()
            g.c.drop_partial()  # an HSDP partial sum without its all-reduce, as torch
            g.accumulated = [None] * len(g.accumulated)
            for p in g.unsharded or ():
                if p is not None:
                    p.grad = None

    def set_requires_all_reduce(self, requires_all_reduce, *, recurse=True):
        """HSDP (a 2-D mesh): whether backward all-reduces the reduce-scattered
        gradients across the replicas. `requires_all_reduce=False` (gradient
        accumulation with reduce-scatter only, as in torch): each backward
        adds its reduce-scatter output (the shard group's sum) into a
        partial sum the group keeps and writes no sharded gradient; the next
        backward with True adds the partial sum to its own before the
        all-reduce, then scales and writes the sharded gradients as usual.
        Without replicas (a 1-D mesh) there is nothing to all-reduce and the
        flag changes nothing, as in torch. `recurse`: also the FSDP modules
        inside this one."""
        _check_bool("requires_all_reduce", requires_all_reduce)
        _check_bool("recurse", recurse)
        for g in self._groups(recurse):
            g.all_reduce = requires_all_reduce

    def set_custom_all_gather(self, comm):
        """torch's hook to replace the all-gather: this module's group's
        all-gathers call `comm(output_tensor=, input_tensor=, group=,
        async_op=False)` (torch's AllGather) with the engine's buffers, in
        place of flatshard's own collective; comm.allocate is not called
        (the engine owns its buffers: only where the memory comes from
        differs). On a CPU mesh; on a CUDA mesh: a NotBuiltError."""
        self._set_custom("all_gather", comm, "set_custom_all_gather")

    def set_custom_reduce_scatter(self, comm):
        """torch's hook to replace the reduce-scatter: this module's group's
        reduce-scatters call `comm(output_tensor=, input_tensor=, group=,
        op=ReduceOp.SUM, async_op=False)` (torch's ReduceScatter); the engine
        then scales as it would (the mean, or the divide factor). As
        set_custom_all_gather otherwise."""
        self._set_custom("reduce_scatter", comm, "set_custom_reduce_scatter")

    def _set_custom(self, kind, comm, method):
        if not callable(comm):
            proto = "AllGather" if kind == "all_gather" else "ReduceScatter"
            raise bad_type("comm", comm, f"a callable torch {proto} (torch.distributed.fsdp."
                           "_fully_shard._fsdp_api)")
        g = self._fsdp_state().group
        if g is None:
            return
        if g.comm.device is not None:
            raise not_built("comm", type(comm).__name__, f"{method} on a CUDA mesh: the "
                            "engine's collectives there are NCCL calls on its streams",
                            "use it on a CPU mesh, or drop the call")
        g.set_custom(kind, comm)

    def set_all_reduce_hook(self, hook, *, stream=None):
        """`hook(reduce_output)` runs at each backward's gradient reduction of
        this module's own group (as in torch, not the modules inside it),
        after the reduce-scatter (1-D mesh) or after the replicas'
        all-reduce (HSDP), before the sharded gradients are written from
        `reduce_output`: what the hook leaves in it, changed in place, is
        what they get. A backward that only reduce-scatters
        (set_requires_all_reduce(False)) does not call it. None removes it.

        reduce_output: a flat tensor of the reduce dtype, this rank's block:
        each parameter's rows of its sharded gradient, padded to
        ceil(dim0 / shard size) rows with zeros, in the group's order;
        torch packs these back to back, flatshard starts each at an aligned
        offset (the group's `entries`, `block_offset`). Its values are
        torch's: for float32 and bfloat16 reduce dtypes the sum already
        divided by the gradient divide factor (the mean by default), for
        other dtypes by the power of two torch divides by before its
        reduce-scatter; the rest is divided after the hook. (torch under
        set_force_sum_reduction_for_comms(True) divides only float16 and
        float64 sums before the hook, by that power of two, and the rest
        after; flatshard's hook sees the same values. _C.grad_divide's
        `hold` says what the reduce output is divided by.)

        `stream`: a CUDA stream to run the hook on, on a 1-D CUDA mesh only;
        a ConfigError with HSDP (the hook runs where the all-reduce ran, as
        torch refuses it) or on a CPU mesh, which has no streams."""
        if hook is not None and not callable(hook):
            raise bad_type("hook", hook, "a callable hook(reduce_output) or None")
        g = self._fsdp_state().group
        if stream is not None:
            if g is not None and g.replicate_comm is not None:
                raise bad_value("stream", stream, "stream cannot be set when using native HSDP",
                                "drop stream: the hook runs after the all-reduce, in its order")
            if g is not None and g.comm.device is None:
                raise bad_value("stream", stream, "this module's mesh is on CPU, which runs "
                                "no streams", "pass stream=None")
            if not callable(getattr(stream, "wait_stream", None)):
                raise bad_type("stream", stream, "a torch.cuda.Stream or None")
            if hook is None:
                raise bad_value("stream", stream, "a stream needs a hook to run",
                                "pass the hook too")
        if g is not None:
            g.all_reduce_hook = (hook, stream) if hook is not None else None

    def set_reduce_scatter_divide_factor(self, factor):
        """Deprecated in torch: set_gradient_divide_factor(factor), with a
        FutureWarning."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated (in torch too): use "
                      "set_gradient_divide_factor", FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable):
        """As in torch: this module's group reduces with plain sums, its
        divide made before (float16, float64: the power of two torch divides
        by against overflow) and after the collective instead of by it, so
        that an all-reduce hook reads the undivided float32 or bfloat16 sum
        (core/reduce_rule.h). `enable`: a bool."""
        _check_bool("enable", enable)
        g = self._fsdp_state().group
        if g is not None:
            g.force_sum = enable

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params, *, recurse=True):
        """torch: with reduce_scatter_unused_params=True, the parameters of a
        gathered group that got no gradient in backward (conditional control
        flow, a mixture of experts) take a zero one in the reduce-scatter, and
        a group gathered but given no gradient at all still reduces at the
        end of backward, so ranks that used different parameters issue the
        same collectives and every trainable parameter gets its sharded
        gradient. False (torch's default) leaves them out. `recurse`: the
        FSDP modules inside this one too."""
        _check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        _check_bool("recurse", recurse)
        for g in self._groups(recurse):
            g.reduce_unused = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers, *, recurse=True):
        """torch (CUDA): how many reduce-scatter input buffers may be in
        flight. Only memory and overlap change; on CPU the reductions finish
        before backward goes on, and on a device flatshard keeps one
        reduction in flight, so max_input_buffers is checked (an int >= 1)
        and has no effect. `recurse`: accepted for torch's API."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise bad_type("max_input_buffers", max_input_buffers, "an int")
        if max_input_buffers < 1:
            raise bad_value("max_input_buffers", max_input_buffers, "expected a positive int")
        _check_bool("recurse", recurse)

    def set_separate_reduce_scatter_group(self, enable=True, *, recurse=True):
        """torch (CUDA): run the reduce-scatter on its own process group so
        it overlaps the all-gather. Only speed changes; flatshard's
        collectives are ordered on one stream per Comm, so `enable` is
        checked (a bool) and has no effect. `recurse`: accepted for torch's
        API."""
        _check_bool("enable", enable)
        _check_bool("recurse", recurse)

    def set_allocate_memory_from_process_group_for_comm(self, enable):
        """torch (CUDA, NCCL): allocate the collectives' staging buffers from
        the process group's allocator. Only memory placement changes; the
        engine allocates its own buffers, so `enable` is checked (a bool)
        and has no effect (nothing to do on CPU)."""
        _check_bool("enable", enable)

    def set_symm_mem_for_comm(self, backend="NCCL"):
        """torch (CUDA): symmetric-memory staging buffers for the
        all-gather. Only memory placement and speed change; `backend` is
        checked ("NCCL", the only one torch has) and has no effect (nothing
        to do on CPU)."""
        if backend != "NCCL":
            raise bad_value("backend", backend, 'only "NCCL" is a symmetric memory backend')

    def _apply(self, *args, **kwargs):
        # to_empty(), to(), float()...: the sharded parameters may be new objects.
        self.reshard()
        ret = super()._apply(*args, **kwargs)
        g = self._fsdp_state().group
        if g is not None:
            g.refresh_sharded()
            self._fsdp_state().hooked_full = None
        return ret


def register_fsdp_forward_method(module, method_name):
    """Run fully_shard's pre/post-forward around module.<method_name> too
    (e.g. generate). A no-op on a module that is not an FSDPModule."""
    if not isinstance(module, FSDPModule):
        return
    if not isinstance(method_name, str) or not callable(getattr(module, method_name, None)):
        raise bad_value("method_name", method_name,
                        f"{type(module).__name__} has no such method")
    orig = getattr(module, method_name)
    st = module._fsdp_state()

    def wrapped(self, *args, **kwargs):  # the hooks torch.compile runs eagerly
        args, kwargs = st._pre_forward_hook(self, args, kwargs)
        return st._post_forward_hook(self, args, orig(*args, **kwargs))
    object.__setattr__(module, method_name, wrapped.__get__(module, type(module)))


# ----------------------------------------------------------------------
# argument checks


def _check_bool(arg, value):
    if not isinstance(value, bool):
        raise bad_type(arg, value, "True or False")


def _check_reshard(value, none_ok=True):
    if value is None and none_ok or isinstance(value, (bool, int)):
        return value
    raise bad_type("reshard_after_forward", value, ("None, " if none_ok else "") +
                   "True, False or an int (the size of the group to reshard to)")


def _check_reshard_divides(value, size):
    """An int reshard_after_forward against the shard dim's size."""
    if isinstance(value, bool) or not isinstance(value, int):
        return
    if not 1 <= value <= size or size % value:
        raise bad_value("reshard_after_forward", value, f"an int must divide the mesh's shard "
                        f"dim size {size}", "use a divisor such as the ranks per host, or a bool")


_SUBGROUPS = {}


def _resolve_reshard(value, mesh):
    """None and bools pass; an int k gives False (k == 1), True (k == the
    shard size) or k with the Comm of this rank's group of k consecutive
    ranks of the shard dim, which holds the parameters between forward and
    backward."""
    if value is None or isinstance(value, bool):
        return value, None
    size = mesh.size(mesh.ndim - 1)
    _check_reshard_divides(value, size)
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
    return value, _comm(group, mesh)


def _mesh_device(mesh):
    """The device the mesh's collectives move: CPU, or this rank's CUDA device."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _comm(group, mesh):
    device = _mesh_device(mesh)
    backend = backend_for_device(requested_backend(None), device, "FLATSHARD_COMM_BACKEND")
    return comm_for(group, backend, device)


def _check_modules(arg, modules):
    if not isinstance(modules, (list, tuple)):
        raise bad_type(arg, modules, "a list of modules that fully_shard was applied to")
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise bad_type(arg, m, "a list of modules that fully_shard was applied to",
                           "apply fully_shard to each module first")
    return [m._fsdp_state() for m in modules]


_MESHES = {}


def _check_mesh(mesh, device_type):
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


def _check_mp(mp):
    if not isinstance(mp, MixedPrecisionPolicy):
        raise bad_type("mp_policy", mp, "a MixedPrecisionPolicy")
    for name in ("param_dtype", "reduce_dtype", "output_dtype"):
        v = getattr(mp, name)
        if v is not None and v not in _DTYPES:
            raise bad_value(f"mp_policy.{name}", v, f"expected None or one of {_DTYPES}")
    _check_bool("mp_policy.cast_forward_inputs", mp.cast_forward_inputs)
    if getattr(mp, "param_dtype_override_fn", None) is not None:  # torch 2.15's field
        raise not_built("mp_policy.param_dtype_override_fn", mp.param_dtype_override_fn,
                        "per-parameter compute dtypes are not built yet", "pass None")


def _check_offload(policy):
    if not isinstance(policy, OffloadPolicy):
        raise bad_type("offload_policy", policy, "an OffloadPolicy or CPUOffloadPolicy")
    # CPUOffloadPolicy: the sharded parameters and gradients stay in host memory,
    # which on a CPU mesh is where everything already lives.


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
        new = _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls),
                                   torch_class.class_namespace(cls))
    return new


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
                           reduce_dtype, output_dtype, cast_forward_inputs).
    offload_policy         OffloadPolicy() (none) or CPUOffloadPolicy().
    ignored_params         parameters left out of the group (neither sharded
                           nor reduced).
    dp_mesh_dims           torch's DataParallelMeshDims: `mesh` is the full
                           SPMD mesh, every parameter a DTensor on it
                           replicated on the dims named (at most one shard
                           dim and one replicate dim; replicate alone is DDP
                           over that dim, on CPU: fsdp2/dp_mesh.py)."""
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
    _check_reshard(reshard_after_forward)
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise bad_type("shard_placement_fn", shard_placement_fn, "a callable or None")
    _check_mp(mp_policy)
    _check_offload(offload_policy)
    ignored = _check_ignored(ignored_params)
    spmd = None
    if dp_mesh_dims is not None:  # the data-parallel mesh within the full one
        mesh, spmd = dp_mesh.resolve(mesh, dp_mesh_dims)
        if isinstance(reshard_after_forward, int) and \
                not isinstance(reshard_after_forward, bool):
            raise not_built("reshard_after_forward", reshard_after_forward, "an int is not "
                            "supported with dp_mesh_dims (nor by torch)", "use True or False")
    params, aliases, names = _collect(modules, ignored)
    label = ", ".join(type(m).__name__ for m in modules)
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
        _check_reshard_divides(reshard_after_forward, dist.get_world_size())
    on_cuda = any(p.device.type == "cuda" for p in params)
    mesh = _check_mesh(mesh, "cuda" if on_cuda else "cpu")
    want = _mesh_device(mesh)
    for p, name in zip(params, names):
        if p.device.type != "meta" and p.device != want:
            raise bad_value("module", label, f"parameter {name} is on {p.device}, and the "
                            f"mesh's collectives move {want} memory",
                            f"move the module to {want} first, or pass a matching mesh")
    raf, post_comm = _resolve_reshard(reshard_after_forward, mesh)
    group = None
    if params:
        if spmd is not None and spmd.shard is None:  # DDP: replicated, nothing sharded
            if want.type != "cpu":
                raise not_built("dp_mesh_dims", dp_mesh_dims, "replicate names alone (DDP "
                                "over the mesh) on a CUDA mesh", "name a shard dim too")
            shard, replicate = self_comm(), _comm(mesh.get_group(0), mesh)
        elif mesh.ndim == 2:
            shard = _comm(mesh.get_group(1), mesh)
            replicate = _comm(mesh.get_group(0), mesh)
        else:
            shard, replicate = _comm(mesh.get_group(0), mesh), None
        group = ParamGroup(params, aliases, mesh, shard, replicate, mp_policy, names, dims,
                           spmd)
        group.post_comm = post_comm
        group.register_sharded()
    state = FSDPState(modules, group, raf, mp_policy)
    for m in modules:
        m.__dict__[STATE_ATTR] = state
        m.__class__ = _fsdp_class(type(m))
    return modules if isinstance(module, (list, tuple)) else module


# torch's contract accessor: fully_shard.state(module) -> its state, or None
fully_shard.state = state_of
