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
    allocator for its device buffers (the engine's host table, csrc/glue/py_env.c)."""
    def empty(numel, code):
        return torch.empty(numel, dtype=_DTYPES[code], device=device)
    return empty


def cuda_comm(group, device):
    """The device Comm of a process group on one CUDA device (made once per
    group; every rank of the group calls it, since NCCL's set-up is
    collective)."""
    key = (id(group), str(device))
    hit = _COMMS.get(key)
    if hit is not None and hit[0] is group:
        return hit[1]
    backend = nccl_comm_for(group, device)
    index = device.index

    def stream():
        return torch.cuda.current_stream(index).cuda_stream

    comm = _C.Comm("device", backend.rank, backend.world_size, capsule=backend.comm.capsule(),
                   owner=backend.comm, device_api=cuda._C_cuda.device_api, stream_fn=stream,
                   empty=empty_fn(device))
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


def tensor_fits(comm, t):
    """Whether a tensor's memory is what `comm` moves: CUDA memory for a
    CUDA Comm, host memory for every other."""
    return (t.device.type == "cuda") == (comm.device == "cuda")
