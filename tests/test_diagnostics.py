"""Failures that name their cause: wrap-time consistency across ranks
(runtime/consistency.py), the collective ledger (csrc/backends/ledger.c), ranks that go out
of step at run time (shm: at the first collective that differs; gloo: at
the group's timeout), and docs/troubleshooting.md, whose every message is
checked against the error a test triggers."""
import datetime
import multiprocessing
import os
import re
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard
from dist_pool import read_report, write_report
from flatshard import _C, FSDP, ConfigError, CoreError, ModuleWrapPolicy
from flatshard.runtime import comm as fcomm
from flatshard.runtime import timeout as ftimeout
from toy_models import Block, build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUIDE = os.path.join(ROOT, "docs", "troubleshooting.md")


# ---------------------------------------------------------------------------
# the troubleshooting guide: every entry is checked by a test


def documented(name):
    """The message block under `<!-- test: name -->` in the guide."""
    text = open(GUIDE).read()
    m = re.search(r"<!-- test: " + re.escape(name) + r" -->\s*```text\n(.*?)```", text, re.S)
    assert m, f"docs/troubleshooting.md has no entry <!-- test: {name} -->"
    return m.group(1)


def _normal(text):
    """What may differ between runs: pids, addresses, gloo's source paths."""
    text = re.sub(r"pid \d+", "pid N", text)
    text = re.sub(r"0x[0-9a-f]+", "0x...", text)
    return re.sub(r"\[[^\]]*gloo[^\]]*\]", "[gloo]", text)


def assert_documented(name, message):
    """Each line of the guide's block appears in the real message."""
    for line in documented(name).splitlines():
        if line.strip():
            assert _normal(line.strip()) in _normal(message), \
                f"guide entry {name!r}: {line.strip()!r} not in:\n{message}"


# Entries of the guide and the test that triggers each (asserted below).
GUIDE_ENTRIES = {
    "not-initialized": "test_uninitialized_distributed_is_documented",
    "bad-type": "test_validation.py",
    "not-built": "test_validation.py",
    "meta-without-init": "test_validation.py",
    "shared-parameter": "test_validation.py",
    "wrong-backend": "test_validation.py",
    "bad-timeout": "test_validation.py",
    "model-differs": "test_ranks_that_wrap_differently_are_named",
    "options-differ": "test_ranks_that_wrap_differently_are_named",
    "rank-failed-to-wrap": "test_ranks_that_wrap_differently_are_named",
    "rank-missing-at-wrap": "test_ranks_that_wrap_differently_are_named",
    "collectives-differ": "test_a_skipped_unit_is_caught_at_once_on_shm",
    "unit-sizes-differ": "test_a_unit_whose_shapes_differ_between_ranks_is_named",
    "rank-not-arrived": "test_a_rank_that_stops_issuing_is_named_at_the_timeout",
    "rank-died": "test_a_dead_rank_is_named_with_the_unit",
    "gloo-timeout": "test_a_skipped_unit_on_gloo_is_reported_at_the_group_timeout",
    "nccl-watchdog": "test_cuda_emulated_path.py",
    "out-of-memory": "test_oom.py",
    "checkpoint-damaged": "test_checkpoint_damage.py",
    "optimizer-before-wrap": "test_mistakes.py",
    "init-differs": "test_mistakes.py",
    "unsynced-step": "test_mistakes.py",
    "replicas-drift": "test_mistakes.py",
    "reduction-check": "test_comm_check.py",
    "no-effect-settings": "test_noop_settings.py",
    "unused-params": "test_unused_params.py",
    "outside-forward": "test_outside_forward.py",
}


def test_every_guide_entry_is_checked_by_a_test():
    names = set(re.findall(r"<!-- test: ([\w-]+) -->", open(GUIDE).read()))
    assert names == set(GUIDE_ENTRIES)


def full_text(e):
    """An exception as a user sees it: type, message and notes."""
    return "\n".join([f"{type(e).__name__}: {e}"] + list(getattr(e, "__notes__", [])))


def test_uninitialized_distributed_is_documented():
    if dist.is_initialized():
        pytest.skip("process group already initialized in this process")
    with pytest.raises(ConfigError) as info:
        FSDP(nn.Linear(2, 2))
    assert_documented("not-initialized", full_text(info.value))


# ---------------------------------------------------------------------------
# the ledger


def _local_comm(fail_on=None):
    """A one-rank torch-backend Comm whose collectives do nothing (or raise)."""
    def run(op, a, b, arg):
        if op == fail_on:
            raise RuntimeError(f"{op} failed on purpose")
    return _C.Comm("torch", 0, 1, fn=run)


def test_ledger_records_every_collective_in_a_bounded_ring():
    comm = _local_comm()
    x = torch.zeros(10)
    fcomm.all_gather_into(comm, x, x, tag="layers.0")
    fcomm.reduce_scatter_into(comm, x[:5], x[:5], tag="layers.1")
    fcomm.all_reduce_(comm, x.double())
    fcomm.broadcast_(comm, x, tag="sync")
    comm.barrier()
    got = comm.ledger()
    assert [(e["seq"], e["op"], e["unit"], e["bytes"], e["dtype"], e["state"]) for e in got] == [
        (1, "all_gather", "layers.0", 40, "float32", "completed"),
        (2, "reduce_scatter", "layers.1", 20, "float32", "completed"),
        (3, "all_reduce", "", 80, "float64", "completed"),
        (4, "broadcast", "sync", 40, "uint8", "completed"),
        (5, "barrier", "", 0, "uint8", "completed"),
    ]
    for _ in range(100):
        comm.barrier("b" * 60)  # names are cut at 47 bytes
    got = comm.ledger()
    assert len(got) == 64 and got[0]["seq"] == 42 and got[-1]["seq"] == 105
    assert got[-1]["unit"] == "b" * 47
    comm.barrier("a" * 46 + "\u00e9")  # a 2-byte character across the cut is dropped whole
    assert comm.ledger()[-1]["unit"] == "a" * 46


def test_a_failed_collective_carries_the_ledger():
    comm = _local_comm(fail_on="all_gather")
    comm.barrier("first")
    x = torch.zeros(4)
    with pytest.raises(RuntimeError, match="failed on purpose") as info:
        fcomm.all_gather_into(comm, x, x, tag="layers.3")
    text = full_text(info.value)
    assert "rank 0's last collectives on this torch Comm:" in text
    assert "barrier #1 for 'first' (0 B uint8, completed)" in text
    assert "all_gather #2 for 'layers.3' (16 B float32, failed)" in text
    assert comm.ledger()[-1]["state"] == "failed"


def _train_step_ledger(bucket):
    os.environ["FLATSHARD_REDUCE_BUCKET_BYTES"] = bucket  # read at the first forward
    try:
        model = FSDP(build(), auto_wrap_policy=ModuleWrapPolicy({Block}))
        comm = model._unit.c.comm
        start = comm.ledger()[-1]["seq"] if comm.ledger() else 0
        model(torch.randn(2, 5)).sum().backward()
    finally:
        del os.environ["FLATSHARD_REDUCE_BUCKET_BYTES"]
    return [(e["seq"], e["op"], e["unit"], e["bytes"], e["state"]) for e in comm.ledger()
            if e["seq"] > start]


def test_units_record_their_collectives_alike_on_every_rank(dist_pool):
    r0, r1 = dist_pool(2).run(_train_step_ledger, "0")
    assert r0 == r1
    ops = {(op, unit) for _, op, unit, _, _ in r0}
    for unit in ("<root>", "blocks.0", "blocks.1", "blocks.2"):
        assert ("all_gather", unit) in ops and ("reduce_scatter", unit) in ops, (unit, ops)
    assert all(state == "completed" for *_, state in r0)


def test_a_reduction_bucket_is_one_entry_naming_its_first_unit(dist_pool):
    """The default bucket: the four units' reductions in one reduce-scatter,
    recorded under the unit whose gradients came first, and how many more."""
    r0, r1 = dist_pool(2).run(_train_step_ledger, str(1 << 20))
    assert r0 == r1
    rs = [unit for _, op, unit, _, _ in r0 if op == "reduce_scatter"]
    assert rs == ["blocks.2 +3"], r0


# ---------------------------------------------------------------------------
# wrap-time consistency


def _wrap_mismatches():
    rank = dist.get_rank()
    policy = ModuleWrapPolicy({Block})
    out = {}

    def attempt(name, make, **kw):
        try:
            make(**kw)
            out[name] = "no error"
        except ConfigError as e:
            out[name] = full_text(e)

    def shapes():
        model = build()
        if rank == 1:  # a model built differently on one rank
            model.blocks[1].ff.lin = nn.Linear(7, 14)
        FSDP(model, auto_wrap_policy=policy)
    attempt("model", shapes)

    def backend():
        os.environ[fcomm.ENV_BACKEND] = "shm" if rank == 0 else "torch"
        try:
            FSDP(build(), auto_wrap_policy=policy)
        finally:
            del os.environ[fcomm.ENV_BACKEND]
    attempt("options", backend)

    def meta_on_one_rank():
        if rank == 1:
            with torch.device("meta"):
                FSDP(build(), auto_wrap_policy=policy)
        FSDP(build(), auto_wrap_policy=policy)
    attempt("failed", meta_on_one_rank)

    group = dist.new_group(backend="gloo")  # its own wrap count: rank 1 never wraps on it

    def missing():
        if rank == 0:
            os.environ[ftimeout.ENV_TIMEOUT] = "1"
            try:
                FSDP(build(), process_group=group)
            finally:
                del os.environ[ftimeout.ENV_TIMEOUT]
    attempt("missing", missing)
    # Every rank counted the same wraps on the default group: the next agrees.
    attempt("after", lambda: FSDP(build(), auto_wrap_policy=policy))
    return out


def _fully_shard_backends_differ():
    """fully_shard has no wrap-time comparison of its own: the Comm's set-up
    compares the backends the ranks ask for before either one's set-up."""
    from torch.distributed.device_mesh import DeviceMesh
    rank = dist.get_rank()
    group = dist.new_group(backend="gloo")  # no Comm cached for it yet
    os.environ[fcomm.ENV_BACKEND] = "shm" if rank == 0 else "torch"
    try:
        flatshard.fully_shard(nn.Linear(4, 4), mesh=DeviceMesh.from_group(group, "cpu"))
        return "no error"
    except ConfigError as e:
        return str(e)
    finally:
        del os.environ[fcomm.ENV_BACKEND]


def test_fully_shard_ranks_asking_for_different_backends_are_named(dist_pool):
    # The Comm's set-up compared the requests: a ConfigError naming both
    # ranks' backends on every rank, not the process group's timeout in
    # mismatched collectives (the pool's 60 s would end that).
    for msg in dist_pool(2).run(_fully_shard_backends_differ, timeout=60):
        assert "the ranks of the group ask for different backends: rank 0 'shm', " \
            "rank 1 'torch'" in msg and "comm_backend" in msg, msg


def test_ranks_that_wrap_differently_are_named(dist_pool):
    r0, r1 = dist_pool(2).run(_wrap_mismatches, timeout=60)
    for name in ("model", "options"):
        assert r0[name] == r1[name]  # the same error on every rank
    assert_documented("model-differs", r0["model"])
    assert_documented("options-differ", r0["options"])
    assert "param_init_fn=None" in r1["failed"]  # rank 1's own error; rank 0 names it
    assert_documented("rank-failed-to-wrap", r0["failed"])
    # told rank 1's own error, not that rank 1 did not come within the timeout
    assert "did not reach the wrap" not in r0["failed"], r0["failed"]
    # rank 0 waited out its 1 s timeout, the one the message names
    assert_documented("rank-missing-at-wrap", r0["missing"])
    assert r1["missing"] == "no error"
    assert r0["after"] == r1["after"] == "no error"


# ---------------------------------------------------------------------------
# ranks out of step at run time


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x))


class Branchy(nn.Module):
    """Three wrapped layers of one shape (the dangerous case: nothing about
    the sizes tells the ranks apart) and a branch that can skip one."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, 8)
        self.layers = nn.ModuleList(Layer() for _ in range(3))

    def forward(self, x, skip=None):
        h = self.inp(x)
        for i, layer in enumerate(self.layers):
            if i != skip:
                h = layer(h)
        return h.sum()


def _wrapped(backend, group_timeout=None):
    """Branchy on a group of its own (its Comm ends aborted), 2 s timeouts."""
    kw = {} if group_timeout is None else dict(timeout=datetime.timedelta(seconds=group_timeout))
    group = dist.new_group(backend="gloo", **kw)
    os.environ[ftimeout.ENV_TIMEOUT] = "2"
    try:
        return FSDP(Branchy(), process_group=group, comm_backend=backend,
                    auto_wrap_policy=ModuleWrapPolicy({Layer}))
    finally:
        del os.environ[ftimeout.ENV_TIMEOUT]


def _steps(model, skip, steps=2):
    """-> the error of `steps` steps as a user sees it, or "no error"."""
    try:
        for _ in range(steps):
            model(torch.randn(2, 5), skip=skip).backward()
        return "no error"
    except (CoreError, RuntimeError) as e:
        return full_text(e)


def _skip_one_unit(backend, group_timeout=None):
    model = _wrapped(backend, group_timeout)
    # Rank 1 takes the branch that skips layers.1 (say its batch was short).
    out = _steps(model, skip=1 if dist.get_rank() == 1 else None)
    # Each rank's own timeout, not its peer tearing the failed group down:
    # the ranks reach their last collectives at different times, so the one
    # that timed out first waits here (the default group is healthy).
    dist.barrier()
    return out, model._unit.c.comm.failure


def test_a_skipped_unit_is_caught_at_once_on_shm(dist_pool):
    (m0, f0), (m1, f1) = dist_pool(2).run(_skip_one_unit, "shm")
    # At the collective that differs, not at the 2 s timeout: the Comm's
    # failure is "desync" (a timeout's is "absent"), the first line says no
    # wait timed out. Also what the fix line is chosen by (none for this one).
    assert f0 == f1 == "desync"
    first = m0.split("\n")[0]
    assert first == m1.split("\n")[0]  # every rank says the same
    assert "timed out" not in first, first
    assert_documented("collectives-differ", m0)
    assert "all_gather #3 for 'layers.2' (144 B float32, failed)" in m1  # rank 1's own ledger


def _extra_forward_on_rank0():
    model = _wrapped("shm")
    model(torch.randn(2, 5)).backward()
    if dist.get_rank() == 1:
        return "no error", None
    with torch.no_grad():  # evaluation on rank 0 only: rank 1 never joins
        return _steps(model, skip=None, steps=1), model._unit.c.comm.failure


def _fully_shard_shapes_differ():
    """fully_shard has no wrap-time comparison: a layer of another shape on
    rank 1 meets the same collective of the same unit with another size."""
    from torch.distributed.device_mesh import DeviceMesh
    group = dist.new_group(backend="gloo")  # a Comm of its own, on shm
    os.environ[fcomm.ENV_BACKEND] = "shm"
    try:
        model = nn.Sequential(nn.Linear(4, 6 if dist.get_rank() == 1 else 4), nn.ReLU())
        mesh = DeviceMesh.from_group(group, "cpu")
        flatshard.fully_shard(model[0], mesh=mesh)
        flatshard.fully_shard(model, mesh=mesh)
    finally:
        del os.environ[fcomm.ENV_BACKEND]
    try:
        model(torch.randn(2, 4))
        return "no error"
    except CoreError as e:
        return f"{type(e).__name__}: {e}"


def test_a_unit_whose_shapes_differ_between_ranks_is_named(dist_pool):
    m0, m1 = dist_pool(2).run(_fully_shard_shapes_differ, timeout=60)
    assert m0.split("\n")[0] == m1.split("\n")[0]  # every rank says the same
    assert_documented("unit-sizes-differ", m0)
    # at the collective whose sizes differ, not at the timeout
    assert "timed out" not in m0.split("\n")[0], m0


def test_a_rank_that_stops_issuing_is_named_at_the_timeout(dist_pool):
    msg, failure = dist_pool(2).run(_extra_forward_on_rank0)[0]
    # Rank 0's wait timed out (failure "absent": a live rank never came), then
    # it waited a bounded 0.5 s for rank 1's ledger, which never comes.
    assert_documented("rank-not-arrived", msg)
    assert failure == "absent", failure


def _rank1_dies(report_path, backend="shm"):
    model = _wrapped(backend, group_timeout=5 if backend == "torch" else None)
    if dist.get_rank() == 1:
        os._exit(7)
    write_report(report_path, _steps(model, skip=None, steps=1))


def test_a_dead_rank_is_named_with_the_unit(dist_pool, tmp_path):
    report = tmp_path / "rank0.txt"
    with pytest.raises(AssertionError, match="rank 1 died with exit code 7"):
        dist_pool(2).run(_rank1_dies, str(report), timeout=60)
    msg = read_report(report)
    assert_documented("rank-died", msg)
    # noticed by the liveness checks: a wait that ran to the timeout says so
    assert "timed out" not in msg.split("\n")[0], msg


def test_a_dead_rank_is_named_on_the_torch_backend_too(dist_pool, tmp_path):
    # gloo fails the collective when its peer's socket closes; the ledger
    # comparison then names the rank that did not report.
    report = tmp_path / "rank0.txt"
    with pytest.raises(AssertionError, match="rank 1 died with exit code 7"):
        dist_pool(2).run(_rank1_dies, str(report), "torch", timeout=60)
    msg = read_report(report)
    assert "rank 1: did not report" in msg and "it died" in msg, msg
    assert re.search(r"rank 1 \(pid \d+\) died", msg), msg  # seen from this host
    assert "rank 0: all_gather" in msg or "rank 0: reduce_scatter" in msg, msg


def _rank0_dies_with_the_store(rank, port, report_path):
    """A rank of a job whose store is a TCP store in rank 0's process (tcp://
    and env:// rendezvous), on the torch backend: rank 0 is killed."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=20))
    model = _wrapped("torch")
    _steps(model, skip=None, steps=1)
    dist.barrier()  # both ranks have finished the good step
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    write_report(report_path, _steps(model, skip=None, steps=1))
    os._exit(0)  # the process group cannot be torn down without its store


def _two_fresh_ranks(target, report):
    """target(rank, port, report) in two new processes whose rank 0 hosts
    the store (not the pool's: these runs end a rank); (procs, port)."""
    with socket.socket() as s:  # a free port for rank 0's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, port, str(report)), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return procs, port


def test_a_dead_rank_0_is_named_on_the_torch_backend_with_its_store(tmp_path):
    report = tmp_path / "rank1.txt"
    procs, port = _two_fresh_ranks(_rank0_dies_with_the_store, report)
    assert procs[0].exitcode == -signal.SIGKILL, procs[0].exitcode
    msg = read_report(report)
    assert (f"rank 0 (pid {procs[0].pid}) died; it also hosted the process group's TCP store "
            f"(127.0.0.1:{port})") in msg, msg
    assert "rank 1's last collectives on this torch Comm" in msg, msg


def _rank0_ends_on_the_wrap_error(rank, port, report_path):
    """Models that differ between ranks; rank 0, whose process hosts the
    store, ends as soon as it has its error, as a script would."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=20))
    from flatshard.runtime import consistency
    model = build()
    if rank == 1:
        model.blocks[1].ff.lin = nn.Linear(7, 14)
        wait = consistency._wait

        def slow_wait(store, prefix, *args):  # rank 1 reads the descriptions last
            wait(store, prefix, *args)
            if prefix.endswith("desc/"):
                time.sleep(1.0)
        consistency._wait = slow_wait
    try:
        FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
        msg = "no error"
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
    if rank == 1:
        write_report(report_path, msg)
    os._exit(0)  # rank 0 at once: its store goes with it


def test_the_wrap_error_reaches_every_rank_when_rank_0_ends_on_it(tmp_path):
    report = tmp_path / "rank1.txt"
    _two_fresh_ranks(_rank0_ends_on_the_wrap_error, report)
    msg = read_report(report)
    assert msg.startswith("ConfigError: flatshard: the wrapped model differs between ranks"), msg


def test_a_skipped_unit_on_gloo_is_reported_at_the_group_timeout(dist_pool):
    # gloo cannot tell the units apart (same sizes): the ranks go on out of
    # step until one waits for a collective the other never issues.
    (m0, f0), (m1, f1) = dist_pool(2).run(_skip_one_unit, "torch", 2)
    assert f0 is f1 is None  # gloo's errors carry no kind: the ledgers' comparison decides
    # The rank whose wait timed out first reports its timeout. The other one
    # reports its own, or (on a loaded machine, when it began waiting later)
    # gloo's "Connection closed by peer" once the first rank's timeout closed
    # their connection; either way with the same comparison of the ledgers.
    assert "Timed out" in m0 or "Timed out" in m1, (m0, m1)
    for msg in (m0, m1):
        assert "Timed out" in msg or "Connection closed by peer" in msg, msg
        assert "first difference at #3: rank 0: all_gather #3 for 'layers.1'" in msg
        assert "rank 1: all_gather #3 for 'layers.2'" in msg
    if "Timed out" in m1:  # the guide shows rank 1's message (its recv timed out)
        assert_documented("gloo-timeout", m1)
