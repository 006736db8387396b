"""Out of memory on one rank: a real allocation failure (rank 0's address
space capped with RLIMIT_AS) while gathering a unit raises OutOfMemoryError
with the rank's breakdown and remedies, and the other rank is told at once
instead of waiting in the all-gather."""
import datetime
import resource

import torch
import torch.distributed as dist
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import flatshard
from flatshard import FSDP
from test_diagnostics import assert_documented


class Big(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4096, 4096)  # 64 MiB gathered

    def forward(self, x):
        return self.lin(x)


def _vm_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


def _rank0_capped(step):
    """step() with rank 0's address space capped at what it maps now plus
    24 MiB (room for small allocations, not for a 64 MiB unit) -> its
    error as text with its notes, or "no error"."""
    rank = dist.get_rank()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        if rank == 0:
            resource.setrlimit(resource.RLIMIT_AS, (_vm_bytes() + (24 << 20), hard))
        step()
        msg = "no error"
    except (MemoryError, flatshard.CoreError, RuntimeError) as e:
        msg = "\n".join([f"{type(e).__name__}: {e}"] + list(getattr(e, "__notes__", [])))
    finally:
        if rank == 0:
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return msg


def _one_rank_runs_out(backend):
    # A group of its own (its Comm ends aborted: keep WORLD's clean); on gloo a
    # 4 s timeout, since rank 0 stays alive and its sockets open.
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=4))
    model = FSDP(torch.nn.Sequential(Big(), Big()), process_group=group, comm_backend=backend,
                 auto_wrap_policy=ModuleWrapPolicy({Big}))
    x = torch.randn(2, 4096)
    return _rank0_capped(lambda: model(x))


def test_out_of_memory_on_one_rank_is_named_on_every_rank(dist_pool):
    m0, m1 = dist_pool(2).run(_one_rank_runs_out, "shm")
    assert m0.startswith("OutOfMemoryError: flatshard: rank 0 ran out of host memory "
                         "gathering unit '0'"), m0
    assert_documented("out-of-memory", m0)
    for part in ("parameters (shards):", "gathered units now:", "optimizer state:",
                 "sharding_strategy=FULL_SHARD", "param_dtype=torch.bfloat16"):
        assert part in m0, (part, m0)
    # Rank 1 was waiting for rank 0 in the all-gather: it fails with the
    # cause, which is not its own allocation failure, from rank 0's abort of
    # the group, not at the 300 s timeout (no wait of its timed out).
    assert "aborted" in m1 and "rank 0 ran out of host memory" in m1, m1
    assert m1.startswith("CoreError:") and "rank 1 ran out" not in m1, m1
    assert "timed out" not in m1, m1


def test_out_of_memory_on_the_torch_backend_reaches_the_others_note(dist_pool):
    m0, m1 = dist_pool(2).run(_one_rank_runs_out, "torch")
    assert m0.startswith("OutOfMemoryError: flatshard: rank 0 ran out of host memory"), m0
    # Rank 1's gloo wait fails at the group's timeout; its note quotes rank 0.
    assert "rank 0 stopped: flatshard: rank 0 ran out of host memory" in m1, m1


def _one_rank_runs_out_in_backward():
    """As _one_rank_runs_out, with the cap set after the forward: the units'
    gathers in backward are the engine unit's plain pre-backward (C,
    [Note: unit plain events] in csrc/hooks/unit_events.c)."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=4))
    model = FSDP(torch.nn.Sequential(Big(), Big()), process_group=group, comm_backend="shm",
                 auto_wrap_policy=ModuleWrapPolicy({Big}))
    x = torch.randn(2, 4096)
    model(x).sum().backward()  # step 0: lazy init, the plain flags handed
    out = model(x).sum()
    # the units freed in forward went to the pool's cache: unmapped, so the
    # backward's gather maps anew (and is the first allocation that fails)
    flatshard._C.pool_trim()
    return _rank0_capped(out.backward)


def test_out_of_memory_in_the_plain_backward_is_named_on_every_rank(dist_pool):
    """The plain backward in C hands an allocation failure to the unit's
    Python report (UnitRuntime._plain_failed), as the Python path does: the
    rank's breakdown on rank 0, the cause on rank 1 at once."""
    m0, m1 = dist_pool(2).run(_one_rank_runs_out_in_backward)
    assert m0.startswith("OutOfMemoryError: flatshard: rank 0 ran out of host memory"), m0
    assert "gathered units now:" in m0, m0
    assert "aborted" in m1 and "rank 0 ran out of host memory" in m1, m1
    assert m1.startswith("CoreError:") and "rank 1 ran out" not in m1, m1
    assert "timed out" not in m1, m1


def _fully_shard_rank_runs_out(when, backend="shm"):
    """fully_shard on two Big blocks, rank 0's address space capped before
    the first forward (torch's allocation of the unsharded buffer, made in
    Python) or before the second (the engine's gather from the pool, in the
    plain pre-forward in C)."""
    import os
    from torch.distributed.device_mesh import DeviceMesh
    # a group of its own: its Comm ends aborted (keep WORLD's clean)
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=4))
    mesh = DeviceMesh.from_group(group, "cpu")
    model = torch.nn.Sequential(Big(), Big())
    os.environ["FLATSHARD_COMM_BACKEND"] = backend
    try:
        for b in model:
            flatshard.fully_shard(b, mesh=mesh)
        flatshard.fully_shard(model, mesh=mesh)
    finally:
        del os.environ["FLATSHARD_COMM_BACKEND"]
    x = torch.randn(2, 4096)
    if when == "later":
        model(x).sum().backward()
    return _rank0_capped(lambda: model(x))


def test_fully_shard_out_of_memory_on_one_rank_fails_the_others_at_once(dist_pool):
    """[Note: out of memory on one rank] in csrc/glue/py_group.c: the rank
    whose allocation failed aborts the Comm with its cause, for fully_shard's
    groups as for FSDP1's units, so the other rank's all-gather fails at once
    naming it instead of waiting out the timeout (300 s)."""
    for when in ("first", "later"):
        m0, m1 = dist_pool(2).run(_fully_shard_rank_runs_out, when)
        assert "memory" in m0.lower() and m0 != "no error", (when, m0)
        # from rank 0's abort of the group, not a timeout of rank 1's own
        assert m1.startswith("CoreError:") and "shm group aborted: flatshard: rank 0 ran out " \
            "of host memory during unshard of '0'" in m1, (when, m1)
        assert "timed out" not in m1, (when, m1)


def test_fully_shard_out_of_memory_on_the_torch_backend_reaches_the_others_note(dist_pool):
    """On gloo nothing can abort the other rank's wait: it fails at the
    group's timeout (4 s here), and its note quotes rank 0's cause, which
    rank 0 left in the store ([Note: out of memory on one rank])."""
    for when in ("first", "later"):
        m0, m1 = dist_pool(2).run(_fully_shard_rank_runs_out, when, "torch")
        assert "memory" in m0.lower() and m0 != "no error", (when, m0)
        assert "rank 0 stopped: flatshard: rank 0 ran out of host memory during unshard " \
               "of '0'" in m1, (when, m1)
