"""torch's private names for fully_shard's per-module state, as frameworks
and torch's own tests reach for them, over flatshard's FSDPState.

  fully_shard.state(module)        the module's state, None if fully_shard was
                                   not applied to it (torch's contract accessor)
  FSDPModule._get_fsdp_state()     the same; AssertionError where there is none
  state._fsdp_param_group          a ParamGroupView of the state's group, None
                                   for a module without parameters of its own
  state._fsdp_param_groups         that group in a list (empty: none)
  state._is_root                   None until lazily initialized (the first
                                   forward, or _lazy_init: not an unshard()
                                   before it, as torch's), then bool
  state._state_ctx.all_states      the root's tree of states, root first
  state._lazy_init()               decide the root and its tree now, as the
                                   first forward would (a no-op after it);
                                   a RuntimeError (errors.RootError) where
                                   torch raises one: a root of several
                                   modules, a state below lazily initialized
                                   already (FSDPState.lazy_init)
  state._modules_to_run_forward    the state's modules whose forward must
                                   still run before its group's post-forward:
                                   always empty, since each module of a
                                   fully_shard([a, b]) state runs its own
                                   hooks (a set, so clear() works as on torch's)

  group.fsdp_params[i]             an FSDPParamView: sharded_param (the
                                   registered DTensor), unsharded_param (the
                                   plain Parameter the modules hold while
                                   unsharded; None before the first gather),
                                   sharded_size, padded_sharded_param_size;
                                   _module_info (torch's ParamModuleInfo: the
                                   module and name it is registered at, and
                                   any other places, shared_modules and
                                   shared_param_names), _param_fqn (its name
                                   in the root's named_parameters(); None
                                   until lazy init)
  group._module_fqn                the group's modules' names in the root's
                                   tree, ", "-joined ("" for the root; None
                                   until lazy init)
  group.is_unsharded               whether its unsharded parameters are
                                   registered and gathered (a deferred gather
                                   not waited for yet: False, as torch's)
  group.mesh_info.mesh             the mesh fully_shard was given (2-D for HSDP)
  group.post_backward()            reduce what the group holds and reshard, at
                                   once: torch's manual call after a backward
                                   without gradient sync (pipelining does it)

The views read the state live: a group rebuilt (to_empty, a cast, an
assignment) shows its new parameters. Nothing else of torch's private
classes is offered: where a script reads more, it fails on the name.

Imports: torch only (the state is handed in).
"""
import dataclasses

import torch

try:  # torch's class, so that code checking for it finds it
    from torch.distributed.fsdp._fully_shard._fsdp_param import ParamModuleInfo
except ImportError:  # a torch that moved it: the same fields
    @dataclasses.dataclass
    class ParamModuleInfo:
        module: torch.nn.Module
        param_name: str
        shared_modules: list = dataclasses.field(default_factory=list)
        shared_param_names: list = dataclasses.field(default_factory=list)


class _MeshInfo:
    __slots__ = ("mesh",)

    def __init__(self, mesh):
        self.mesh = mesh


class _StateCtx:
    """torch's FSDPStateContext: what every state of one tree shares."""
    __slots__ = ("_root",)

    def __init__(self, root):
        self._root = root

    @property
    def all_states(self):
        return list(self._root.states or [self._root])


class FSDPParamView:
    """torch's FSDPParam, parameter i of a group, read live."""
    __slots__ = ("_state", "_group", "_i")

    def __init__(self, state, i):
        self._state, self._group, self._i = state, state.group, i

    @property
    def sharded_param(self):
        return self._group.sharded[self._i]

    @property
    def unsharded_param(self):
        unsharded = self._group.unsharded
        return None if unsharded is None else unsharded[self._i]

    @property
    def sharded_size(self):
        """This rank's rows, unpadded (torch.chunk's)."""
        return self.sharded_param._local_tensor.size()

    @property
    def padded_sharded_param_size(self):
        """Every rank's chunk padded to the first one's rows, on dim 0
        (torch's padding of the all-gather input)."""
        g, i = self._group, self._i
        d = g.shard_dims[i]
        size = list(self.sharded_size)
        if d == 0:
            size[0] = g.entries[i].chunk_rows
        return torch.Size(size)

    @property
    def _module_info(self):
        """Where the parameter is registered: its first place (module and
        unprefixed name), then every other (a tied parameter, a shared
        module), in fully_shard's walk of its modules, as torch's."""
        (module, name), *shared = self._group.aliases[self._i]
        return ParamModuleInfo(module, name, [m for m, _ in shared], [n for _, n in shared])

    @property
    def _param_fqn(self):
        st = self._state
        return st.param_fqns[self._i] if st.decided else None


class ParamGroupView:
    """torch's FSDPParamGroup of one state."""
    __slots__ = ("_state",)

    def __init__(self, state):
        self._state = state

    @property
    def fsdp_params(self):
        st = self._state
        return [FSDPParamView(st, i) for i in range(len(st.group.sharded))]

    @property
    def _module_fqn(self):
        st = self._state
        return st.fqn if st.decided else None

    @property
    def is_unsharded(self):
        c = self._state.group.c
        return bool(c.is_unsharded and not c.gather_pending)

    @property
    def mesh_info(self):
        return _MeshInfo(self._state.group.mesh)

    def post_backward(self):
        self._state.post_backward_now()


def param_group(state):
    return None if state.group is None else ParamGroupView(state)


def is_root(state):
    return state.is_root if state.decided else None


def state_ctx(state):
    return _StateCtx(state.root or state)


def lazy_init(state):
    state.lazy_init()


def modules_to_run_forward(state):
    return set()
