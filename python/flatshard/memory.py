"""Live memory per rank, measured from torch's own storages (not from
flatshard's bookkeeping), so tests and benchmarks can hold the sharding
against what is really allocated; and the process's resident memory beside
it, which is what the operating system (and an out-of-memory killer) sees.

It reads a wrapped model's units (fsdp/unit.py's fsdp_units) and fully_shard
groups (fsdp2/state.py's state_of), so it sits above fsdp/ and fsdp2/;
nothing in fsdp/, fsdp2/, state/ or runtime/ imports it. (The
text a unit raises when a gather runs out of memory is fsdp/oom.py.)"""
import os
import resource

import torch

from . import _C
from .fsdp.flat_param import gathered_buffers
from .fsdp.unit import fsdp_units
from .fsdp2.state import state_of
from .offload_pipeline import pipeline_of
from .tensors import storage_bytes


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
    unsharded      full (gathered) buffers live right now: 0 after reshard,
                   but for fully_shard groups whose storage is kept
                   (set_keep_unsharded_storage: csrc/engine/shard_group.h,
                   [Note: kept storage])
    grads          gradient storages, including unreduced full gradients
    optim          optimizer state tensors
    pool_cached    free gather buffers flatshard keeps resident for the next
                   unit's gather (host; 0 between steps)
    resident       the whole process's resident memory now: the roles above,
                   activations, the runtime (Python, torch, libraries) and
                   whatever the C library's heap has not returned
    peak_resident  the process's peak resident memory so far
    offload_in_flight  gradient storages that steps queued by overlap_offload
                   still read and the parameters no longer hold (after
                   zero_grad); 0 without it (offload_pipeline.py)
    copied         bytes fully_shard's gathers and reductions have copied so
                   far (a running total: a step's is the difference across
                   it), copy_stats' sum
    sent_gather    bytes this rank has put into all-gathers so far, both APIs
    sent_reduce    ... and into gradient reductions (reduce-scatters,
                   all-reduces, quantized reductions' all-to-alls), counted
                   by the engine as they succeed: the payloads, quantized
                   or not (running totals, as copied; csrc/engine/engine.h,
                   [Note: bytes sent])
    """
    fulls, pending = [], []
    for m in fsdp_units(model):
        fulls += gathered_buffers(m._unit.groups)
        pending += [g.compute.grad for g in m._unit.groups]
    fs_fulls = _fully_shard_buffers(model)
    params = list(model.parameters())
    out = {  # (fully_shard's parameters registered unsharded: the unsharded buffers' bytes)
        "params": storage_bytes(params + fs_fulls) - storage_bytes(fs_fulls),
        "unsharded": storage_bytes(fulls + fs_fulls),
        "grads": storage_bytes([p.grad for p in params] + pending),
        "optim": 0,
    }
    if optimizer is not None:
        out["optim"] = storage_bytes(v for st in optimizer.state.values()
                                     for v in st.values() if torch.is_tensor(v))
    pipe = pipeline_of(model)
    now = {getattr(p.grad, "_local_tensor", p.grad).untyped_storage().data_ptr()
           for p in params if p.grad is not None}
    out["offload_in_flight"] = 0 if pipe is None else storage_bytes(
        t for t in pipe.held_grads() if t.untyped_storage().data_ptr() not in now)
    out["pool_cached"] = _C.pool_stats()["cached_bytes"]
    out["resident"], out["peak_resident"] = resident_bytes()
    out["copied"] = sum(copy_stats(model).values())
    out["sent_gather"], out["sent_reduce"] = sent_bytes(model)
    return out


def _fully_shard_buffers(model):
    """Each fully_shard group's unsharded buffer under `model` (an empty
    storage while resharded, unless it is kept)."""
    out, seen = [], set()
    for m in model.modules():
        st = state_of(m)
        if st is not None and st.group is not None and id(st) not in seen:
            seen.add(id(st))
            if st.group.full is not None:
                out.append(st.group.full)
    return out


def copy_stats(model):
    """Bytes fully_shard's engine has copied so far for `model`'s groups, by
    kind: copy_in (shards into the all-gather input), copy_out (the
    all-gather output into the unsharded parameters), reduce_in (gradients
    into the reduce-scatter input), reduce_out (the reduce output into new
    sharded gradients), cast (a copy that changes the dtype: mixed
    precision). See csrc/engine/shard_group.h, [Note: copy counts]. The
    bytes the collectives send are memory_stats' sent_gather / sent_reduce."""
    out = {"copy_in": 0, "copy_out": 0, "reduce_in": 0, "reduce_out": 0, "cast": 0}
    for m in model.modules():
        st = state_of(m)
        if st is not None and st.group is not None:
            for k, v in st.group.copied_bytes().items():
                out[k] += v
    return out


def sent_bytes(model):
    """(gather, reduce): bytes this rank has put into `model`'s all-gathers
    and gradient reductions so far, over both APIs' units and groups, as the
    engine counted them (memory_stats' sent_gather / sent_reduce)."""
    gather = reduce = 0
    for m in model.modules():
        st = state_of(m)
        if st is not None and st.group is not None:
            gather += st.group.sent_bytes("gather")
            reduce += st.group.sent_bytes("reduce")
    for m in fsdp_units(model):
        counts = m._unit.c.counts
        gather += counts["sent_gather_bytes"]
        reduce += counts["sent_reduce_bytes"]
    return gather, reduce


def format_stats(stats):
    """memory_stats' dict as one line of MiB, for printing."""
    return "  ".join(f"{k}={v / 2**20:,.0f}MiB" for k, v in stats.items() if v is not None)
