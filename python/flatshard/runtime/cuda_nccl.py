"""The NCCL collective backend: flatshard calls NCCL from C (csrc/cuda/
comm_nccl.c), not through torch's process group.

`nccl_comm_for(group)` builds (once per group) an NcclBackend: one NCCL
communicator over the group's ranks, its unique id passed through the
group's store, on the current CUDA device. The NcclBackend holds what is
NCCL's own (its groups, the bounded wait, close); its collectives are those
of the flatshard._C.Comm(kind='device') over it (device.py's cuda_comm, or
nccl_device_comm), called with tensors through comm.py's functions like
every other Comm's. Each runs on the communicator's own stream, ordered
against the caller's current stream with events (no host synchronisation),
its float32 staging for bfloat16/float16 reductions taken from torch's
caching allocator. A failed collective raises flatshard.CoreError naming it
and its `tag`; fatal ones abort the communicator (ncclCommAbort) so the
other ranks fail instead of hanging, and `wait()` gives up after the
timeout (FLATSHARD_COMM_TIMEOUT, default 300 s), raising
flatshard._C_cuda.NcclError as the set-up does.

libnccl.so.2 is opened at run time: the copy torch already loaded, else the
`nvidia-nccl` wheel's, else the default library search path, or the path in
FLATSHARD_NCCL_LIBRARY.
"""
import atexit
import datetime
import glob
import os

import torch
import torch.distributed as dist

from .. import envvars
from ..errors import bad_value, not_built
from . import cuda
from .timeout import comm_timeout_s

ENV_LIBRARY = "FLATSHARD_NCCL_LIBRARY"


def nccl_library_path():
    """Where libnccl.so.2 is: env override, the one loaded in this process
    (torch's), the nvidia-nccl wheel's, or None (default search path)."""
    chosen = envvars.read(ENV_LIBRARY)
    if chosen:
        return chosen
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libnccl.so"):
                    return path
    except OSError:
        pass
    try:
        import nvidia.nccl
        for root in getattr(nvidia.nccl, "__path__", []):
            hits = sorted(glob.glob(os.path.join(root, "lib", "libnccl.so*")))
            if hits:
                return hits[0]
    except ImportError:
        pass
    return None


def load_nccl():
    """Open NCCL (once); returns its version code, e.g. 22703 for 2.27.3."""
    cuda._need("nccl")
    if cuda._C_cuda.nccl_version():
        return cuda._C_cuda.nccl_version()
    return cuda._C_cuda.nccl_load(nccl_library_path())


def nccl_usable():
    """Built with CUDA, a GPU visible to torch, and libnccl loadable."""
    if not cuda.available():
        return False
    try:
        load_nccl()
    except cuda._C_cuda.NcclError:
        return False
    return True


def _version_str(code):
    major, rest = divmod(code, 10000)
    return f"{major}.{rest // 100}.{rest % 100}"


def describe():
    """One line for `python -m flatshard doctor`."""
    if not cuda.built():
        return "CUDA kernels: not built (no nvcc at install); nccl backend: not built"
    info = cuda.runtime_info()
    rt = f"CUDA runtime {info['runtime_version'] // 1000}.{info['runtime_version'] % 1000 // 10}"
    if not info["device_count"]:
        return f"CUDA kernels: built ({rt}); no GPU here ({info['error'] or 'none found'})"
    try:
        nccl = f"NCCL {_version_str(load_nccl())} ({nccl_library_path() or 'default path'})"
    except cuda._C_cuda.NcclError as e:
        nccl = f"NCCL not loadable: {e}"
    return f"CUDA kernels: built ({rt}, {info['device_count']} GPU(s)); nccl backend: {nccl}"


class NcclBackend:
    """One NCCL communicator (see module doc): `comm` is the raw
    flatshard._C_cuda.NcclComm, on `device`; its collectives go through a
    Comm(kind='device') over it (device.nccl_device_comm)."""

    def __init__(self, comm, device, timeout_s):
        self.comm, self.device, self.timeout_s = comm, device, timeout_s
        self.rank, self.world_size = comm.rank, comm.world_size

    def wait(self, timeout_s=None):
        self.comm.wait(self.timeout_s if timeout_s is None else timeout_s)

    def group(self):
        """`with backend.group(): ...` issues the collectives inside as one
        NCCL group (one launch for e.g. several units' all-gathers)."""
        return _Group(self)

    def close(self):
        self.comm.close()


class _Group:
    def __init__(self, backend):
        self.backend = backend

    def __enter__(self):
        self.backend.comm.group_start(stream=cuda.stream_handle(device=self.backend.device))
        return self.backend

    def __exit__(self, *exc):
        self.backend.comm.group_end()


def _unique_id(group, key):
    """Rank 0 of the group makes the id; the others read it from the store."""
    rank = dist.get_rank(group)
    if dist.get_world_size(group) == 1:
        return cuda._C_cuda.nccl_unique_id()
    store = dist.distributed_c10d._get_default_store()
    if rank == 0:
        store.set(key, cuda._C_cuda.nccl_unique_id())
    else:
        store.wait([key], datetime.timedelta(seconds=comm_timeout_s()))
    return store.get(key)


_BACKENDS = {}
_CREATED = [0]


def nccl_comm_for(group=None, device=None):
    """The NcclBackend of a process group (default: the world), made once per
    group; every rank of the group calls it. device: this rank's GPU (torch's
    current device by default)."""
    if not cuda.available():
        raise not_built("comm_backend", "nccl", "the NCCL backend needs flatshard built with "
                        "nvcc and a CUDA device visible to torch")
    group = group if group is not None else dist.group.WORLD
    hit = _BACKENDS.get(id(group))
    if hit is not None and hit[0] is group:
        return hit[1]
    load_nccl()
    device = torch.device("cuda", torch.cuda.current_device()) if device is None \
        else torch.device(device)
    if device.type != "cuda":
        raise bad_value("device", str(device), "expected a CUDA device")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    _CREATED[0] += 1
    key = f"flatshard/nccl/{group.group_name}/{_CREATED[0]}"
    uid = _unique_id(group, key)
    timeout = comm_timeout_s()
    comm = cuda._C_cuda.NcclComm(dist.get_rank(group), dist.get_world_size(group), uid,
                                 device.index, timeout)
    backend = NcclBackend(comm, device, timeout)
    _BACKENDS[id(group)] = (group, backend)
    return backend


@atexit.register
def _close_all():
    # Before torch tears CUDA down: destroying a communicator later may crash.
    for _, backend in list(_BACKENDS.values()):
        try:
            backend.close()
        except Exception:  # noqa: BLE001  (exit path: nothing left to report to)
            pass
    _BACKENDS.clear()
