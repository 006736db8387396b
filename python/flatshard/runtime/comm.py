"""Collectives facade: one flatshard._C.Comm per process group and backend.

The C core issues every collective through its backend interface
(csrc/backends/comm.h). This module picks and builds the backend for a process group
and gives Python a tensor-level view of the same calls (used at wrap time,
e.g. for sync_module_states, and by tests).

Backends (`comm_backend=` on the wrapper, or the FLATSHARD_COMM_BACKEND
environment variable when the argument is not given):
  "auto"   shm when every rank of the group is on this host, else torch
  "shm"    shared memory between the ranks of one host (csrc/backends/comm_shm.c)
  "torch"  the process group itself (gloo), through `_torch_collective`
  "nccl"   CUDA devices (device.py, cuda_nccl.py): flatshard's own NCCL
           communicator; "auto" picks it for units on a CUDA device. Its
           tensor-level collectives are the functions below, as every Comm's
Every shm wait gives up after FLATSHARD_COMM_TIMEOUT seconds (timeout.py:
default 300; the process group's own timeout where that is shorter) with an
error naming the rank that did not arrive and where it is. Every collective
is recorded in the Comm's ledger (Comm.ledger()); a failed one reports where
each rank was (diagnostics.py).
FLATSHARD_SHM_SLOT_BYTES sets each rank's staging slot in the segment
(default 8 MiB; transfers go in chunks of at most a quarter of it,
_C.SHM_SECTIONS sections used in turn, smaller where the CPU's last-level
cache is small: comm_shm.c, [Note: chunk size], [Note: chunk pipeline]).
"""
import atexit
import os
import socket
import sys
import time
import uuid

import torch
import torch.distributed as dist
from torch.utils.dlpack import from_dlpack

from .. import _C, envvars, torch_facts
from ..errors import bad_type, bad_value
from ..tensors import check_plain, dtype_code
from . import diagnostics
from .comm_check import check_reductions
from .device import cuda_comm, memory_of, tensor_fits
from .timeout import wait_timeout

BACKENDS = ("auto", "shm", "torch", "nccl")
ENV_BACKEND = "FLATSHARD_COMM_BACKEND"
ENV_SLOT = "FLATSHARD_SHM_SLOT_BYTES"
ENV_STAGING = "FLATSHARD_SHM_STAGING"
STAGING_CHOICES = ("auto", "cached", "streamed")
# Staging per rank in the shm segment: _C.SHM_SECTIONS sections, one chunk
# in flight each.
DEFAULT_SLOT_BYTES = 8 << 20
MIN_SLOT_BYTES = 4096

class _NoStashedContext:
    """Issue a collective without the Python object torch's backward stashes
    in thread-local state (torch/autograd/graph.py, key "context").

    A gloo collective copies the issuing thread's state into its work item,
    and a worker thread drops the item after the caller has moved on. When
    that item holds a Python object and the caller is already finalizing the
    interpreter, the worker cannot take the GIL and the process aborts
    ("terminate called without an active exception"). Collectives issued
    from backward hooks (every gradient reduce-scatter) would carry it."""
    KEY = "context"

    def __init__(self):
        self.tls = torch_facts.autograd_tls()  # (has, get, remove, stash) or None
        self.saved = None

    def __enter__(self):
        self.saved = None
        if self.tls is not None and self.tls[0](self.KEY):
            self.saved = self.tls[1](self.KEY)
            self.tls[2](self.KEY)

    def __exit__(self, *exc):
        if self.saved is not None:
            self.tls[3](self.KEY, self.saved)
            self.saved = None


def _torch_collective(group):
    """The Python half of the torch backend, bound to one process group.

    Always asks for SUM: averaging is done in C because gloo's AVG sums."""
    group_ranks = dist.get_process_group_ranks(group)
    all_gather, reduce_scatter = torch_facts.flat_collectives()

    no_stash = _NoStashedContext()

    def run(op, a, b, arg):
        with no_stash:
            _run(op, a, b, arg)

    def _run(op, a, b, arg):
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
        elif op == "all_to_all":  # quantized reductions' block exchange (bytes)
            dist.all_to_all_single(from_dlpack(b), from_dlpack(a), group=group)
        else:
            raise ValueError(f"flatshard: unknown collective {op!r}")

    return run


def custom_comm(group, all_gather=None, reduce_scatter=None, reduce_dtype=torch.float32):
    """A torch-backend Comm over `group` whose all-gathers and reduce-scatters
    call the user's objects (torch's AllGather / ReduceScatter protocol:
    fully_shard's set_custom_all_gather / set_custom_reduce_scatter) with
    the engine's buffers, and everything else torch's collectives. Their
    allocate() is not called: the engine owns its buffers. Not cached: one
    per group that sets them. A custom reduce-scatter's arithmetic is
    checked at once in `reduce_dtype` (comm_check.py), on every rank of
    `group`."""
    default = _torch_collective(group)
    no_stash = _NoStashedContext()

    def done(work):  # an async_op=False call may still hand back a Work
        if work is not None and hasattr(work, "wait"):
            work.wait()

    def run(op, a, b, arg):
        if op == "all_gather" and all_gather is not None:
            with no_stash:
                done(all_gather(output_tensor=from_dlpack(b), input_tensor=from_dlpack(a),
                                group=group, async_op=False))
        elif op == "reduce_scatter" and reduce_scatter is not None:
            with no_stash:
                done(reduce_scatter(output_tensor=from_dlpack(b), input_tensor=from_dlpack(a),
                                    group=group, op=dist.ReduceOp.SUM, async_op=False))
        else:
            default(op, a, b, arg)

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if reduce_scatter is not None:  # checked with torch's all-gather: the user's is not counted on
        def user_reduce_scatter_only(op, a, b, arg):
            (run if op == "reduce_scatter" else default)(op, a, b, arg)
        check_reductions(_C.Comm("torch", rank, world, fn=user_reduce_scatter_only),
                         f"custom reduce-scatter {type(reduce_scatter).__name__}",
                         (reduce_dtype,), ("reduce_scatter",))
    return _C.Comm("torch", rank, world, fn=run)


_SELF = {}  # global rank -> its Comm (ranks may be threads of one process)


def self_comm():
    """A Comm of this rank alone (world size 1, host memory): the shard group
    of a group that shards over nothing (fully_shard's DDP over a mesh dim,
    dp_mesh_dims with replicate names only). Its all-gather and
    reduce-scatter are copies; the rest do nothing."""
    rank = dist.get_rank()
    comm = _SELF.get(rank)
    if comm is None:
        def run(op, a, b, arg):
            if op in ("all_gather", "reduce_scatter", "all_to_all"):
                from_dlpack(b).copy_(from_dlpack(a))
        comm = _SELF[rank] = _C.Comm("torch", 0, 1, fn=run)
    return comm


def requested_backend(value):
    """The comm_backend argument (or, when None, the environment) -> a name."""
    arg = "comm_backend"
    if value is None:
        value, arg = envvars.read(ENV_BACKEND) or "auto", ENV_BACKEND
    if not isinstance(value, str):
        raise bad_type(arg, value, f"one of {', '.join(map(repr, BACKENDS))}")
    if value not in BACKENDS:
        raise bad_value(arg, value, f"expected one of {', '.join(map(repr, BACKENDS))}")
    return value


def backend_for_device(value, device, arg="comm_backend"):
    """A requested backend name, checked against the units' device: CUDA
    memory moves only through 'nccl' ('auto' picks it), host memory only
    through 'shm' or 'torch'."""
    if device.type == "cuda":
        if value not in ("auto", "nccl"):
            raise bad_value(arg, value, "units on a CUDA device move device memory, which "
                            "only the 'nccl' backend can", "use 'auto' or 'nccl'")
        return "nccl"
    if value == "nccl":
        raise bad_value(arg, value, f"the NCCL backend moves CUDA memory, and these units are "
                        f"on {device}", "pass device_id=torch.device('cuda', local_rank) with "
                        "the module on that device, or use 'auto', 'shm' or 'torch'")
    return value


def shm_slot_bytes():
    raw = envvars.read(ENV_SLOT)
    if raw is None:
        return DEFAULT_SLOT_BYTES
    if not raw.isdigit() or int(raw) < MIN_SLOT_BYTES:
        raise bad_value(ENV_SLOT, raw, f"expected a whole number of bytes, at least {MIN_SLOT_BYTES}")
    return int(raw)


def shm_staging():
    """FLATSHARD_SHM_STAGING ([Note: staging stores], csrc/backends/shm_staging.h)."""
    raw = envvars.read(ENV_STAGING)
    if raw is None:
        return "auto"
    if raw not in STAGING_CHOICES:
        raise bad_value(ENV_STAGING, raw, "expected one of " + ", ".join(map(repr, STAGING_CHOICES)))
    return raw


def _host_identity():
    """This machine, as the shm segment sees it: hostname and boot id."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}|{boot}"


def _pid_namespace():
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _all_gather_bytes(text, group, width=128):
    raw = text.encode()[:width].ljust(width, b"\0")
    mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = torch.empty(width * dist.get_world_size(group), dtype=torch.uint8)
    torch_facts.flat_collectives()[0](out, mine, group=group)
    return [bytes(out[i * width:(i + 1) * width].tolist()).rstrip(b"\0").decode()
            for i in range(dist.get_world_size(group))]


def _shm_comm(name, rank, world, timeout_s, create=False, slot_bytes=None):
    """-> (Comm or None, error text): this rank's end of the segment."""
    try:
        return _C.Comm("shm", rank, world, name=name, create=create,
                       slot_bytes=slot_bytes or shm_slot_bytes(), timeout_s=timeout_s,
                       staging=shm_staging()), ""
    except Exception as e:  # e.g. a FLATSHARD_SHM_SLOT_BYTES that only this rank has wrong
        return None, str(e)


def _ok_everywhere(err, group):
    ok = torch.tensor([0 if err else 1], dtype=torch.int32)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return ok.item() == 1


def _segment_name():
    """A new segment's name, chosen by the group's rank 0: its pid says
    whose the segment is (tests/test_shm.py reads it), the random part keeps
    the groups of one process apart."""
    return f"/flatshard-{os.getpid()}-{uuid.uuid4().hex[:16]}"


def _make_shm(group, timeout_s, slot_bytes=None):
    """[Note: shm set-up] Once every rank has mapped the segment its name
    is gone (csrc/backends/comm_shm.c: the last to map it removes it). Until then a
    rank that dies, raises or is interrupted must not leave the name behind,
    and a SIGKILL runs no clean-up of its own, so every rank learns the name
    *before* rank 0 creates it, and every rank removes it (a no-op where it
    is already gone) when it leaves the set-up, however it leaves: the ranks
    that survive a dead peer fail in a collective (gloo's connection reset,
    or its timeout) and remove it then.

    Only a name this group created is removed. Rank 0's create fails when
    the name is taken (a segment another process made or planted), and that
    segment is not the group's to delete. Rank 0 knows the outcome once its
    create returns (a create that fails removes whatever it made itself,
    comm_shm.c); the other ranks learn it from the first agreement. A rank
    that leaves before it knows (interrupted inside the create, or a peer
    lost before the agreement) still removes the name: rank 0 may have
    created it and be unable to remove it, and the name is one the group has
    just chosen."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    name_t = torch.zeros(64, dtype=torch.uint8)
    if rank == 0:
        name = _segment_name()
        name_t[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
    dist.broadcast(name_t, src=dist.get_process_group_ranks(group)[0], group=group)
    name = bytes(name_t.tolist()).rstrip(b"\0").decode()
    comm, err = None, ""
    created = None  # whether rank 0 created the segment; None: not known here
    try:
        if rank == 0:
            comm, err = _shm_comm(name, 0, world, timeout_s, create=True, slot_bytes=slot_bytes)
            created = comm is not None
        # Only rank 0 has acted yet: the agreement says whether it created.
        created = ok = _ok_everywhere(err, group)  # created: the others may attach
        if ok and rank != 0:
            comm, err = _shm_comm(name, rank, world, timeout_s, slot_bytes=slot_bytes)
        ok = ok and _ok_everywhere(err, group)
    finally:
        if created is not False:
            _C.shm_unlink(name)
    if not ok:
        why = (f": {err}" if err else " (another rank failed)" if created else
               " (rank 0 could not create the segment)")
        raise RuntimeError(f"flatshard: rank {rank} could not set up the shm backend{why}; "
                           f"set comm_backend='torch' to use the process group instead")
    return comm


_COMMS = {}


# How long the interpreter lets process-group worker threads run at exit.
EXIT_GRACE_S = 0.2
_EXIT_HOOK = []


def _let_workers_finish():
    """atexit: release the GIL for a moment before the interpreter finalizes.

    A gloo collective's work item can outlive the call that issued it by a
    few microseconds: its worker thread drops it after waking the caller, and
    dropping it may release Python objects (the tensors' Python wrappers),
    which needs the GIL. A script that exits right after a collective can
    reach interpreter finalization first; the worker then cannot take the GIL
    and the process aborts ("terminate called without an active exception").
    Sleeping here, while threads may still take the GIL, lets them finish."""
    time.sleep(EXIT_GRACE_S)


def _register_exit_hook():
    if not _EXIT_HOOK:
        atexit.register(_let_workers_finish)
        _EXIT_HOOK.append(True)


def comm_for(group, backend="torch", device=None):
    """The Comm of a process group for a requested backend (cached: the
    choice and the set-up are collectives, made once per group). Units on a
    CUDA `device` get its device Comm (device.py; backend 'nccl'). A new
    host Comm's backend is checked against known answers (comm_check.py,
    on a twin: _twin) before it is returned."""
    _register_exit_hook()
    if device is not None and device.type == "cuda":
        return cuda_comm(group, device)
    key = (id(group), backend)
    hit = _COMMS.get(key)
    if hit is not None and hit[0] is group:
        return hit[1]
    chosen = backend
    # Every rank's host and pid: for the choice, and for failure reports,
    # which can then tell a dead rank on this host when the store is gone
    # (a pid means something only in its pid namespace).
    # The requested backend too: ranks that asked for different ones would
    # otherwise part ways here (shm's set-up broadcast against a gloo
    # collective) and wait for each other until the process group's timeout.
    asked = [p.split("|", 3) for p in _all_gather_bytes(
        f"{backend}|{os.getpid()}|{_pid_namespace()}|{_host_identity()}", group, width=256)]
    if len({a[0] for a in asked}) > 1:
        raise bad_value("comm_backend", backend, "the ranks of the group ask for different "
                        "backends: " + ", ".join(f"rank {r} {a[0]!r}" for r, a in
                                                 enumerate(asked)),
                        f"give every rank the same comm_backend (and {ENV_BACKEND})")
    peers = [a[1:] for a in asked]
    hosts = [host for _, _, host in peers]
    if backend in ("auto", "shm"):
        one_host = len(set(hosts)) == 1 and sys.platform.startswith("linux")
        if backend == "shm" and not one_host:
            raise bad_value("comm_backend", "shm", "the ranks of the group are not all on one "
                            f"Linux host ({sorted(set(h.split('|')[0] for h in hosts))})",
                            "use 'torch' (or 'auto') for multi-host groups")
        chosen = "shm" if one_host else "torch"
    if chosen == "nccl":
        raise bad_value("comm_backend", "nccl", "the NCCL backend moves CUDA memory; no CUDA "
                        "device was given", "use 'auto', 'shm' or 'torch' for CPU tensors")
    timeout_s = wait_timeout(group)[0]
    if chosen == "shm":
        comm = _make_shm(group, timeout_s)
    else:
        comm = _C.Comm("torch", dist.get_rank(group), dist.get_world_size(group),
                       fn=_torch_collective(group))
    diagnostics.install(comm, group, f"{group.group_name}/{backend}", timeout_s,
                        [(f"{host}|{ns}", int(pid)) for pid, ns, host in peers])
    check_reductions(_twin(group, chosen, timeout_s), chosen)
    _COMMS[key] = (group, comm)
    return comm


def _twin(group, backend, timeout_s):
    """A Comm of `backend` over `group` for the known-answer check alone
    (comm_check.py): the same backend code and the same ranks, so the check
    says what the group's Comm would compute, while the group's Comm's own
    ledger and collective numbers (diagnostics.py) start at its first real
    collective. shm's twin has the smallest slots (the check moves a few
    elements) and is closed when dropped."""
    if backend == "shm":
        return _make_shm(group, timeout_s, slot_bytes=MIN_SLOT_BYTES)
    return _C.Comm("torch", dist.get_rank(group), dist.get_world_size(group),
                   fn=_torch_collective(group))


def _flat(t, arg, comm):
    """(data_ptr, numel, dtype code) of a tensor `comm` can move: plain,
    contiguous, in the memory it moves (device.tensor_fits)."""
    check_plain(t, arg, "flatshard.runtime.comm")
    if not t.is_contiguous():
        raise bad_value(arg, f"a tensor of strides {t.stride()}", "expected a contiguous tensor")
    if not tensor_fits(comm, t):
        raise bad_value(arg, str(t.device), f"this Comm moves {memory_of(comm)} memory")
    return t.data_ptr(), t.numel(), dtype_code(t.dtype)


# Every Comm, host or device, takes its tensors here: a device Comm binds
# torch's current stream and lends the float32 staging of a bfloat16/float16
# reduction itself (csrc/glue/py_comm.c).
# `tag` below: what the collective is for, in the Comm's ledger and in errors.


def broadcast_(comm, tensor, root=0, tag=""):
    """Broadcast a contiguous tensor of any dtype in place, as raw bytes."""
    check_plain(tensor, "broadcast: tensor", "flatshard.runtime.comm.broadcast_")
    flat = tensor.detach().contiguous().view(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
    _flat(raw, "broadcast: tensor", comm)
    comm.broadcast(raw.data_ptr(), raw.numel(), _C.U8, root, tag)
    if flat.data_ptr() != tensor.data_ptr():
        tensor.detach().copy_(flat.view_as(tensor))


def all_gather_into(comm, out, inp, tag=""):
    """out = every rank's inp, in rank order."""
    ip, n, code = _flat(inp, "all_gather: input", comm)
    op, on, ocode = _flat(out, "all_gather: output", comm)
    if ocode != code or on != n * comm.world_size:
        raise bad_value("all_gather: output", f"{out.dtype} of {on}",
                        f"expected {inp.dtype} of world_size * {n} (the input's numel)")
    comm.all_gather(ip, op, n, code, tag)


def reduce_scatter_into(comm, out, inp, average=True, tag=""):
    """out = this rank's part of the sum (average) of every rank's inp."""
    ip, n, code = _flat(inp, "reduce_scatter: input", comm)
    op, on, ocode = _flat(out, "reduce_scatter: output", comm)
    if ocode != code or n != on * comm.world_size:
        raise bad_value("reduce_scatter: input", f"{inp.dtype} of {n}",
                        f"expected {out.dtype} of world_size * {on} (the output's numel)")
    comm.reduce_scatter(ip, op, on, code, average, tag)


def all_reduce_(comm, tensor, average=False, tag=""):
    p, n, code = _flat(tensor, "all_reduce: tensor", comm)
    comm.all_reduce(p, n, code, average, tag)
