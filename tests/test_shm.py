"""The shared-memory backend: its reduction kernels against float64, backend
selection and its errors, and failure handling (a rank that never arrives,
a rank that dies, a rank that dies or is interrupted during the set-up)
with no segment left behind, and none removed that the set-up did not
create."""
import contextlib
import datetime
import os
import re
import signal
import time
import uuid

import pytest
import torch
import torch.distributed as dist

import flatshard
from dist_pool import read_report, write_report
from flatshard import _C, ConfigError
from flatshard.runtime import comm as fcomm
from flatshard.runtime import timeout as ftimeout
from flatshard.tensors import dtype_code

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


# Ranks whose segments this module checks; other flatshard jobs on the same
# machine have segments of their own, which are none of these tests' business.
_PIDS = set()


def _pid():
    return os.getpid()


def pool_pids(pool):
    """Start the pool if it is down; -> its ranks' pids, remembered for the
    module's last check."""
    pids = pool.run(_pid)
    _PIDS.update(pids)
    return pids


def leftover_segments(pids):
    """Segments of these processes in /dev/shm (a segment's name carries the
    pid of the rank that created it)."""
    return [n for n in os.listdir("/dev/shm")
            if any(n.startswith(f"flatshard-{pid}-") for pid in pids)]


# ---------------------------------------------------------------------------
# kernels


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 1031])
@pytest.mark.parametrize("nsrc", [1, 2, 3, 4])
def test_reduce_sum_matches_float32_reference(dtype, n, nsrc):
    g = torch.Generator().manual_seed(n * 10 + nsrc)
    srcs = [torch.randn(n, generator=g).to(dtype) for _ in range(nsrc)]
    scale = 1.0 / nsrc
    # Reference: the same order of f32 sums (f64 for f64), then one rounding.
    acc_t = torch.float64 if dtype == torch.float64 else torch.float32
    acc = srcs[0].to(acc_t)
    for s in srcs[1:]:
        acc = acc + s.to(acc_t)
    want = (acc * (scale if dtype == torch.float64 else torch.tensor(scale, dtype=acc_t))).to(dtype)
    outs = {}
    levels = ["scalar", "avx2", "avx512"][:["scalar", "avx2", "avx512"].index(
        _C.simd_level()) + 1]
    for level in levels:
        out = torch.empty(n, dtype=dtype)
        _C.reduce_sum(out.data_ptr(), dtype_code(dtype), [s.data_ptr() for s in srcs], n, scale,
                      level)
        outs[level] = out
        assert torch.equal(out, want), (level, out, want)
    for level in levels[1:]:  # SIMD and scalar give the same bits
        assert torch.equal(outs["scalar"].view(-1), outs[level].view(-1))


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 17, 63, 1031])
@pytest.mark.parametrize("shift", [0, 1, 3, 16, 31])  # elements off a 32-byte boundary
def test_reduce_sum_streamed_gives_the_plain_bits(dtype, n, shift):
    # The streamed store path aligns dst in scalar first: every head length.
    g = torch.Generator().manual_seed(n * 7 + shift)
    srcs = [torch.randn(n, generator=g).to(dtype) for _ in range(3)]
    base = torch.zeros(n + shift + 64, dtype=dtype)
    want = torch.empty(n, dtype=dtype)
    _C.reduce_sum(want.data_ptr(), dtype_code(dtype), [s.data_ptr() for s in srcs], n, 0.5,
                  "scalar")
    for level in ("auto", "scalar"):
        base.fill_(7)
        out = base[shift:shift + n]
        _C.reduce_sum(out.data_ptr(), dtype_code(dtype), [s.data_ptr() for s in srcs], n, 0.5,
                      level, True)
        assert torch.equal(out.view(-1), want.view(-1)), level
        assert (base[:shift] == 7).all() and (base[shift + n:] == 7).all()  # nothing else


@pytest.mark.parametrize("nbytes", [0, 1, 63, 64, 65, 127, 128, 129, 191, 4097, (1 << 20) + 3])
@pytest.mark.parametrize("dst_off", [0, 1, 32, 63])
@pytest.mark.parametrize("src_off", [0, 5])
def test_copy_stream_matches_memcpy(nbytes, dst_off, src_off):
    g = torch.Generator().manual_seed(nbytes + dst_off * 3 + src_off)
    src = torch.randint(0, 256, (nbytes + src_off,), dtype=torch.uint8, generator=g)
    for level in ("scalar", "auto"):  # scalar is memcpy, the reference
        dst = torch.full((nbytes + dst_off + 64,), 0xAB, dtype=torch.uint8)
        _C.copy_stream(dst.data_ptr() + dst_off, src.data_ptr() + src_off, nbytes, level)
        assert torch.equal(dst[dst_off:dst_off + nbytes], src[src_off:]), level
        assert (dst[:dst_off] == 0xAB).all() and (dst[dst_off + nbytes:] == 0xAB).all()


def test_copy_stream_refuses_bad_arguments():
    with pytest.raises(ValueError, match="nbytes"):
        _C.copy_stream(0, 0, -1)
    with pytest.raises(ValueError, match="simd"):
        _C.copy_stream(0, 0, 0, "sse9")


def test_reduce_sum_in_place_and_nan():
    a = torch.tensor([1.0, float("nan"), 3.0] * 5, dtype=torch.bfloat16)
    b = torch.ones(15, dtype=torch.bfloat16)
    _C.reduce_sum(a.data_ptr(), _C.BF16, [a.data_ptr(), b.data_ptr()], 15, 1.0)
    assert torch.isnan(a[1::3]).all() and torch.equal(a[0::3], torch.full((5,), 2.0,
                                                                          dtype=torch.bfloat16))


# ---------------------------------------------------------------------------
# selection


def test_backend_argument_is_validated():
    with pytest.raises(ConfigError, match="comm_backend='gloo'"):
        fcomm.requested_backend("gloo")
    assert fcomm.requested_backend("nccl") == "nccl"  # checked against the device later
    with pytest.raises(ConfigError, match="NCCL backend moves CUDA memory"):
        fcomm.backend_for_device("nccl", torch.device("cpu"))
    os.environ[fcomm.ENV_BACKEND] = "bogus"
    try:
        with pytest.raises(ConfigError, match="FLATSHARD_COMM_BACKEND"):
            fcomm.requested_backend(None)
        assert fcomm.requested_backend("torch") == "torch"  # the argument wins
    finally:
        del os.environ[fcomm.ENV_BACKEND]
    assert fcomm.requested_backend(None) == "auto"


def _selection():
    rank = dist.get_rank()
    out = {"auto": fcomm.comm_for(dist.new_group(backend="gloo"), "auto").backend,
           "torch": fcomm.comm_for(dist.new_group(backend="gloo"), "torch").backend}
    # Pretend every rank is on its own machine.
    real = fcomm._host_identity
    fcomm._host_identity = lambda: f"node{rank}|boot{rank}"
    try:
        out["auto_multi_host"] = fcomm.comm_for(dist.new_group(backend="gloo"), "auto").backend
        try:
            fcomm.comm_for(dist.new_group(backend="gloo"), "shm")
            out["shm_multi_host"] = "no error"
        except ConfigError as e:
            out["shm_multi_host"] = str(e)
    finally:
        fcomm._host_identity = real
    model = flatshard.FSDP(torch.nn.Linear(3, 3), comm_backend="torch")
    out["wrapper"] = model._unit.c.counts is not None and fcomm.comm_for(
        dist.group.WORLD, "torch").backend
    return out


def test_auto_picks_shm_on_one_host_and_torch_across_hosts(dist_pool):
    res = dist_pool(2).run(_selection)[0]
    assert res["auto"] == "shm" and res["torch"] == "torch"
    assert res["auto_multi_host"] == "torch"
    assert "not all on one" in res["shm_multi_host"] and "node0" in res["shm_multi_host"]
    assert res["wrapper"] == "torch"


# ---------------------------------------------------------------------------
# failures


def _missing_rank(timeout_s):
    rank = dist.get_rank()
    os.environ[ftimeout.ENV_TIMEOUT] = str(timeout_s)
    try:
        c = fcomm.comm_for(dist.new_group(backend="gloo"), "shm")
    finally:
        del os.environ[ftimeout.ENV_TIMEOUT]
    t = torch.ones(5)
    out = torch.empty(5 * dist.get_world_size())
    if rank == 1:  # stays away from the collective for longer than the timeout
        time.sleep(timeout_s + 1.0)
    try:
        fcomm.all_gather_into(c, out, t)
        msg = "no error"
    except flatshard.CoreError as e:
        msg = str(e)
    return msg, c.failure


def test_a_rank_that_never_arrives_is_named_within_the_timeout(dist_pool):
    pids = pool_pids(dist_pool(3))
    res = dist_pool(3).run(_missing_rank, 1.5, timeout=60)
    msg0 = res[0][0]
    # rank 0's or rank 2's wait ran to its timeout first ("timed out",
    # failure "absent") and aborted the group: rank 0 says it in its own
    # words or in the other's
    assert re.search(r"rank [02] waiting in all_gather", msg0), msg0
    assert "timed out: rank 1" in msg0 and "has not arrived" in msg0, msg0
    assert [r[1] for r in res] == ["absent"] * 3  # the others learn it with the words
    # Rank 1, arriving late, learns the cause from the group's abort (the
    # waiting rank's words) instead of waiting out a timeout of its own,
    # which would be its own "rank 1 waiting ... timed out".
    msg1 = res[1][0]
    assert re.search(r"shm group aborted: rank [02] waiting", msg1) and "rank 1" in msg1, msg1
    assert "rank 1 waiting" not in msg1, msg1
    assert not leftover_segments(pids)


def _dies(report_path):
    rank = dist.get_rank()
    c = fcomm.comm_for(dist.new_group(backend="gloo"), "shm")
    if rank == 1:
        os._exit(7)
    try:
        c.barrier()
        msg = "no error"
    except flatshard.CoreError as e:
        msg = f"{e}\nfailure: {c.failure}"
    write_report(report_path, msg)


def _assert_death_named(dist_pool, world, job, report, op):
    """Rank 1 dies (exit code 7) in `job`; rank 0's report names it, in `op`,
    as dead, found by the liveness checks (not at the 300 s timeout, whose
    message says the wait "timed out"), and no segment is left behind."""
    pids = pool_pids(dist_pool(world))
    with pytest.raises(AssertionError, match="rank 1 died with exit code 7"):
        dist_pool(world).run(job, str(report), timeout=60)
    msg = read_report(report)
    assert "rank 1 (pid" in msg and "died" in msg and op in msg, msg
    assert "timed out" not in msg, msg
    assert msg.endswith("failure: dead"), msg
    assert not leftover_segments(pids)


def test_a_dead_rank_is_named_by_the_others(dist_pool, tmp_path):
    _assert_death_named(dist_pool, 2, _dies, tmp_path / "rank0.txt", "barrier")


def _dies_mid_collective(report_path):
    # Small slots, so that every all-gather is many chunks: rank 1 dies while
    # the others wait on its counts between chunks or at a collective's first
    # chunk (comm_shm.c, [Note: chunk pipeline]); either way it is named.
    rank = dist.get_rank()
    os.environ[fcomm.ENV_SLOT] = "4096"
    try:
        c = fcomm.comm_for(dist.new_group(backend="gloo"), "shm")
    finally:
        del os.environ[fcomm.ENV_SLOT]
    t = torch.full((100_003,), float(rank))
    out = torch.empty(t.numel() * dist.get_world_size())
    msg = "no error"
    try:
        for i in range(100_000):
            if rank == 1 and i == 40:
                os._exit(7)
            fcomm.all_gather_into(c, out, t)
    except flatshard.CoreError as e:
        msg = f"{e}\nfailure: {c.failure}"
    if rank == 0:
        write_report(report_path, msg)


def test_a_rank_dying_between_chunks_is_named(dist_pool, tmp_path):
    # 40 collectives, then rank 1's death
    _assert_death_named(dist_pool, 3, _dies_mid_collective, tmp_path / "rank0.txt",
                        "all_gather")


# ---------------------------------------------------------------------------
# failures during the set-up: [Note: shm set-up] in runtime/comm.py


class _FailingCall:
    """Stands in for a module comm.py uses (_C or dist): its attribute
    `name` fails, before or after the real call, by `how`: 'kill' (SIGKILL,
    no clean-up at all) or 'interrupt' (KeyboardInterrupt, as from Ctrl-C)."""

    def __init__(self, module, name, after, how):
        self._module, self._name, self._after, self._how = module, name, after, how

    def __getattr__(self, attr):
        real = getattr(self._module, attr)
        if attr != self._name:
            return real

        def call(*args, **kwargs):
            out = real(*args, **kwargs) if self._after else None
            if self._how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise KeyboardInterrupt
        return call


# step -> (the rank that fails, the module attribute comm.py calls there,
# whether it fails after that call)
SETUP_STEPS = {
    "rank0_after_create": (0, "_C", "Comm", True),
    "rank1_after_name": (1, "dist", "broadcast", True),
    "rank1_before_attach": (1, "_C", "Comm", False),
    "rank1_after_attach": (1, "_C", "Comm", True),
}
GROUP_TIMEOUT_S = 3  # how long a rank waits for a peer that was interrupted and went on


def _setup_fails(step, how, report_path):
    rank, (who, module, name, after) = dist.get_rank(), SETUP_STEPS[step]
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    real = getattr(fcomm, module)
    if rank == who:
        setattr(fcomm, module, _FailingCall(real, name, after, how))
    try:
        fcomm.comm_for(group, "shm")
        msg = "no error"
    except KeyboardInterrupt:
        msg = "interrupted"
    except Exception as e:
        msg = str(e)
    finally:
        setattr(fcomm, module, real)
    if rank != who:
        write_report(report_path, msg)
    return msg


@pytest.mark.parametrize("how", ["kill", "interrupt"])
@pytest.mark.parametrize("step", list(SETUP_STEPS))
def test_a_rank_lost_during_set_up_leaves_no_segment(dist_pool, tmp_path, step, how):
    pool, who = dist_pool(2), SETUP_STEPS[step][0]
    pids = pool_pids(pool)
    before = set(leftover_segments(pids))  # an earlier test's leak is not this case's
    report = tmp_path / "survivor.txt"
    if how == "kill":
        with pytest.raises(AssertionError, match=f"rank {who} died with exit code -9"):
            pool.run(_setup_fails, step, how, str(report), timeout=60)
    else:
        assert pool.run(_setup_fails, step, how, str(report), timeout=60)[who] == "interrupted"
    msg = read_report(report)  # the survivor got to the end of its set-up
    # ...in one of its gloo collectives ([Note: shm set-up]): at once when its
    # peer's process is gone, at the group's timeout when its peer went on;
    # never a longer wait (FLATSHARD_COMM_TIMEOUT's 300 s)
    if how == "kill":
        assert re.search(r"Connection (closed|reset) by peer", msg), msg
    else:
        assert f"Timed out waiting {GROUP_TIMEOUT_S * 1000}ms" in msg, msg
    assert sorted(set(leftover_segments(pids)) - before) == []


def _slot_bytes_on_rank1_only():
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    if dist.get_rank() == 1:
        os.environ[fcomm.ENV_SLOT] = "junk"
    try:
        fcomm.comm_for(group, "shm")
        return "no error"
    except Exception as e:
        return str(e)
    finally:
        os.environ.pop(fcomm.ENV_SLOT, None)


def test_a_setting_bad_on_one_rank_fails_the_set_up_everywhere(dist_pool):
    pool = dist_pool(2)
    pids = pool_pids(pool)
    before = set(leftover_segments(pids))
    msg0, msg1 = pool.run(_slot_bytes_on_rank1_only, timeout=60)
    assert sorted(set(leftover_segments(pids)) - before) == []
    assert "could not set up the shm backend" in msg1 and "FLATSHARD_SHM_SLOT_BYTES" in msg1
    assert "could not set up the shm backend (another rank failed)" in msg0


def _set_up_with_name(name):
    """The shm set-up of a new group, its rank 0 choosing `name` -> this
    rank's error text ("no error" if none)."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    real = fcomm._segment_name
    if dist.get_rank() == 0:
        fcomm._segment_name = lambda: name
    try:
        fcomm.comm_for(group, "shm")
        return "no error"
    except RuntimeError as e:
        return str(e)
    finally:
        fcomm._segment_name = real


def test_a_name_taken_by_another_segment_is_refused_and_left_alone(dist_pool):
    """Rank 0's create fails when a segment of that name exists already
    (another process's): every rank refuses, and none removes the name,
    which this group never created."""
    name = f"flatshard-planted-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path = os.path.join("/dev/shm", name)
    payload = b"another process's segment"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)
        msg0, msg1 = dist_pool(2).run(_set_up_with_name, "/" + name, timeout=60)
        assert "rank 0 could not set up the shm backend" in msg0, msg0
        assert name in msg0 and "File exists" in msg0 and "comm_backend='torch'" in msg0, msg0
        assert "rank 1 could not set up the shm backend (rank 0 could not create" in msg1, msg1
        with open(path, "rb") as f:  # still there, untouched
            assert f.read() == payload
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def test_no_segment_left_in_dev_shm():
    assert _PIDS and not leftover_segments(_PIDS)


def test_attaching_to_a_segment_not_yet_sized_is_an_error_not_a_crash(tmp_path):
    """Between the creator's shm_open and its ftruncate the segment exists with
    0 bytes; an attacher that mapped it would die of SIGBUS on first touch.
    It must get an error it can retry on. Run in a child so a crash fails
    the test instead of killing pytest."""
    import subprocess
    import sys
    name = f"flatshard-{os.getpid()}-unsized-{uuid.uuid4().hex[:8]}"
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.close(fd)
    try:
        code = ("from flatshard import _C\n"
                "try:\n"
                f"    _C.Comm('shm', 1, 2, name='/{name}', slot_bytes=1 << 16, timeout_s=5)\n"
                "except _C.CoreError as e:\n"
                "    print('refused:', e)\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, (proc.returncode, proc.stderr)
        assert "refused:" in proc.stdout and "not ready" in proc.stdout, proc.stdout
    finally:
        os.unlink(path)
