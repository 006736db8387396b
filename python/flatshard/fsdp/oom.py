"""What a rank says when it runs out of host memory gathering a unit: the
bytes it holds in flatshard's buffers, by role, and the options that would
lower them (unit.py raises OutOfMemoryError with this text)."""
from ..tensors import storage_bytes
from .flat_param import gathered_buffers


def _mib(n):
    return f"{n / 2**20:.1f} MiB"


def oom_report(unit, exc):
    """The text of an OutOfMemoryError raised while gathering `unit` (a
    UnitRuntime): what this rank holds, by role, and what would lower it."""
    units = unit.root.units if unit.root is not None else [unit]
    need = sum(g.padded_numel * g.compute.element_size() for g in unit.groups)
    shards = sum(g.shard.untyped_storage().nbytes() for u in units for g in u.groups)
    grads = storage_bytes([g.shard.grad for u in units for g in u.groups] +
                          [g.grad_buf for u in units for g in u.groups])
    gathered = [(u.name, storage_bytes(gathered_buffers(u.groups))) for u in units]
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
