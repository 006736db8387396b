"""Where a wrapper's units live, and the Comm that moves their memory.

Units on CPU use a host backend (shm or torch, comm.py) directly. Units on a
CUDA device use a Comm(kind='device') (csrc/glue/py_comm.c): the NCCL
communicator of cuda_nccl.py, with the CUDA kernels' table (csrc/engine/fs_device.h),
every collective and kernel enqueued on torch's current stream of that
device. The unit takes its own device buffers from torch's caching allocator
through `empty_fn`, so torch.cuda.memory_allocated() counts them.

`host_device_comm` builds the same kind of Comm over a host backend with the
host table (copy.h's loops, streams ignored): the units' device path, run on
any machine. The CUDA path differs from it only in the table and in the
backend underneath.
"""
import torch

from .. import _C
from ..tensors import DTYPE_CODES
from . import cuda, diagnostics
from .cuda_nccl import nccl_comm_for
from .timeout import comm_timeout_s

_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
_COMMS = {}


def empty_fn(device):
    """empty(numel, dtype_code) -> a new 1-D tensor on `device`: the unit's
    allocator for its device buffers (the engine's host table, csrc/hooks/env.c)."""
    def empty(numel, code):
        return torch.empty(numel, dtype=_DTYPES[code], device=device)
    return empty


def nccl_device_comm(backend):
    """The Comm(kind='device') over an NcclBackend (cuda_nccl.py): every
    collective on its NCCL communicator goes through it, on torch's current
    stream of the backend's device, with float32 staging from `empty_fn`."""
    index = backend.device.index

    def stream():
        return torch.cuda.current_stream(index).cuda_stream

    return _C.Comm("device", backend.rank, backend.world_size, capsule=backend.comm.capsule(),
                   owner=backend.comm, device_api=cuda._C_cuda.device_api, stream_fn=stream,
                   empty=empty_fn(backend.device), device_index=index)


def cuda_comm(group, device):
    """The device Comm of a process group on one CUDA device (made once per
    group; every rank of the group calls it, since NCCL's set-up is
    collective)."""
    key = (id(group), str(device))
    hit = _COMMS.get(key)
    if hit is not None and hit[0] is group:
        return hit[1]
    comm = nccl_device_comm(nccl_comm_for(group, device))
    diagnostics.install(comm, group, f"{group.group_name}/nccl", comm_timeout_s())
    _COMMS[key] = (group, comm)
    return comm


def host_device_comm(comm):
    """A Comm(kind='device') over the host Comm `comm`, with the host table:
    runs the units' device path (per-reduction buffers from `empty_fn`,
    kernels through the table, a stream bound before each collective) on
    CPU tensors."""
    return _C.Comm("device", comm.rank, comm.world_size, capsule=comm.capsule(), owner=comm,
                   device_api=_C.host_device_api, stream_fn=lambda: 0,
                   empty=empty_fn(torch.device("cpu")))


def memory_of(comm):
    """What memory `comm` moves, as the tensor checks name it: 'cuda:i' for a
    CUDA Comm that knows its device ('cuda' for one that does not), 'host'
    for every other."""
    if comm.device != "cuda":
        return "host"
    return "cuda" if comm.device_index is None else f"cuda:{comm.device_index}"


def tensor_fits(comm, t):
    """Whether a tensor's memory is what `comm` moves: CUDA memory (of its
    device, where it knows it) for a CUDA Comm, host memory for every other."""
    if comm.device != "cuda":
        return t.device.type != "cuda"
    return t.device.type == "cuda" and comm.device_index in (None, t.device.index)
