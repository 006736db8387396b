"""clip_grad_norm_ over a sharded model: torch FSDP1's semantics.

The norm is of the whole model's gradient, every rank's shard counted once:
each rank sums its shards' squares in C (one pass, f64), the sums are added
across ranks, and parameters outside sharded units (ignored modules; NO_SHARD
units, whose gradients every rank holds whole) are added once, locally. A rank
that holds no gradient still takes part in the collective, with zero.

On a CUDA device the partial sums come from one kernel per shard
(runtime/cuda.py's norm_partial), the total stays on the device and the
gradients are scaled by a device scalar: the host never waits.
"""
import math

import torch

from .. import _C
from ..errors import bad_type, bad_value
from ..runtime import cuda
from ..runtime.comm import all_gather_into, all_reduce_
from ..tensors import dtype_code
from .unit import fsdp_units


def _partial(grads, inf, norm_type):
    if inf or norm_type == 2.0:
        return _C.norm_partial([(g.data_ptr(), dtype_code(g.dtype), g.numel())
                                for g in grads], inf)
    return sum(float(torch.linalg.vector_norm(g.double(), norm_type)) ** norm_type
               for g in grads)


def _partial_device(grads, inf, norm_type, device):
    """_partial as a float64 device scalar: device gradients by kernel, no
    host wait; host ones (CPUOffload keeps them there) in C on the host."""
    host = [g for g in grads if g.device.type == "cpu"]
    out = torch.full((), _partial(host, inf, norm_type) if host else 0.0, dtype=torch.float64,
                     device=device)
    for g in grads:
        if g.device.type == "cpu":
            continue
        if inf or norm_type == 2.0:
            part = cuda.norm_partial(g, float("inf") if inf else 2.0)
        else:
            part = torch.linalg.vector_norm(g.double(), norm_type) ** norm_type
        out = torch.maximum(out, part) if inf else out + part
    return out


def _clip_device(comm, sharded, whole, max_norm, norm_type, inf, device):
    local = _partial_device(sharded, inf, norm_type, device).reshape(1)
    if inf:
        every = torch.empty(comm.world_size, dtype=torch.float64, device=device)
        all_gather_into(comm, every, local)
        total = torch.maximum(every.max(), _partial_device(whole, True, norm_type, device))
    else:
        all_reduce_(comm, local)
        total = (local[0] + _partial_device(whole, False, norm_type, device)) ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in sharded + whole:
            g.mul_(coef.to(g.device, g.dtype))
    dtype = (sharded + whole)[0].dtype if sharded or whole else torch.float32
    return total.to(dtype)


def clip_grad_norm_(root, max_norm, norm_type=2.0):
    """FSDP.clip_grad_norm_ on the root unit `root`: see the module docstring."""
    overlap = root.__dict__.get("_offload_overlap")  # offload_pipeline.py
    if overlap is not None:
        overlap.check_clip()
    if root._root_state is not None and root._root_state.owner is not root:
        raise bad_value("clip_grad_norm_()", type(root).__name__, "it must be called on the "
                        "root FSDP module", "call it on the outermost wrapper")
    for name, v in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise bad_type(f"clip_grad_norm_({name}=...)", v, "a positive number (inf allowed "
                           "for norm_type)")
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    sharded, whole, seen = [], [], set()
    comm = None
    for m in fsdp_units(root):
        comm = comm or m._unit.c.comm
        for g in m._unit.groups:
            tensors = [g.shard] if not m._unit.use_orig_params else g.params
            for p in tensors:
                seen.add(id(p))
                if p.grad is not None:
                    (whole if m._unit.no_shard else sharded).append(p.grad.contiguous())
    whole += [p.grad for p in root.parameters() if id(p) not in seen and p.grad is not None]
    if comm.device == "cuda":
        return _clip_device(comm, sharded, whole, max_norm, norm_type, inf,
                            root._cfg.device)
    local = _partial(sharded, inf, norm_type)
    if inf:  # the max over ranks: gather every rank's maximum
        mine = torch.tensor([local], dtype=torch.float64)
        every = torch.empty(comm.world_size, dtype=torch.float64)
        all_gather_into(comm, every, mine)
        total = max(every.max().item(), _partial(whole, True, norm_type))
    else:
        t = torch.tensor([local], dtype=torch.float64)
        all_reduce_(comm, t)
        total = (t.item() + _partial(whole, False, norm_type)) ** (1.0 / norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for g in sharded + whole:
                g.mul_(coef)
    dtype = (sharded + whole)[0].dtype if sharded or whole else torch.float32
    return torch.tensor(total, dtype=dtype)
