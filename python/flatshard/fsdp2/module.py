"""FSDPModule: the class fully_shard mixes into each module it is applied
to (api.py makes the subclass): torch's per-module API over the module's
state (state.py) and its parameter group (param.py); and
register_fsdp_forward_method.

Each method checks its arguments before it changes anything; most then set
the module's state (FSDPState) or group (ParamGroup), `recurse` reaching the
FSDP modules inside this one. A few of torch's methods only tune CUDA memory
or overlap, which flatshard's engine decides itself: those check their
arguments and change nothing (their docstrings say so). torch 2.15's
set_manual_backward_finalization, finalize_backward (finalize.py) and
set_keep_unsharded_storage are defined only where the installed torch has
them (torch_facts.VERSIONED): a script sees the surface of its torch.
"""
import warnings

from torch.distributed.fsdp import UnshardHandle as _TorchUnshardHandle

from .. import torch_facts
from ..errors import bad_type, bad_value, not_built
from . import finalize, mistakes
from ..options import normalize_comm_quant
from .mesh import check_reshard, resolve_reshard
from .state import STATE_ATTR, state_of

__all__ = ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method"]


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
        check_bool("async_op", async_op)
        st = self._fsdp_state()
        st.lazy_init(claimable=True)  # the root is decided by the first forward, as torch's
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
        check_bool("async_op", async_op)
        for m in self._fsdp_modules(True):
            m._fsdp_state().unshard_async_op = async_op

    def set_requires_gradient_sync(self, requires_gradient_sync, *, recurse=True):
        """`requires_gradient_sync=False`: backward accumulates unreduced
        gradients locally (gradient accumulation without communication);
        True again reduces them all at the next backward. `recurse`: also
        for the FSDP modules inside this one."""
        check_bool("requires_gradient_sync", requires_gradient_sync)
        check_bool("recurse", recurse)
        for m in self._fsdp_modules(recurse):
            m._fsdp_state().requires_gradient_sync = requires_gradient_sync
        if not requires_gradient_sync:
            mistakes.sync_off([m._fsdp_state() for m in self._fsdp_modules(recurse)])

    def set_is_last_backward(self, is_last_backward):
        """Accepted for torch's API (`is_last_backward`: a bool). flatshard's
        reductions finish inside the backward that issues them, so no
        backward leaves work pending."""
        check_bool("is_last_backward", is_last_backward)
        self._fsdp_state().is_last_backward = is_last_backward

    def set_reshard_after_forward(self, reshard_after_forward, recurse=True):
        """Change `reshard_after_forward` (True, False or an int, as in
        fully_shard) for this module and, with `recurse`, those inside it."""
        check_reshard(reshard_after_forward, none_ok=False)
        check_bool("recurse", recurse)
        for m in self._fsdp_modules(recurse):
            st = m._fsdp_state()
            if st.group is None:
                raf = reshard_after_forward
            else:
                raf, st.group.post_comm = resolve_reshard(reshard_after_forward, st.group.mesh)
            st.reshard_after_forward = st.reshard_after_forward_arg = raf

    def set_reshard_after_backward(self, reshard_after_backward, *, recurse=True):
        """`reshard_after_backward=False` keeps the parameters gathered after
        backward (e.g. between micro-batches); `recurse` as above."""
        check_bool("reshard_after_backward", reshard_after_backward)
        check_bool("recurse", recurse)
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
        check_bool("unshard_in_backward", unshard_in_backward)
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
            finalize.reset(st)  # torch 2.15's manual finalization: its handle invalidated
        for s in st.states or [st]:
            s.forget_held_reshard()  # frozen parameters: forwards the failed backward reached
            g = s.group
            if g is None:
                continue
            g.c.clear_arrived()
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
        check_bool("requires_all_reduce", requires_all_reduce)
        check_bool("recurse", recurse)
        for g in self._groups(recurse):
            g.all_reduce = requires_all_reduce

    def set_comm_quant(self, quant, *, recurse=True):
        """flatshard's own (torch has none): quantized collectives for this
        module's group and, with `recurse`, the FSDP modules inside it, from
        the next gather and reduction on. `quant`: a flatshard.CommQuant
        (int8 gathers, int8/int4 gradient reductions: docs/comm_quant.md) or
        None (off, the default). On a CPU mesh (shm or a torch process
        group); on a CUDA mesh a NotBuiltError. HSDP: the shard group's
        collectives are quantized, the all-reduce across replicas is not."""
        quant = normalize_comm_quant("quant", quant)
        check_bool("recurse", recurse)
        groups = self._groups(recurse)
        for g in groups:
            if g.comm.device is not None and quant is not None:
                raise not_built("quant", quant, "quantized collectives on a CUDA mesh: the "
                                "engine runs them on host memory only", "pass None there")
        for g in groups:
            g.set_comm_quant(quant)

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
        check_bool("enable", enable)
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
        check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
        check_bool("recurse", recurse)
        for g in self._groups(recurse):
            g.reduce_unused = reduce_scatter_unused_params
        for m in self._fsdp_modules(recurse):  # [Note: unused parameters] in unused.py
            m._fsdp_state().hand_options()

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
        check_bool("recurse", recurse)

    def set_separate_reduce_scatter_group(self, enable=True, *, recurse=True):
        """torch (CUDA): run the reduce-scatter on its own process group so
        it overlaps the all-gather. Only speed changes; flatshard's
        collectives are ordered on one stream per Comm, so `enable` is
        checked (a bool) and has no effect. `recurse`: accepted for torch's
        API."""
        check_bool("enable", enable)
        check_bool("recurse", recurse)

    def set_allocate_memory_from_process_group_for_comm(self, enable):
        """torch (CUDA, NCCL): allocate the collectives' staging buffers from
        the process group's allocator. Only memory placement changes; the
        engine allocates its own buffers, so `enable` is checked (a bool)
        and has no effect (nothing to do on CPU)."""
        check_bool("enable", enable)

    def set_symm_mem_for_comm(self, backend="NCCL"):
        """torch (CUDA): symmetric-memory staging buffers for the
        all-gather. Only memory placement and speed change; `backend` is
        checked ("NCCL", the only one torch has) and has no effect (nothing
        to do on CPU)."""
        if backend != "NCCL":
            raise bad_value("backend", backend, 'only "NCCL" is a symmetric memory backend')

    # torch 2.15 ([Note: manual finalization] in finalize.py)
    if torch_facts.torch_has("FSDPModule", "set_manual_backward_finalization"):
        set_manual_backward_finalization = finalize.set_manual_backward_finalization
    if torch_facts.torch_has("FSDPModule", "finalize_backward"):
        finalize_backward = finalize.finalize_backward

    if torch_facts.torch_has("FSDPModule", "set_keep_unsharded_storage"):
        def set_keep_unsharded_storage(self, keep, *, recurse=True):
            """torch 2.15: `keep=True` keeps each group's unsharded storage
            across reshard, so the unsharded parameters' data pointers are
            the same at every unshard (for CUDA graph capture), at the cost
            of the unsharded bytes staying allocated (memory_stats counts
            them as "unsharded"; the planner's keep_unsharded_storage).
            False frees them at the next reshard, and now where resharded.
            `recurse`: also the FSDP modules inside this one.
            (csrc/engine/shard_group.h, [Note: kept storage])"""
            check_bool("keep", keep)
            check_bool("recurse", recurse)
            for g in self._groups(recurse):
                g.set_keep_storage(keep)

    def _apply(self, *args, **kwargs):
        # to_empty(), to(), float()...: the sharded parameters may be new objects.
        self.reshard()
        ret = super()._apply(*args, **kwargs)
        g = self._fsdp_state().group
        if g is not None:
            g.refresh_sharded()
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
        inputs = st.pre_forward_hook(self, args, kwargs)  # changed inputs, or None
        if inputs is not None:
            args, kwargs = inputs
        out = orig(*args, **kwargs)
        cast = st.post_forward_hook(self, args, out)  # the output, cast where mp asks
        return out if cast is None else cast
    object.__setattr__(module, method_name, wrapped.__get__(module, type(module)))


# ----------------------------------------------------------------------
# argument checks (check_bool: fully_shard's too)


def check_bool(arg, value):
    if not isinstance(value, bool):
        raise bad_type(arg, value, "True or False")


def _check_modules(arg, modules):
    if not isinstance(modules, (list, tuple)):
        raise bad_type(arg, modules, "a list of modules that fully_shard was applied to")
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise bad_type(arg, m, "a list of modules that fully_shard was applied to",
                           "apply fully_shard to each module first")
    return [m._fsdp_state() for m in modules]
