"""torch's FSDP2 all-gather extensions: a parameter whose class defines
fsdp_pre_all_gather / fsdp_post_all_gather decides what is all-gathered
(float8 data and scales, a bf16 cast, NF4 blocks) and how the unsharded
tensor is rebuilt from it.

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
written into a plain tensor by the class's copy_ (param.py, _plain).
"""
import inspect

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..runtime.comm import all_gather_into


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


def _storage_nbytes(t):
    return t.untyped_storage().nbytes()


class Extension:
    """One extension parameter of a ParamGroup: its gather buffers and the
    unsharded parameter its class built."""

    def __init__(self, param, name, module, mp_policy, chunk_rows):
        n = len(inspect.signature(param.fsdp_pre_all_gather).parameters)
        if n not in (1, 5):
            raise ConfigError(
                f"flatshard: parameter {name}: fsdp_pre_all_gather takes {n} arguments; "
                "expected fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, "
                "mp_policy) or fsdp_pre_all_gather(mesh)")
        self.name = name
        self.module = module
        self.mp_policy = mp_policy
        self.new_signature = n == 5
        self.chunk_rows = chunk_rows
        self.outputs = None     # gathered inputs, (world * chunk_rows, *rest) each
        self.inner = ()         # tensors the class said hold the unsharded data
        self.inner_nbytes = []
        self.unsharded = None   # the unsharded nn.Parameter, made by the first gather

    def reset(self):
        """The sharded parameter was replaced (nn.Module._apply): rebuild."""
        self.outputs, self.inner, self.inner_nbytes, self.unsharded = None, (), [], None

    def _inputs(self, local, mesh, shape, stride):
        if self.new_signature:
            inputs, meta = local.fsdp_pre_all_gather(mesh, shape, stride, self.module,
                                                     self.mp_policy)
        else:
            inputs, meta = local.fsdp_pre_all_gather(mesh)
        padded = []
        for t in inputs:
            if type(t) not in (torch.Tensor, nn.Parameter):
                raise ConfigError(f"flatshard: parameter {self.name}: fsdp_pre_all_gather "
                                  f"returned a {type(t).__qualname__}; all-gather inputs must "
                                  "be plain tensors")
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
