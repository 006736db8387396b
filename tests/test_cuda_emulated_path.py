"""flatshard._C_cuda without a GPU: the module as setup.py builds it (the
CPython glue, the NCCL backend of csrc/cuda/comm_nccl.c, the device table of
the units, the kernels), compiled for the host against tests/cuda_emu/: a
CUDA runtime over host memory and a libnccl over flatshard's shared-memory
backend (tests/cuda_emu/emu_build.py).

The emulated streams run their work only when it is waited for, as a GPU
runs it later than the host issues it: a unit that reads a gathered buffer
without making its stream wait for the collective reads stale memory, and
the training below stops matching the host path bit for bit. Faults (an
NCCL call that fails, an asynchronous error, a peer that never joins) are
injected to check that each becomes an exception naming the collective and
that the communicator is aborted rather than left to hang.

On a GPU, test_cuda.py and test_cuda_wrapper.py run the real thing."""
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emu"))
import emu_build  # noqa: E402

import test_device_path as tdp  # noqa: E402
from test_diagnostics import assert_documented, full_text  # noqa: E402
from flatshard import _C  # noqa: E402
from flatshard.runtime.device import empty_fn  # noqa: E402

pytestmark = pytest.mark.skipif(not emu_build.available(),
                                reason="needs gcc/g++ and the csrc/ sources")
F32, F16, BF16 = 0, 1, 2
NCCL_INVALID_USAGE, NCCL_SYSTEM_ERROR, NCCL_REMOTE_ERROR = 5, 2, 6


@pytest.fixture(scope="module")
def emu():
    mod, rt, _ = emu_build.load()
    yield mod, rt
    for what in (b"nccl_fail", b"nccl_async", b"event_never_ready", b"launch_error",
                 b"event_error"):
        rt.fs_emu_fault(what, 0)


def _nccl_comm(group=None, timeout_s=60.0):
    """An emulated NcclComm over `group` (every rank calls it)."""
    mod, _, _ = emu_build.load()
    group = group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    uid = [mod.nccl_unique_id() if dist.get_rank() == ranks[0] else None]
    dist.broadcast_object_list(uid, src=ranks[0], group=group)
    return mod.NcclComm(dist.get_rank(group), len(ranks), uid[0], 0, timeout_s)


def _over(nccl):
    """The Comm whose methods issue `nccl`'s collectives: what
    flatshard.runtime.device.nccl_device_comm makes on a GPU, on the host build."""
    mod, _, _ = emu_build.load()
    return _C.Comm("device", nccl.rank, nccl.world_size, capsule=nccl.capsule(), owner=nccl,
                   device_api=mod.device_api, stream_fn=lambda: 0,
                   empty=empty_fn(torch.device("cpu")))


def _device_comm(group, host):
    """What flatshard.runtime.device.cuda_comm makes on a GPU, on the host build."""
    return _over(_nccl_comm(group))


# ---------------------------------------------------------------------------
# the units' device path through the CUDA table and the NCCL backend

def _train_both(case, accumulate):
    import os
    _, rt, _ = emu_build.load()
    if case == "hybrid":  # 2 "hosts" of 2 ranks: shard inside, all-reduce across
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        kw = dict(sharding_strategy=tdp.ShardingStrategy.HYBRID_SHARD,
                  mixed_precision=tdp.MixedPrecision(param_dtype=torch.bfloat16,
                                                     buffer_dtype=torch.bfloat16))
    else:
        kw = tdp.CASES[case]
    try:
        same, losses, host_comms, dev_comms, ledger, seen, reduced = tdp._both_kw(
            kw, accumulate, device_path=_device_comm)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    return same, losses, dev_comms, seen, reduced, rt.fs_emu_pending()


def _fully_shard_both(mp, raf, prefetch=False, last_dim=False):
    _, rt, _ = emu_build.load()
    same, n_comms, losses, deferred = tdp._fully_shard_both(mp, raf, _device_comm, prefetch,
                                                            last_dim)
    return same, n_comms, losses, rt.fs_emu_pending(), deferred[1]


@pytest.mark.parametrize("case", sorted(tdp.CASES))
def test_units_through_the_cuda_table_and_nccl_backend_match_the_host(dist_pool, case):
    emu_build.build()  # once, before the ranks look for it
    for same, losses, dev_comms, seen, reduced, pending in dist_pool(2).run(
            _train_both, case, False):
        assert dev_comms == [emu_build.DEVICE_NAME]
        assert same, case
        assert losses[-1] < losses[0]
        assert pending == 0  # nothing issued was left unwaited
        assert seen and not any(own for own, _ in seen)
        assert any(other for _, other in seen) == (case == "forward_prefetch")
        if not case.startswith(("no_shard", "zero1")):
            assert reduced[1] and any(reduced[1])


@pytest.mark.parametrize("case", ["bf16_fp32_reduce", "cpu_offload_bf16", "hybrid"])
def test_emulated_device_path_with_accumulation_on_four_ranks(dist_pool, case):
    emu_build.build()
    for same, losses, dev_comms, seen, reduced, pending in dist_pool(4).run(
            _train_both, case, True):
        assert same and pending == 0
        assert dev_comms == [emu_build.DEVICE_NAME]
        # deferred, one in flight (hybrid too: the replicas' all-reduce follows
        # the reduce-scatter across the two communicators' streams)
        assert any(reduced[1])


@pytest.mark.parametrize("mp", [None, "bf16", "bf16_reduce"])
def test_fully_shard_at_one_rank_through_the_cuda_table(dist_pool, mp):
    """One rank: the unsharded parameters are the shards (or their casts)
    and each gradient is reduced in place (csrc/engine/shard_group.h, [Note: direct
    layout]) on the device path as on the host: the same bits, nothing left
    pending."""
    emu_build.build()
    for same, n_comms, losses, pending, _ in dist_pool(1).run(_fully_shard_both, mp, True):
        assert n_comms >= 1 and same and pending == 0
        assert losses[-1] < losses[0]


@pytest.mark.parametrize("mp,raf,prefetch,last_dim", [
    (None, True, False, False), ("bf16_reduce", True, False, False), (None, 2, False, False),
    (None, True, True, False), ("bf16", False, True, False),
    (None, True, True, True), ("bf16", True, False, True)])
def test_fully_shard_through_the_cuda_table_and_nccl_backend(dist_pool, mp, raf, prefetch,
                                                             last_dim):
    """Reductions are deferred (one in flight), and the gathers of the next
    module (the user's prefetch lists, else the next in the last forward's
    order): a copy-out or a gradient read that did not wait for its
    collective would read stale memory here."""
    emu_build.build()
    for same, n_comms, losses, pending, deferred in dist_pool(2).run(
            _fully_shard_both, mp, raf, prefetch, last_dim):
        assert n_comms >= 1 and same and pending == 0
        assert losses[-1] < losses[0]
        # gathers are deferred whenever prefetched: by the user's lists, or
        # implicitly (the next module in the last forward's order), and every
        # reduction is
        assert deferred[0] > 0 and deferred[1] > 0


def _async_unshard():
    """unshard(async_op=True) on a device: the handle's wait() is what makes
    the module's parameters readable; the module's forward then reuses them."""
    import flatshard.fsdp2.mesh as fmesh  # where fully_shard makes its Comms
    from flatshard import fully_shard
    from toy_models import build
    torch.manual_seed(0)
    saved = fmesh.comm_for
    made = {}

    def comm_for(group, backend, device=None):
        host = saved(group, backend, device)
        if id(host) not in made:
            made[id(host)] = _device_comm(group, host)
        return made[id(host)]
    fmesh.comm_for = comm_for
    try:
        model = build()
        want = [p.detach().clone() for p in model.blocks[1].parameters()]
        for b in model.blocks:
            fully_shard(b)
        fully_shard(model)
    finally:
        fmesh.comm_for = saved
    handle = model.blocks[1].unshard(async_op=True)
    group = model.blocks[1]._fsdp_state().group
    pending_before = group.pending is not None
    handle.wait()
    got = [p.detach().clone() for p in group.unsharded]
    same = len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    out = model(torch.randn(4, 5)).sum().item()
    return pending_before, group.pending is None, same, out == out


class _Skippy(torch.nn.Module):
    """Three blocks; block 1 is skipped when skip is set (a data-dependent
    branch around a sharded module)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))
        self.skip = False

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            if not (self.skip and i == 1):
                x = torch.tanh(b(x))
        return x


def _skipped_prefetch():
    """The implicit prefetch follows the last forward's order; a module it
    prefetched that this forward skips is resharded when the forward ends,
    and training matches the host path."""
    import flatshard.fsdp2.mesh as fmesh  # where fully_shard makes its Comms
    from flatshard import fully_shard
    results = []
    for device in (False, True):
        torch.manual_seed(0)
        saved, made = fmesh.comm_for, {}

        def comm_for(group, backend, device_=None):
            host = saved(group, backend, device_)
            if device and id(host) not in made:
                made[id(host)] = _device_comm(group, host)
            return made.get(id(host), host)
        fmesh.comm_for = comm_for
        try:
            model = _Skippy()
            for b in model.blocks:
                fully_shard(b)
            fully_shard(model)
        finally:
            fmesh.comm_for = saved
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(dist.get_rank())
        losses, left = [], []
        for step in range(4):
            model.skip = step == 2
            grp = model.blocks[1]._fsdp_state().group
            before = grp.n_deferred
            loss = model(torch.randn(3, 6, generator=g)).square().mean()
            if step == 2:  # block 1 was prefetched (on the device) and not used
                left.append((grp.n_deferred - before, grp.is_unsharded, grp.pending is None))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        results.append((losses, left))
    return results


def test_an_implicit_prefetch_of_a_skipped_module_is_undone(dist_pool):
    emu_build.build()
    for (host_losses, _), (dev_losses, left) in dist_pool(2).run(_skipped_prefetch):
        assert dev_losses == host_losses
        # prefetched once by block 0, then resharded when the forward ended
        assert left == [(1, False, True)]


def test_unshard_async_op_defers_until_the_handle_waits(dist_pool):
    emu_build.build()
    for pending_before, cleared, same, finite in dist_pool(2).run(_async_unshard):
        assert pending_before and cleared and same and finite


# ---------------------------------------------------------------------------
# the NCCL backend's collectives, against float64 references: issued as on a
# GPU, by comm.py's functions through the Comm over the NcclComm

def _collectives():
    from flatshard.runtime import comm as fcomm
    mod, rt, _ = emu_build.load()
    nccl = _nccl_comm()
    comm = _over(nccl)
    r, w = comm.rank, comm.world_size
    out = {}
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(w * 6, generator=g) for _ in range(w)]  # every rank's input, known
    mine = data[r].clone()

    got = torch.zeros(w * 6)
    fcomm.all_gather_into(comm, got, mine[:6], tag="gather test")
    out["all_gather"] = torch.equal(got, torch.cat([d[:6] for d in data]))

    want = sum(d.double() for d in data)
    shard = torch.zeros(6)
    fcomm.reduce_scatter_into(comm, shard, mine, average=True)
    out["rs_avg"] = (shard.double() - want[r * 6:(r + 1) * 6] / w).abs().max().item()

    # bfloat16: widened into float32 staging (the Comm lends it), reduced,
    # narrowed once
    lp = [d.to(torch.bfloat16) for d in data]
    shard_lp = torch.zeros(6, dtype=torch.bfloat16)
    fcomm.reduce_scatter_into(comm, shard_lp, lp[r].clone(), average=False)
    want_lp = sum(x.float() for x in lp)[r * 6:(r + 1) * 6].to(torch.bfloat16)
    out["rs_bf16"] = torch.equal(shard_lp, want_lp)

    buf = lp[r].clone()
    fcomm.all_reduce_(comm, buf, average=True)
    out["ar_bf16"] = torch.equal(buf, (sum(x.float() for x in lp) *
                                       torch.tensor(1.0 / w)).to(torch.bfloat16))

    b = mine.double() if r == w - 1 else torch.zeros(w * 6, dtype=torch.float64)
    fcomm.broadcast_(comm, b, root=w - 1)
    out["broadcast"] = torch.equal(b, data[w - 1].double())

    # a group: both all-gathers run when it ends, in order
    a1, a2 = torch.zeros(w * 2), torch.zeros(w * 3)
    nccl.group_start(stream=0)
    fcomm.all_gather_into(comm, a1, mine[:2])
    fcomm.all_gather_into(comm, a2, mine[2:5])
    nccl.group_end()
    out["group"] = torch.equal(a1, torch.cat([d[:2] for d in data])) and \
        torch.equal(a2, torch.cat([d[2:5] for d in data]))
    comm.barrier()
    nccl.wait(10.0)
    out["pending"] = rt.fs_emu_pending()
    out["ledger"] = [(e["op"], e["unit"]) for e in comm.ledger()][:2]
    nccl.close()
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_nccl_backend_collectives(dist_pool, world):
    emu_build.build()
    for out in dist_pool(world).run(_collectives):
        assert out["all_gather"] and out["rs_bf16"] and out["ar_bf16"]
        assert out["broadcast"] and out["group"]
        assert out["rs_avg"] < 1e-6
        assert out["pending"] == 0
        assert out["ledger"] == [("all_gather", "gather test"), ("reduce_scatter", "")]


# ---------------------------------------------------------------------------
# failures: named, and the communicator aborted instead of hanging

def _one_rank(mod, timeout_s=60.0):
    """A world-size-1 NcclComm and the Comm that issues its collectives."""
    nccl = mod.NcclComm(0, 1, mod.nccl_unique_id(), 0, timeout_s)
    return nccl, _over(nccl)


def test_a_failed_call_names_the_collective_and_usage_errors_keep_the_comm(emu):
    mod, rt = emu
    nccl, comm = _one_rank(mod)
    x, y = torch.ones(4), torch.zeros(4)
    rt.fs_emu_fault(b"nccl_fail", NCCL_INVALID_USAGE)
    with pytest.raises(_C.CoreError) as e:
        comm.all_gather(x.data_ptr(), y.data_ptr(), 4, F32, "blocks.3 forward")
    msg = str(e.value)
    assert "all_gather for 'blocks.3 forward' on backend nccl" in msg and "ncclAllGather" in msg
    assert "invalid usage" in msg
    assert "rank 0's last collectives on this nccl Comm" in full_text(e.value)
    comm.all_gather(x.data_ptr(), y.data_ptr(), 4, F32)  # still usable
    assert torch.equal(y, x)
    nccl.close()


def test_a_system_error_aborts_the_communicator(emu):
    mod, rt = emu
    nccl, comm = _one_rank(mod)
    x = torch.ones(4)
    rt.fs_emu_fault(b"nccl_fail", NCCL_SYSTEM_ERROR)
    with pytest.raises(_C.CoreError, match="ncclAllReduce.*unhandled system error"):
        comm.all_reduce(x.data_ptr(), 4, F32, False, "clip")
    with pytest.raises(_C.CoreError, match="aborted after an earlier failure"):
        comm.all_reduce(x.data_ptr(), 4, F32, False)
    nccl.close()


def test_an_asynchronous_error_is_reported_at_the_next_call(emu):
    mod, rt = emu
    nccl, comm = _one_rank(mod)
    x = torch.ones(4)
    rt.fs_emu_fault(b"nccl_async", NCCL_REMOTE_ERROR)
    try:
        with pytest.raises(_C.CoreError) as e:
            comm.broadcast(x.data_ptr(), 4, F32, 0, "sync_module_states")
    finally:
        rt.fs_emu_fault(b"nccl_async", 0)
    msg = str(e.value)
    assert "asynchronous error of an earlier collective" in msg
    assert "remote process exited" in msg and "injected asynchronous error" in msg
    with pytest.raises(_C.CoreError, match="aborted"):
        comm.broadcast(x.data_ptr(), 4, F32, 0)
    nccl.close()


def test_a_collective_that_never_finishes_times_out_and_aborts(emu):
    """A peer that never joins: the collective stays queued. The host's wait
    gives up after the timeout instead of hanging, and aborts (the message
    names the 1 s it waited)."""
    mod, rt = emu
    nccl, comm = _one_rank(mod, timeout_s=1.0)
    x, y = torch.ones(4), torch.zeros(4)
    rt.fs_emu_fault(b"event_never_ready", 1)
    try:
        comm.all_gather(x.data_ptr(), y.data_ptr(), 4, F32)  # issued: returns
        with pytest.raises(_C.CoreError) as e:
            comm.barrier("end of step")
    finally:
        rt.fs_emu_fault(b"event_never_ready", 0)
    assert "did not finish within 1 s" in str(e.value) and "aborted" in str(e.value)
    assert "barrier for 'end of step'" in str(e.value)
    with pytest.raises(_C.CoreError, match="aborted"):
        comm.all_gather(x.data_ptr(), y.data_ptr(), 4, F32)
    with pytest.raises(mod.NcclError, match="wait on backend nccl.*aborted"):
        nccl.wait(1.0)
    nccl.close()


def _stall_until_the_watchdog_fires(rt, issue, capfd):
    """Issue a collective that never finishes, then let the host do other
    things (no flatshard call) until the watchdog speaks, for 60 s at most;
    what it printed (the callers check it names the 1 s timeout it fired at)."""
    import time
    rt.fs_emu_fault(b"event_never_ready", 1)
    printed = ""
    try:
        t0 = time.monotonic()
        issue()  # returns: the collective is only queued
        while "flatshard watchdog" not in printed and time.monotonic() - t0 < 60:
            time.sleep(0.05)
            printed += capfd.readouterr().err
    finally:
        rt.fs_emu_fault(b"event_never_ready", 0)
    return printed


def test_the_watchdog_aborts_a_collective_nobody_waits_for(emu, capfd):
    """On a GPU the host runs ahead of a stuck collective until some host
    wait (e.g. loss.item()) blocks inside torch. The communicator's watchdog
    thread times every collective, aborts the communicator (which frees that
    wait) and says which collective it was; the next call raises it."""
    mod, rt = emu
    nccl, comm = _one_rank(mod, timeout_s=1.0)
    x, y = torch.ones(4), torch.zeros(4)
    comm.all_gather(x.data_ptr(), y.data_ptr(), 4, F32, "warm-up")  # finishes
    printed = _stall_until_the_watchdog_fires(
        rt, lambda: comm.all_gather(x.data_ptr(), y.data_ptr(), 4, F32, "blocks.3 forward"),
        capfd)
    assert "flatshard watchdog: rank 0: NCCL all_gather for 'blocks.3 forward' (collective 2 " \
        "on this communicator) did not finish within 1 s" in printed
    with pytest.raises(_C.CoreError) as e:
        comm.all_reduce(x.data_ptr(), 4, F32, False, "clip")
    msg = str(e.value)
    assert "all_reduce for 'clip'" in msg and "aborted by its watchdog" in msg
    assert "all_gather for 'blocks.3 forward'" in msg and "a peer died" in msg
    nccl.close()


def test_the_watchdog_names_the_unit_behind_a_device_comm(emu, capfd):
    """Through comm.py's functions, the collective is named by what the
    ledger records: the unit or the tag."""
    from flatshard.runtime.comm import all_reduce_
    mod, rt = emu
    nccl, comm = _one_rank(mod, timeout_s=1.0)
    t = torch.ones(8)
    printed = _stall_until_the_watchdog_fires(rt, lambda: all_reduce_(comm, t, tag="layers.7"),
                                              capfd)
    assert "NCCL all_reduce for 'layers.7' (collective 1" in printed
    with pytest.raises(_C.CoreError, match="aborted by its watchdog.*layers.7") as e:
        all_reduce_(comm, t, tag="next")
    assert_documented("nccl-watchdog", printed + "\n" + full_text(e.value))
    nccl.close()


def test_the_watchdog_reports_a_device_fault_at_once_and_ignores_process_exit(emu, capfd):
    """A device fault under a collective is reported without waiting for the
    timeout; the runtime unloading (process exit) stops the watchdog quietly."""
    import time
    mod, rt = emu
    x, y = torch.ones(4), torch.zeros(4)
    for code, fires in ((4, False), (719, True)):  # cudaErrorCudartUnloading, LaunchFailure
        nccl, comm = _one_rank(mod, timeout_s=30.0)
        rt.fs_emu_fault(b"event_error", code)
        try:
            comm.all_gather(x.data_ptr(), y.data_ptr(), 4, F32, "blocks.0")
            printed, t0 = "", time.monotonic()
            while time.monotonic() - t0 < (10 if fires else 1.5):
                time.sleep(0.05)
                printed += capfd.readouterr().err
                if "flatshard watchdog" in printed:
                    break
        finally:
            rt.fs_emu_fault(b"event_error", 0)
        if fires:
            # the device's fault, seen at once: the 30 s timeout's words are
            # "did not finish", and the wait above gave up after 10 s
            assert "NCCL all_gather for 'blocks.0' (collective 1 on this communicator) failed " \
                "on the device: cudaErrorLaunchFailure" in printed
            assert "did not finish" not in printed, printed
            with pytest.raises(_C.CoreError, match="aborted by its watchdog"):
                comm.all_gather(x.data_ptr(), y.data_ptr(), 4, F32)
        else:
            assert printed == ""
            comm.all_gather(x.data_ptr(), y.data_ptr(), 4, F32)  # not aborted
        nccl.close()


def test_misuse_is_refused_with_what_to_do(emu):
    mod, rt = emu
    nccl, comm = _one_rank(mod)
    x = torch.ones(8, dtype=torch.bfloat16)
    nccl.group_start(stream=0)
    with pytest.raises(_C.CoreError, match="inside a group is not supported"):
        comm.all_reduce(x.data_ptr(), 8, BF16, False)
    with pytest.raises(_C.StateError, match="not allowed inside a group"):
        comm.barrier()
    with pytest.raises(mod.NcclError, match="a group is already open"):
        nccl.group_start(stream=0)
    nccl.group_end()
    with pytest.raises(mod.NcclError, match="no group is open"):
        nccl.group_end()
    nccl.close()
    # the Comm over a closed communicator is refused, never handed a freed one
    with pytest.raises(_C.CoreError, match="barrier: the NCCL communicator is closed"):
        comm.barrier()
    with pytest.raises(mod.NcclError, match="wait: the NCCL communicator is closed"):
        nccl.wait(1.0)
    nccl.close()  # again: nothing left to do
    assert nccl.stream == 0


def test_a_failed_kernel_launch_is_a_cuda_error_naming_the_op(emu):
    mod, rt = emu
    a, b = torch.ones(4), torch.zeros(4, dtype=torch.bfloat16)
    rt.fs_emu_fault(b"launch_error", 1)
    with pytest.raises(mod.CudaError, match="cast: cudaErrorLaunchFailure"):
        mod.cast(b.data_ptr(), BF16, a.data_ptr(), F32, 4, 0)
    mod.cast(b.data_ptr(), BF16, a.data_ptr(), F32, 4, 0)
    assert torch.equal(b, a.to(torch.bfloat16))


# ---------------------------------------------------------------------------
# the kernels through the module's Python entry points (argument glue)

def test_module_optimizers_match_the_cpu_core(emu):
    mod, _ = emu
    n = 1031
    torch.manual_seed(0)
    p, g = torch.randn(n), torch.randn(n)
    m, v = torch.randn(n) * 0.1, torch.rand(n) * 0.1
    mx = torch.rand(n) * 0.1
    hp = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-6, weight_decay=0.1, step=3,
              decoupled=True, maximize=False)
    want = [t.clone() for t in (p, g, m, v, mx)]
    want_copy = torch.zeros(n, dtype=torch.float16)
    _C.adam_step(*[t.data_ptr() for t in want], want_copy.data_ptr(), F16, n, simd="scalar",
                 **hp)
    got = [t.clone() for t in (p, g, m, v, mx)]
    copy = torch.zeros(n, dtype=torch.float16)
    mod.adam_step(*[t.data_ptr() for t in got], copy.data_ptr(), F16, n, stream=0, **hp)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(copy, want_copy)

    sp, sbuf = p.clone(), torch.zeros(n)
    cp, cbuf = p.clone(), torch.zeros(n)
    for first in (True, False):
        kw = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True,
                  maximize=False, first_step=first)
        mod.sgd_step(sp.data_ptr(), g.data_ptr(), sbuf.data_ptr(), 0, BF16, n, stream=0, **kw)
        _C.sgd_step(cp.data_ptr(), g.data_ptr(), cbuf.data_ptr(), 0, BF16, n, **kw)
    assert torch.equal(sp, cp) and torch.equal(sbuf, cbuf)

    out = torch.zeros(1, dtype=torch.float64)
    mod.norm_partial(g.data_ptr(), F32, n, False, out.data_ptr(), 0)
    assert out.item() == pytest.approx((g.double() ** 2).sum().item(), rel=1e-12)


def test_module_pack_unpack_split_long_tables(emu):
    mod, _ = emu
    ts = [torch.randn(k + 1) for k in range(150)]  # more segments than one launch takes
    total = sum(t.numel() for t in ts) + 10
    flat = torch.full((total,), 7.0, dtype=torch.bfloat16)
    segs, pos = [], 0
    for t in ts:
        segs.append((t.data_ptr(), 0, pos, t.numel(), F32))
        pos += t.numel()
    segs.append((0, 0, pos, 10, BF16))  # padding: zeros
    mod.pack(flat.data_ptr(), BF16, segs, 0)
    assert torch.equal(flat, torch.cat(ts + [torch.zeros(10)]).to(torch.bfloat16))
    outs = [torch.zeros_like(t) for t in ts]
    mod.unpack(flat.data_ptr(), BF16, [(o.data_ptr(),) + s[1:] for o, s in zip(outs, segs)], 0)
    assert all(torch.equal(o, t.to(torch.bfloat16).float()) for o, t in zip(outs, ts))


def _quant_on_a_device():
    comm = _device_comm(dist.group.WORLD, None)
    g = _C.ShardGroup("g", comm, [8], [4], [True], _C.align_numel(4), 0, 0,
                      empty=empty_fn(torch.device("cpu")))
    out = []
    send, recv = torch.zeros(8), torch.zeros(8)  # "device" memory is host memory here
    for call in (lambda: g.set_comm_quant(8, 0, 256),
                 lambda: comm.all_to_all(send.data_ptr(), recv.data_ptr(), 4, 0, "a2a")):
        try:
            call()
            out.append(None)
        except _C.CoreError as e:
            out.append(str(e))
    g.set_comm_quant(0, 0, 256)  # off is fine anywhere
    return out


def test_quantized_collectives_are_refused_on_a_device(dist_pool):
    """The engine's quantized collectives run on host links: a device group
    refuses the setting, naming it; NCCL's all-to-all needs ncclSend/ncclRecv,
    which the emulated library lacks, and says so."""
    for refused, a2a in dist_pool(2).run(_quant_on_a_device):
        assert "host links" in refused and "device" in refused
        assert "ncclSend/ncclRecv" in a2a
