"""torch's FSDP2 all-gather extensions: a parameter whose class defines
fsdp_pre_all_gather / fsdp_post_all_gather decides what is all-gathered
(float8 data and scales, a bf16 cast, NF4 blocks) and how the unsharded
tensor is rebuilt from it.

The methods are read from the sharded parameter's local tensor at every
all-gather, as torch reads them: defined on its class, or attached to the
local tensor itself after fully_shard (`param._local_tensor.fsdp_pre_all_gather
= ...`, a plain tensor's included). A tensor-subclass parameter without them
at wrap is sharded as one that has them (it may get them so before the first
forward); still without them at its first all-gather, it is refused there by
name. A plain parameter whose local tensor got them moves from the group's
flat all-gather to this path at its next all-gather (param.py,
sync_registered).

The protocol, as torch's fully_shard runs it:
  pre   local_shard.fsdp_pre_all_gather(mesh, outer_size, outer_stride,
        module, mp_policy) (or the older (mesh) form)
        -> (inputs, metadata): plain tensors of the padded shard's rows
  gather each input over the shard group into (world * rows, *rest)
  post  first time: local_shard.fsdp_post_all_gather(outputs, metadata,
        param_dtype) -> (unsharded tensor, inner tensors); the unsharded
        parameter is its first numel elements in the parameter's shape.
        Later: the same call with out=unsharded parameter refills it in place,
        so tensors autograd saved keep seeing it.
  reshard frees the storage of the outputs and the inner tensors.

Each input is moved as raw bytes, so any dtype (float8 included) travels
bit for bit. The parameter's gradient takes the group's ordinary
reduce-scatter into a plain sharded gradient; one of a subclass is first
written into a plain tensor by the class's copy_ (tensors.to_plain), as
is an all-gather input of a subclass.
"""
import inspect

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..errors import ConfigError, NotBuiltError
from ..runtime.comm import all_gather_into
from ..tensors import is_plain, to_plain


def has_extension(t):
    """Whether t's class runs its own all-gather; ConfigError for half of it."""
    pre, post = hasattr(t, "fsdp_pre_all_gather"), hasattr(t, "fsdp_post_all_gather")
    if pre != post:
        raise ConfigError(
            f"flatshard: a {type(t).__qualname__} parameter defines only "
            f"{'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'}; both "
            "fsdp_pre_all_gather and fsdp_post_all_gather should be defined if using "
            "all-gather extensions")
    return pre


def gathers_itself(p):
    """Whether parameter p takes this path (at wrap): its class defines the
    extension, or it is a tensor subclass (not a DTensor: tensor parallel's
    local tensors are sharded as plain ones, tp.py), whose local tensor may
    get it after fully_shard."""
    return has_extension(p) or not (is_plain(p) or isinstance(p, DTensor))


def _new_signature(fn, name):
    """Whether fsdp_pre_all_gather `fn` (bound) takes the five arguments of
    torch's current protocol (else the older (mesh) one)."""
    n = len(inspect.signature(fn).parameters)
    if n not in (1, 5):
        raise ConfigError(
            f"flatshard: parameter {name}: fsdp_pre_all_gather takes {n} arguments; "
            "expected fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, "
            "mp_policy) or fsdp_pre_all_gather(mesh)")
    return n == 5


def _storage_nbytes(t):
    return t.untyped_storage().nbytes()


class Extension:
    """One extension parameter of a ParamGroup: its gather buffers and the
    unsharded parameter its class built."""

    def __init__(self, param, name, module, mp_policy, chunk_rows):
        if has_extension(param):  # a wrong signature is refused at wrap
            _new_signature(param.fsdp_pre_all_gather, name)
        self.name = name
        self.kind = type(param)
        self.module = module
        self.mp_policy = mp_policy
        self.chunk_rows = chunk_rows
        self.outputs = None     # gathered inputs, (world * chunk_rows, *rest) each
        self.inner = ()         # tensors the class said hold the unsharded data
        self.inner_nbytes = []
        self.unsharded = None   # the unsharded nn.Parameter, made by the first gather

    def reset(self):
        """The sharded parameter was replaced (nn.Module._apply): rebuild."""
        self.outputs, self.inner, self.inner_nbytes, self.unsharded = None, (), [], None

    def _refuse(self):
        kind = self.kind
        raise NotBuiltError(
            f"flatshard: fully_shard: parameter {self.name} is a {kind.__module__}."
            f"{kind.__qualname__} (a tensor subclass) and its local tensor defines no "
            "all-gather extension at its first all-gather; flatshard moves plain "
            "torch.Tensor / nn.Parameter data only, except that fully_shard runs a parameter "
            "whose class or local tensor defines torch's all-gather extension "
            "(fsdp_pre_all_gather and fsdp_post_all_gather). Define both on the class, or "
            "attach both to the parameter's _local_tensor after fully_shard and before the "
            "forward; or keep such modules out of the wrap (ignored_params) or use plain "
            "parameters")

    def _inputs(self, local, mesh, shape, stride):
        if not has_extension(local):
            self._refuse()
        if _new_signature(local.fsdp_pre_all_gather, self.name):
            inputs, meta = local.fsdp_pre_all_gather(mesh, shape, stride, self.module,
                                                     self.mp_policy)
        else:
            inputs, meta = local.fsdp_pre_all_gather(mesh)
        padded = []
        for t in inputs:
            if not is_plain(t):  # a subclass's values, as torch's copy-in writes them
                t = to_plain(t)
            if t.dim() == 0 or t.shape[0] > self.chunk_rows:
                raise ConfigError(
                    f"flatshard: parameter {self.name}: fsdp_pre_all_gather returned an input "
                    f"of shape {tuple(t.shape)}; all-gather inputs hold the shard's rows "
                    f"(at most {self.chunk_rows}) on dim 0")
            if t.shape[0] < self.chunk_rows:  # an uneven last shard: pad with zero rows
                pad = t.new_zeros((self.chunk_rows - t.shape[0], *t.shape[1:]))
                t = torch.cat([t, pad])
            padded.append(t.contiguous())
        return padded, meta

    def gather(self, comm, local, mesh, shape, stride, dtype, requires_grad):
        """All-gather this parameter's inputs and (re)build its unsharded
        parameter; returns it."""
        with torch.no_grad():
            inputs, meta = self._inputs(local, mesh, shape, stride)
            world = comm.world_size
            if self.outputs is None or [o.shape[1:] for o in self.outputs] != \
                    [t.shape[1:] for t in inputs]:
                self.outputs = [torch.empty((world * t.shape[0], *t.shape[1:]), dtype=t.dtype,
                                            device=t.device) for t in inputs]
            for o in self.outputs:
                o.untyped_storage().resize_(o.numel() * o.element_size())
            for t, o in zip(inputs, self.outputs):
                all_gather_into(comm, o.view(-1).view(torch.uint8),
                                t.view(-1).view(torch.uint8), tag="fully_shard.unshard")
            outputs = tuple(self.outputs)
            if self.unsharded is None:
                tensor, inner = local.fsdp_post_all_gather(outputs, meta, dtype)
                self.inner = tuple(inner)
                self.inner_nbytes = [_storage_nbytes(t) for t in self.inner]
                full = torch.as_strided(tensor, shape, stride, 0)
                self.unsharded = nn.Parameter(full, requires_grad=requires_grad)
            else:
                for t, n in zip(self.inner, self.inner_nbytes):
                    if _storage_nbytes(t) != n:
                        t.untyped_storage().resize_(n)
                # A refill, as the plain path's copy-out: what autograd saved
                # from the unsharded parameter in forward stays valid.
                with torch.autograd._unsafe_preserve_version_counter(self.unsharded):
                    local.fsdp_post_all_gather(outputs, meta, dtype, out=self.unsharded)
        return self.unsharded

    def free(self):
        """Reshard: the gathered and rebuilt data go; the objects stay."""
        for t in list(self.outputs or ()) + list(self.inner):
            if _storage_nbytes(t):
                t.untyped_storage().resize_(0)
