"""Live memory per rank, measured from torch's own storages (not from
flatshard's bookkeeping), so tests and benchmarks can hold the sharding
against what is really allocated; and the process's resident memory beside
it, which is what the operating system (and an out-of-memory killer) sees."""
import os
import resource

import torch

from . import _C


def _storage_bytes(tensors):
    seen, total = set(), 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        s = t.untyped_storage()
        if s.data_ptr() in seen or s.nbytes() == 0:
            continue
        seen.add(s.data_ptr())
        total += s.nbytes()
    return total


def _gathered_buffers(unit):
    """A unit's gathered buffers (full, and lp under mixed precision); not the
    full buffer of NO_SHARD, which is the shard itself."""
    return [t for g in unit.groups for t in (g.full, g.lp) if t is not None and
            t.untyped_storage().data_ptr() != g.shard.untyped_storage().data_ptr()]


def resident_bytes():
    """(now, peak): this process's resident memory (/proc/self/statm) and its
    peak so far (getrusage ru_maxrss); None where the system has neither."""
    try:
        with open("/proc/self/statm") as f:
            now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        now = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return now, peak or None


def memory_stats(model, optimizer=None):
    """Bytes this rank holds for the wrapped `model` (and `optimizer`, whose
    state tensors are counted when given), by role:

    params         storages of the parameters the optimizer sees (the shards)
    unsharded      full (gathered) buffers live right now: 0 after reshard
    grads          gradient storages, including unreduced full gradients
    optim          optimizer state tensors
    pool_cached    free gather buffers flatshard keeps resident for the next
                   unit's gather (host; 0 between steps)
    resident       the whole process's resident memory now: the roles above,
                   activations, the runtime (Python, torch, libraries) and
                   whatever the C library's heap has not returned
    peak_resident  the process's peak resident memory so far
    """
    from .fsdp import FullyShardedDataParallel
    fulls, pending = [], []
    for m in model.modules():
        if isinstance(m, FullyShardedDataParallel):
            fulls += _gathered_buffers(m._unit)
            pending += [g.compute.grad for g in m._unit.groups]
    params = list(model.parameters())
    out = {
        "params": _storage_bytes(params),
        "unsharded": _storage_bytes(fulls),
        "grads": _storage_bytes([p.grad for p in params] + pending),
        "optim": 0,
    }
    if optimizer is not None:
        out["optim"] = _storage_bytes(v for st in optimizer.state.values()
                                      for v in st.values() if torch.is_tensor(v))
    out["pool_cached"] = _C.pool_stats()["cached_bytes"]
    out["resident"], out["peak_resident"] = resident_bytes()
    return out


def format_stats(stats):
    """memory_stats' dict as one line of MiB, for printing."""
    return "  ".join(f"{k}={v / 2**20:,.0f}MiB" for k, v in stats.items() if v is not None)


def _mib(n):
    return f"{n / 2**20:.1f} MiB"


def oom_report(unit, exc):
    """The text of an OutOfMemoryError raised while gathering `unit`: what
    this rank holds, by role, and what would lower it."""
    units = unit.root.units if unit.root is not None else [unit]
    need = sum(g.padded_numel * g.compute.element_size() for g in unit.groups)
    shards = sum(g.shard.untyped_storage().nbytes() for u in units for g in u.groups)
    grads = _storage_bytes([g.shard.grad for u in units for g in u.groups] +
                           [g.grad_buf for u in units for g in u.groups])
    gathered = [(u.name, _storage_bytes(_gathered_buffers(u))) for u in units]
    gathered = [(n, b) for n, b in gathered if b]
    comm = unit.c.comm
    lines = [
        f"flatshard: rank {comm.rank} ran out of host memory gathering unit '{unit.name}' "
        f"({_mib(need)} needed): {str(exc).splitlines()[0]}",
        "memory this rank holds in flatshard's buffers:",
        f"  parameters (shards): {_mib(shards)}",
        f"  gradients (shards): {_mib(grads)}",
        f"  gathered units now: {_mib(sum(b for _, b in gathered))} "
        f"({', '.join(f'{n} {_mib(b)}' for n, b in gathered) or 'none'})",
        f"  communication buffers: the {comm.backend} backend's"
        + (" staging slots in shared memory" if comm.backend == "shm" else " (none of ours)"),
        "  optimizer state: not visible here; flatshard.memory_stats(model, optimizer) shows it",
        "to lower it: sharding_strategy=FULL_SHARD (frees each unit after its forward), "
        "smaller units (a finer auto_wrap_policy), "
        "mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) (gathers half the bytes), "
        "more ranks, a smaller batch, or activation checkpointing",
    ]
    return "\n".join(lines)
