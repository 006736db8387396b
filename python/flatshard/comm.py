"""Collectives facade: one flatshard._C.Comm per process group.

The C core issues every collective through its backend interface
(csrc/comm.h). This module builds the backend for a process group and gives
Python a tensor-level view of the same calls (used at wrap time, e.g. for
sync_module_states, and by tests). The "torch" backend calls back into
`_torch_collective` below with DLPack capsules over the C core's buffers.
"""
import torch
import torch.distributed as dist
from torch.utils.dlpack import from_dlpack

from . import _C

DTYPE_CODES = {
    torch.float32: _C.F32, torch.float16: _C.F16, torch.bfloat16: _C.BF16,
    torch.float64: _C.F64, torch.uint8: _C.U8, torch.int32: _C.I32, torch.int64: _C.I64,
}


def dtype_code(dtype):
    try:
        return DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"flatshard: dtype {dtype} is not supported by the C core; "
                        f"supported: {', '.join(str(d) for d in DTYPE_CODES)}") from None


def _torch_collective(group):
    """The Python half of the torch backend, bound to one process group.

    Always asks for SUM: averaging is done in C because gloo's AVG sums."""
    group_ranks = dist.get_process_group_ranks(group)
    # torch 2.13 renamed the flat collectives (*_single); 2.11 has the old names.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

    def run(op, a, b, arg):
        if op == "all_gather":
            all_gather(from_dlpack(b), from_dlpack(a), group=group)
        elif op == "reduce_scatter":
            reduce_scatter(from_dlpack(b), from_dlpack(a), op=dist.ReduceOp.SUM, group=group)
        elif op == "all_reduce":
            dist.all_reduce(from_dlpack(a), op=dist.ReduceOp.SUM, group=group)
        elif op == "broadcast":
            dist.broadcast(from_dlpack(a), src=group_ranks[arg], group=group)
        elif op == "barrier":
            dist.barrier(group=group)
        else:
            raise ValueError(f"flatshard: unknown collective {op!r}")

    return run


_COMMS = {}


def comm_for(group):
    """The Comm of a process group (one per group, cached)."""
    key = id(group)
    hit = _COMMS.get(key)
    if hit is not None and hit[0] is group:
        return hit[1]
    comm = _C.Comm("torch", _torch_collective(group), dist.get_rank(group),
                   dist.get_world_size(group))
    _COMMS[key] = (group, comm)
    return comm


def _flat(t, arg):
    if not t.is_contiguous():
        raise ValueError(f"flatshard: {arg} must be contiguous")
    return t.data_ptr(), t.numel(), dtype_code(t.dtype)


def broadcast_(comm, tensor, root=0):
    """Broadcast a contiguous tensor of any dtype in place, as raw bytes."""
    flat = tensor.detach().contiguous().view(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
    comm.broadcast(raw.data_ptr(), raw.numel(), _C.U8, root)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.detach().copy_(flat.view_as(tensor))


def all_gather_into(comm, out, inp):
    ip, n, code = _flat(inp, "input")
    op, on, ocode = _flat(out, "output")
    if ocode != code or on != n * comm.world_size:
        raise ValueError("flatshard: all_gather output must be world_size times the input")
    comm.all_gather(ip, op, n, code)


def reduce_scatter_into(comm, out, inp, average=True):
    ip, n, code = _flat(inp, "input")
    op, on, ocode = _flat(out, "output")
    if ocode != code or n != on * comm.world_size:
        raise ValueError("flatshard: reduce_scatter input must be world_size times the output")
    comm.reduce_scatter(ip, op, on, code, average)


def all_reduce_(comm, tensor, average=False):
    p, n, code = _flat(tensor, "tensor")
    comm.all_reduce(p, n, code, average)
