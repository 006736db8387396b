"""FullyShardedDataParallel: torch FSDP1's wrapper class on flatshard's core.

Same constructor signature, same module structure (`_fsdp_wrapped_module`,
`_flat_param`), same strategies. Construction, in order:
  1. resolve and validate every argument (config.py; the policy's,
     param_init_fn's and the ignored modules' own checks: unit_plan.py), on
     this rank alone: a bad argument is refused at once, before the ranks
     agree;
  2. plan the units (unit_plan.py: auto_wrap_policy's targets, innermost
     first, then the root; meta-device parameters materialized with
     param_init_fn; each unit's options and parameters): still no collective;
  3. the ranks agree that they wrap the same thing (runtime/consistency.py);
  4. sync_module_states: broadcast parameters and buffers from rank 0;
  5. build the units, innermost first, the root last (_setup).
Each unit flattens its parameters (flat_param.py) and hands them to a C unit
(the engine's unit, csrc/engine/unit.h); unit.py connects it to torch's hooks. The state-dict,
summon and clipping methods delegate to state_dict.py,
optim_state.py, summon.py and clip.py, which find the units through
unit.py (`fsdp_units`) and never import this module; register_comm_hook
checks the hook in comm_hook.py and rebuilds the C units with its reduce
dtype.
"""
import contextlib
import dataclasses

import torch
import torch.nn as nn

from .. import _C
from ..noop import mixed_precision as noop_mp, wrap_policy as noop_wrap
from ..errors import ConfigAssertionError, StateError, bad_type, bad_value, not_built
from ..options import BackwardPrefetch, ShardingStrategy, StateDictType
from ..runtime import consistency, eager
from ..runtime.comm import broadcast_
from ..runtime.device import empty_fn
from ..runtime.trees import cast_floating
from ..tensors import dtype_code
from . import clip, comm_hook, config, mistakes, optim_state, summon, unit_plan
from . import state_dict as state_dicts
from .flat_param import FlatGroup, flat_param_name, mark_flat_param
from .groups import unit_comms
from .root import RootState
from .unit import UnitRuntime

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"


def _cast_buffers(module, dtype):
    """Floating-point buffers of the modules a unit manages -> buffer_dtype."""
    stack = [module]
    while stack:
        m = stack.pop()
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point():
                m._buffers[name] = b.to(dtype)
        stack.extend(c for c in m._modules.values()
                     if c is not None and not isinstance(c, FullyShardedDataParallel))


def _sync_module_states(module, comm, ignored_params):
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            if t not in ignored_params:
                broadcast_(comm, t.data if isinstance(t, nn.Parameter) else t, root=0,
                           tag="sync_module_states")


def noop_settings(plan, policy, module, world):
    """Settings of this wrap that change nothing, said once (noop/)."""
    noop_mp.fsdp1(plan, list(module.buffers()))
    noop_wrap.fsdp1(plan, policy, world)


class FullyShardedDataParallel(nn.Module):
    """Shard a module's parameters, gradients and optimizer state across a
    process group, with torch FSDP1's constructor and semantics.

    Args follow torch.distributed.fsdp.FullyShardedDataParallel (process_group:
    the group to shard over, default the world: gloo for CPU devices, any
    for CUDA ones). Built: sharding_strategy FULL_SHARD / SHARD_GRAD_OP /
    NO_SHARD, and SHARD_OPTIM (ZeRO-1, flatshard's own); cpu_offload (on a
    CUDA device the shards and gradients stay in pinned host memory, staged
    on the device for each gather; not with NO_SHARD or SHARD_OPTIM there);
    auto_wrap_policy (torch's or flatshard's policies); backward_prefetch;
    forward_prefetch; limit_all_gathers (accepted, no effect: collectives
    are ordered after the caller's stream, so at most two all-gathers, a
    prefetch and the one issued, are ever in flight: docs/migrating.md);
    ignored_modules / ignored_states;
    param_init_fn; device_id (CPU, or a CUDA device with flatshard's NCCL
    backend); sync_module_states; use_orig_params; device_mesh (1-D).
    mixed_precision (under NO_SHARD the whole shard is cast at each forward).
    HYBRID_SHARD / _HYBRID_SHARD_ZERO2 shard inside a group and all-reduce
    the gradient shards across replicas: process_group=(shard_group,
    replicate_group), a 2-D device_mesh (replicate, shard), or None under
    torchrun (each host's LOCAL_WORLD_SIZE ranks shard); sharded state
    dicts hold DTensors on the 2-D (replicate, shard) mesh.

    flatshard's own keywords: comm_backend "auto" (default; on CPU shared
    memory when all ranks are on one host, else the process group; on a
    CUDA device flatshard's NCCL communicator), "shm", "torch" or "nccl";
    FLATSHARD_COMM_BACKEND sets it when not given. comm_quant: a
    flatshard.CommQuant (quantized gathers and gradient reductions, for
    bandwidth-bound links: docs/comm_quant.md) or None (default: off); a
    wrap policy may override it per unit. check_replicas_every: where
    ranks must hold equal values (NO_SHARD, the hybrid strategies'
    replicas), every this many optimizer steps they compare a
    CRC-32C of each parameter and warn (ReplicaDriftWarning) where one
    differs; 0: never; None (default): FLATSHARD_CHECK_REPLICAS_EVERY,
    else 1000 (flatshard/checks/replicas.py).
    """

    def __init__(self, module, process_group=None, sharding_strategy=None, cpu_offload=None,
                 auto_wrap_policy=None, backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                 mixed_precision=None, ignored_modules=None, param_init_fn=None, device_id=None,
                 sync_module_states=False, forward_prefetch=False, limit_all_gathers=True,
                 use_orig_params=False, ignored_states=None, device_mesh=None, *,
                 comm_backend=None, comm_quant=None, check_replicas_every=None):
        super().__init__()
        if isinstance(module, type) and issubclass(module, nn.Module):
            raise bad_type("module", module, "an nn.Module instance",
                           f"pass {module.__name__}(...), not the class")
        if not isinstance(module, nn.Module):
            raise bad_type("module", module, "an nn.Module")
        if isinstance(module, FullyShardedDataParallel):
            raise bad_value("module", type(module).__name__, "the module is already wrapped")
        kw = dict(process_group=process_group, sharding_strategy=sharding_strategy,
                  cpu_offload=cpu_offload, backward_prefetch=backward_prefetch,
                  mixed_precision=mixed_precision, device_id=device_id,
                  forward_prefetch=forward_prefetch, limit_all_gathers=limit_all_gathers,
                  use_orig_params=use_orig_params, device_mesh=device_mesh,
                  comm_backend=comm_backend, comm_quant=comm_quant)
        cfg = config.resolve(kw)
        every = mistakes.replicas_every(check_replicas_every)
        policy, ctx = unit_plan.checked_arguments(module, auto_wrap_policy, param_init_fn,
                                                  sync_module_states, ignored_modules,
                                                  ignored_states)
        # The plan is local too (it runs the policy and param_init_fn on the
        # model, which may differ between ranks); the ranks then agree on
        # what they wrap before the first collective (runtime/consistency.py).
        meta = mistakes.meta_names(module)
        plan, ctx = consistency.agree(cfg.group, lambda: unit_plan.plan_units(
            module, cfg, kw, policy, param_init_fn, sync_module_states, ctx))
        _, comm, replicate, _ = unit_comms(cfg)
        noop_settings(plan, auto_wrap_policy, module, comm.world_size)
        if sync_module_states:  # across replicas first, then from each shard group's first
            if replicate is not None:
                _sync_module_states(module, replicate, ctx.ignored_params)
            _sync_module_states(module, comm, ctx.ignored_params)
        mistakes.compare_init(cfg, plan, meta, sync_module_states)
        built = []
        for up in plan[:-1]:  # innermost first; the root is last
            unit = type(self).__new__(type(self))
            nn.Module.__init__(unit)
            unit._setup(up)
            parent_name, _, attr = up.name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, unit)
            built.append(unit)
        self._setup(plan[-1])
        mistakes.built(built + [self], every)

    # ------------------------------------------------------------------
    # construction

    def _setup(self, up):
        eager.install(type(self))  # the hooks torch.compile runs eagerly
        module, cfg = up.module, up.cfg
        group, comm, replicate, replicas_only = unit_comms(cfg)
        if cfg.hybrid is not None:  # the group the unit's collectives run over; with
            # one rank per host or one host, the unit is plain NO_SHARD / sharded
            cfg = dataclasses.replace(cfg, group=group,
                                      hybrid=None if replicate is None else cfg.hybrid)
        self._fsdp_wrapped_module = module
        self._cfg = cfg
        self._root_state = None
        world, rank = comm.world_size, comm.rank
        mp = cfg.mixed_precision
        # CPUOffload on a device: the shards (and their gradients) stay in
        # host memory, pinned, and each gather stages them on the device.
        host_shards = cfg.offload_params and comm.device is not None
        # One rank has nothing to shard: run as NO_SHARD (as torch FSDP does),
        # unless mixed precision needs the gather (a cast) all the same, or
        # the shards live in host memory.
        no_shard = cfg.strategy is ShardingStrategy.NO_SHARD or replicas_only or (
            world == 1 and (mp is None or mp.param_dtype is None) and not host_shards)
        groups = []
        for i, (key, order) in enumerate(up.groups):
            groups.append(FlatGroup(i, [p for p, _ in order], [a for _, a in order], world, rank,
                                    1 if no_shard else world, cfg.device,
                                    mp.param_dtype if mp else None,
                                    mp.reduce_dtype if mp else None, host_shards=host_shards,
                                    replicated=no_shard))
        if mp is not None and mp.buffer_dtype is not None:
            _cast_buffers(module, mp.buffer_dtype)
        grad_mask = sum(1 << g.index for g in groups if g.requires_grad)
        strategy = ShardingStrategy.NO_SHARD if no_shard else cfg.strategy
        shard_optim = strategy is ShardingStrategy.SHARD_OPTIM  # the engine's own strategy

        def new_cunit():  # again after register_comm_hook changes the reduce dtype
            c = _C.Unit(up.label, comm, strategy.value,
                        [(g.shard, g.full, dtype_code(g.dtype), g.shard_numel,
                          g.padded_numel, g.lp, dtype_code(g.compute_dtype),
                          dtype_code(g.reduce_dtype)) for g in groups], grad_mask,
                        empty=empty_fn(cfg.device) if comm.device else None,
                        offload=host_shards, replicate=None if no_shard else replicate)
            if cfg.comm_quant is not None and not no_shard:  # no_shard: nothing moves but sums
                c.set_comm_quant(*cfg.comm_quant.engine_args)
            return c
        self._new_cunit = new_cunit
        self._unit = UnitRuntime(up.label, new_cunit(), groups, cfg.use_orig_params, no_shard,
                                 cfg.backward_prefetch, cfg.forward_prefetch,
                                 shard_optim=shard_optim, offload_params=cfg.offload_params)
        self._unit.flat_param_module = module  # stays so under a checkpoint wrapper
        cut = len(up.name) + 1 if up.name else 0
        for g in groups:  # isinstance(g.shard, FlatParameter) is True, as in torch
            mark_flat_param(g.shard, [a[0].fqn[cut:] for a in g.aliases], g.shapes, g.numels)
        if not cfg.use_orig_params:
            for g in groups:
                module.register_parameter(flat_param_name(g.index), g.shard)

    def _lazy_init(self):
        units = [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
        state = RootState(self, [m._unit for m in units])
        for m in units:
            m._root_state = state
            m._unit.root = state
            m._unit.c.is_root = m is self
            m._unit.hand_plain()
        return state

    # ------------------------------------------------------------------
    # running

    @eager.hook(recursive=False)
    def forward(self, *args, **kwargs):
        """torch.compile runs this frame and the unit's hooks eagerly and
        compiles the wrapped module's forward (runtime/eager.py): one graph
        break per unit, at the call of this forward."""
        args, kwargs = self._pre_forward(args, kwargs)
        try:
            # (from _modules directly: the attribute goes through two __getattr__s)
            out = self._modules[FSDP_WRAPPED_MODULE](*args, **kwargs)
        except BaseException:
            self._unit.abort_forward()
            raise
        return self._post_forward(out)

    @eager.hook
    def _pre_forward(self, args, kwargs):
        root = self._root_state or self._lazy_init()
        is_root = root.owner is self
        if is_root:
            root.begin_forward()
        mp = self._cfg.mixed_precision
        if mp is not None and mp.param_dtype is not None and (
                mp.cast_forward_inputs or (is_root and mp.cast_root_forward_inputs)):
            args, kwargs = cast_floating((args, kwargs), mp.param_dtype)
        self._unit.pre_forward()
        return args, kwargs

    @eager.hook
    def _post_forward(self, out):
        out = self._unit.post_forward(out)
        if self._root_state.owner is self:
            self._root_state.end_forward()
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Inside: backward accumulates unsharded gradients locally with no
        communication (they stay in memory, unsharded). The first backward
        outside reduces the accumulated sum."""
        units = [m._unit for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
        saved = [u.sync_grads for u in units]
        for u in units:
            u.sync_grads = False
        mistakes.no_sync(units)
        try:
            yield
        finally:
            for u, s in zip(units, saved):
                u.sync_grads = s

    def apply(self, fn):
        """As torch's: fn(module) on every submodule (children first) and on
        this module, with this FSDP module's full parameters shown and
        written back to the shards afterwards; each FSDP module inside shows
        its own while fn runs on its modules (parameter initialization after
        wrapping). Not inside summon_full_params. Returns self."""
        with summon.summon_full_params(self, recurse=False, writeback=True):
            return nn.Module.apply(self, fn)

    def named_parameters(self, *args, **kwargs):
        """nn.Module.named_parameters (prefix, recurse, remove_duplicate);
        inside summon_full_params the names carry no `_fsdp_wrapped_module.`,
        as torch's."""
        clean = self._unit.c.state == "SUMMON"
        for name, p in super().named_parameters(*args, **kwargs):
            yield (name.replace(FSDP_WRAPPED_MODULE + ".", "") if clean else name), p

    def named_buffers(self, *args, **kwargs):
        """nn.Module.named_buffers, with names cleaned inside
        summon_full_params as named_parameters'."""
        clean = self._unit.c.state == "SUMMON"
        for name, b in super().named_buffers(*args, **kwargs):
            yield (name.replace(FSDP_WRAPPED_MODULE + ".", "") if clean else name), b

    def check_is_root(self):
        """Whether this is the root FSDP module: the outermost one, whose
        forward runs the model's. As torch, the first call (like the first
        forward) initializes lazily and makes this module the root of the
        FSDP modules under it."""
        root = self._root_state or self._lazy_init()
        return root.owner is self

    @staticmethod
    def fsdp_modules(module, root_only=False):
        """Every FSDP module under `module` (itself included), in
        module.modules() order; with `root_only`, only the roots (which
        initializes lazily, as check_is_root does)."""
        if not isinstance(module, nn.Module):
            raise bad_type("module", module, "an nn.Module")
        if not isinstance(root_only, bool):
            raise bad_type("root_only", root_only, "True or False")
        found = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        return [m for m in found if m.check_is_root()] if root_only else found

    def register_comm_hook(self, state, hook):
        """Register torch's communication hook (`hook`, with its `state`) for
        the gradient reduction of every FSDP module under this one, the
        root, before the first forward. Honoured through the engine's own
        reduction, so only torch's default hooks
        (torch.distributed.algorithms._comm_hooks.default_hooks) are taken:
        allreduce_hook (NO_SHARD) and reduce_scatter_hook (sharded) with a
        DefaultState over the model's process group average as the engine
        does already; fp16_compress_hook / bf16_compress_hook with a
        LowPrecisionState reduce in float16 / bfloat16 and cast back to the
        parameters' dtype. Any other hook is refused with a NotBuiltError
        (see flatshard/fsdp/comm_hook.py)."""
        if not self.check_is_root():
            raise ConfigAssertionError("flatshard: register_comm_hook can only be called on a "
                                       "root instance (as in torch)")
        units = [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
        dtype = comm_hook.plan(units, state, hook)
        if dtype is not None:
            busy = [fs._unit.name for fs in units if fs._unit.c.state != "IDLE" or
                    fs._unit.c.reduce_pending or
                    (fs._unit.c.is_unsharded and not fs._unit.no_shard)]
            if busy:
                raise StateError(f"flatshard: register_comm_hook() needs every unit idle and "
                                 f"resharded, but units {busy} are not: register it before "
                                 "the first forward (as torch asks)")
            for fs in units:  # the engine's reduce dtype, for every floating group
                for g in fs._unit.groups:
                    if g.dtype.is_floating_point:
                        g.reduce_dtype = dtype
                old, new = fs._unit.c, fs._new_cunit()
                new.is_root = old.is_root
                fs._unit.set_engine(new)
        for fs in units:
            fs.__dict__["_flatshard_comm_hook"] = (hook, state)

    @property
    def module(self):
        """The wrapped module."""
        return self._fsdp_wrapped_module

    @property
    def sharding_strategy(self):
        return self._cfg.strategy

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == FSDP_WRAPPED_MODULE:
                raise
            return getattr(self._fsdp_wrapped_module, name)

    def __getitem__(self, key):
        return self._fsdp_wrapped_module.__getitem__(key)

    # ------------------------------------------------------------------
    # state dicts (fsdp/state_dict.py): the plain model's keys, torch FSDP's types

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        """The plain model's keys; what the values are is set by
        FSDP.state_dict_type (default FULL_STATE_DICT): see flatshard.fsdp.state_dict.
        destination, prefix, keep_vars: nn.Module.state_dict's."""
        return state_dicts.state_dict(self, destination, prefix, keep_vars)

    def load_state_dict(self, state_dict, strict=True, assign=False):
        """Load a state dict with the plain model's keys (full tensors or
        DTensors; flat shards under LOCAL_STATE_DICT). Checks every name and
        shape before changing anything. state_dict, strict: nn.Module's;
        assign=True is refused (the parameters are views of flat shards)."""
        return state_dicts.load_state_dict(self, state_dict, strict, assign)

    # ------------------------------------------------------------------
    # torch FSDP1's static state-dict API (summon.py, state_dict.py,
    # optim_state.py, all in fsdp/)

    @staticmethod
    def summon_full_params(module, recurse=True, writeback=True, rank0_only=False,
                           offload_to_cpu=False, with_grads=False):
        """Context manager: inside, the FSDP modules under `module` (only
        `module` itself with recurse=False) show their full parameters in the
        original shapes; with writeback, changes are copied back to the shards.
        rank0_only: only rank 0 shows them; offload_to_cpu: torch's flag (the
        parameters are on the CPU already); with_grads: show the full
        gradients too."""
        return summon.summon_full_params(module, recurse, writeback, rank0_only,
                                         offload_to_cpu, with_grads)

    @staticmethod
    def set_state_dict_type(module, state_dict_type, state_dict_config=None,
                            optim_state_dict_config=None):
        """Set the state dict type of every FSDP module under `module`;
        returns the previous StateDictSettings. state_dict_type: a
        StateDictType; state_dict_config, optim_state_dict_config: the
        matching configs (None: the defaults)."""
        return state_dicts.set_state_dict_type(module, state_dict_type, state_dict_config,
                                               optim_state_dict_config)

    @staticmethod
    def get_state_dict_type(module):
        return state_dicts.get_state_dict_type(module)

    @staticmethod
    def state_dict_type(module, state_dict_type, state_dict_config=None,
                        optim_state_dict_config=None):
        """Context manager form of set_state_dict_type (state_dict_type,
        state_dict_config, optim_state_dict_config as there): restores the
        previous settings on exit."""
        return state_dicts.state_dict_type(module, state_dict_type, state_dict_config,
                                           optim_state_dict_config)

    @staticmethod
    def optim_state_dict(model, optim, optim_state_dict=None, group=None):
        """The optimizer's state keyed by the plain model's parameter names,
        whole (FULL) or as DTensors (SHARDED), per the model's state dict type.
        optim: the optimizer over model.parameters(); optim_state_dict: its
        state_dict() if already taken (None: taken here)."""
        _check_disk_offload(model, optim)
        return optim_state.optim_state_dict(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(model, optim, optim_state_dict, is_named_optimizer=False,
                                 load_directly=False, group=None):
        """A state dict from optim_state_dict -> one optim.load_state_dict takes,
        for the optimizer `optim` over `model`. is_named_optimizer,
        load_directly: torch's flags (is_named_optimizer=True is refused;
        load_directly=True also loads it into optim)."""
        _check_disk_offload(model, optim)
        return optim_state.optim_state_dict_to_load(model, optim, optim_state_dict,
                                                    is_named_optimizer, load_directly, group)

    # torch FSDP1's older optimizer-state API (deprecated in torch, kept with
    # its meaning: fsdp/optim_state.py). Each warns as torch does.

    @staticmethod
    def full_optim_state_dict(model, optim, optim_input=None, rank0_only=True, group=None):
        """The optimizer's whole state keyed by the plain model's parameter
        names (FULL, whatever the model's state dict type), on rank 0 only
        with `rank0_only` (the other ranks get {}). optim: the optimizer over
        model's parameters; optim_input: torch's deprecated argument (the
        parameters or parameter groups given to the optimizer, which then
        give the IDs); group: the model's process group or None.
        Collective."""
        _refuse_disk_offload(optim)
        return optim_state.full_optim_state_dict(model, optim, optim_input, rank0_only, group)

    @staticmethod
    def sharded_optim_state_dict(model, optim, group=None):
        """The optimizer's state keyed by parameter names, each per-element
        value a DTensor holding this rank's Shard(0) chunk (torch gives
        ShardedTensors here; flatshard's SHARDED form is DTensors
        throughout). model, optim, group: as in full_optim_state_dict.
        Collective."""
        _refuse_disk_offload(optim)
        return optim_state.sharded_optim_state_dict(model, optim, group)

    @staticmethod
    def shard_full_optim_state_dict(full_optim_state_dict, model, optim_input=None, optim=None):
        """full_optim_state_dict (from FSDP.full_optim_state_dict, on every
        rank) -> this rank's optimizer state dict, keyed by parameter IDs,
        for optim.load_state_dict, on any world size. IDs: positions in
        optim's param_groups when `optim` is given, else in optim_input
        (torch's deprecated argument) or model.parameters()."""
        _refuse_disk_offload(optim)
        return optim_state.shard_full_optim_state_dict(full_optim_state_dict, model, optim_input,
                                                       optim)

    @staticmethod
    def flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim):
        """sharded_optim_state_dict (from FSDP.sharded_optim_state_dict) ->
        this rank's optimizer state dict for optim.load_state_dict (model:
        the wrapped model; optim: its optimizer). Collective: the DTensors
        are gathered."""
        _refuse_disk_offload(optim)
        return optim_state.flatten_sharded_optim_state_dict(sharded_optim_state_dict, model,
                                                            optim)

    @staticmethod
    def scatter_full_optim_state_dict(full_optim_state_dict, model, optim_input=None, optim=None,
                                      group=None):
        """As shard_full_optim_state_dict, with full_optim_state_dict read on
        rank 0 only (the other ranks may pass None) and sent to the others
        over the model's process group (`group`, or None). model, optim_input,
        optim: as there. Collective."""
        _refuse_disk_offload(optim)
        return optim_state.scatter_full_optim_state_dict(full_optim_state_dict, model,
                                                         optim_input, optim, group)

    @staticmethod
    def rekey_optim_state_dict(optim_state_dict, optim_state_key_type, model, optim_input=None,
                               optim=None):
        """optim_state_dict keyed by parameter names <-> by parameter IDs
        (optim_state_key_type: OptimStateKeyType.PARAM_NAME or PARAM_ID,
        flatshard's or torch's), for `model`, wrapped or plain: e.g. a full
        optimizer state dict made loadable into the plain model's optimizer.
        IDs: positions in optim's param_groups when `optim` is given, else in
        optim_input or model.parameters(). A flat parameter (use_orig_params
        =False) holding several parameters has no single name: refused, as
        in torch."""
        return optim_state.rekey_optim_state_dict(optim_state_dict, optim_state_key_type, model,
                                                  optim_input, optim)

    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """Clip the gradient of the whole model (all units, all ranks) to
        max_norm; returns the total norm before clipping (torch FSDP1's call).
        norm_type: 2.0, inf, or any positive p. Call it on the root."""
        return clip.clip_grad_norm_(self, max_norm, norm_type)


def _refuse_disk_offload(optim):
    """The older optimizer-state API always gathers (or scatters) the moments,
    which a DiskOffload optimizer keeps in files."""
    if getattr(optim, "offload", None) is not None:
        raise not_built("optim", f"{type(optim).__name__}(offload=DiskOffload(...))", "its "
                        "moments are in files, which full and sharded optimizer state dicts "
                        "do not gather; save optim.state_dict() on every rank")


def _check_disk_offload(model, optim):
    """FULL/SHARDED optimizer state dicts gather the moments, which a
    DiskOffload optimizer keeps in files: refused rather than dropped."""
    if getattr(optim, "offload", None) is None:
        return
    if state_dicts.get_state_dict_type(model).state_dict_type is not StateDictType.LOCAL_STATE_DICT:
        raise not_built("optim", f"{type(optim).__name__}(offload=DiskOffload(...))", "its "
                        "moments are in files, which full and sharded optimizer state dicts "
                        "do not gather; save optim.state_dict() on every rank (it refers to the "
                        "rank's current state file), or use LOCAL_STATE_DICT")


FSDP = FullyShardedDataParallel
