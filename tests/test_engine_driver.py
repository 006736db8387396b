"""The engine (csrc/engine/) without Python: tests/engine/driver.c.

The driver is built here with the system C compiler from the engine's own
sources (no Python.h, no torch), run as one process per rank on the
shared-memory backend, and trains a toy unit for a few steps (see the
driver's header for the arithmetic). Its bytes are checked against

  * the same steps driven through flatshard._C.Unit over a flatshard shm
    Comm in the dist_pool ranks: the same engine in the same order of
    operations, so the bytes must agree exactly;
  * a float64 numpy computation of the same training, with a tolerance
    bounded by the roundings the engine makes (float32, and bfloat16 under
    mixed precision).

Both paths name their shm segments /fs_drv_<this pid>_<random>; every test
checks that none is left in /dev/shm.
"""
import json
import os
import shutil
import subprocess
import uuid

import numpy as np
import pytest
import torch
import torch.distributed as dist

from flatshard import _C
from flatshard.tensors import ALIGN_BYTES

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
CSRC = os.path.join(ROOT, "csrc")
DRIVER_SOURCE = os.path.join(TESTS, "engine", "driver.c")
ENGINE_SOURCES = [os.path.join(CSRC, p) for p in (
    "engine/unit.c", "engine/unit_reduce.c", "engine/unit_fsm.c", "engine/link.c",
    "engine/group.c", "engine/link_quant.c", "core/quant.c",
    "core/copy.c", "core/layout.c", "core/reduce.c", "core/reduce_rule.c", "core/status.c",
    "core/stream_copy.c",
    "backends/comm.c", "backends/comm_shm.c", "backends/shm_staging.c", "backends/ledger.c")]
INCLUDES = [f"-I{os.path.join(CSRC, d)}" for d in ("core", "engine", "backends")]
BUILD_TIMEOUT = 120
RUN_TIMEOUT = 20      # seconds for all ranks of one driver run (they take well under 1 s)
SHM_TIMEOUT = 15.0    # the shm backend's own wait limit, inside RUN_TIMEOUT

# The toy model: odd sizes, an empty parameter, alignment gaps and end
# padding; the second group is large enough that the collectives go in
# several chunks through a 4 KiB slot (four 1 KiB sections).
GROUPS = [(3, 0, 5, 17), (1201, 2, 11)]
ALIGN = ALIGN_BYTES // 4  # float32 elements, as fsdp/flat_param.py aligns
SLOT = 4096
STEPS = 3
LR = 0.05
F32, BF16 = _C.F32, _C.BF16

CONFIGS = {
    "full_shard": dict(strategy=_C.FULL_SHARD, compute=F32, reduce=F32, accum=1),
    "shard_grad_op-accum": dict(strategy=_C.SHARD_GRAD_OP, compute=F32, reduce=F32, accum=2),
    "no_shard-accum": dict(strategy=_C.NO_SHARD, compute=F32, reduce=F32, accum=2),
    "shard_optim": dict(strategy=_C.SHARD_OPTIM, compute=F32, reduce=F32, accum=1),
    # mixed precision: bfloat16 compute, float32 reduction into float32 shards
    "full_shard-bf16-accum": dict(strategy=_C.FULL_SHARD, compute=BF16, reduce=F32, accum=2),
    "shard_grad_op-bf16": dict(strategy=_C.SHARD_GRAD_OP, compute=BF16, reduce=F32, accum=1),
    "no_shard-bf16": dict(strategy=_C.NO_SHARD, compute=BF16, reduce=F32, accum=1),
    "shard_optim-bf16": dict(strategy=_C.SHARD_OPTIM, compute=BF16, reduce=F32, accum=1),
    # the reduction itself in bfloat16 (reduce-scatter into the engine's red_out)
    "full_shard-bf16-bf16reduce": dict(strategy=_C.FULL_SHARD, compute=BF16, reduce=BF16,
                                       accum=2),
}


def shm_prefix():
    return f"fs_drv_{os.getpid()}_"


def new_shm_name():
    return f"/{shm_prefix()}{uuid.uuid4().hex[:12]}"


def leftover_segments():
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(shm_prefix()))


@pytest.fixture(autouse=True)
def no_leftover_segments():
    before = leftover_segments()
    yield
    assert leftover_segments() == before, "a shm segment of this test was left in /dev/shm"


# ---------------------------------------------------------------------------
# the toy model, as the driver defines it


def round_up(x, m):
    return -(-x // m) * m


def flat_layout(numels, world):
    """-> (flat offsets, shard_numel, padded_numel): layout.c's FLAT rule."""
    offsets, end = [], 0
    for n in numels:
        off = round_up(end, ALIGN)
        offsets.append(off)
        end = off + n
    shard = round_up(-(-end // world), ALIGN)
    return offsets, shard, shard * world


def layout_world(cfg, world):
    return 1 if cfg["strategy"] == _C.NO_SHARD else world


def init_flat(g, numels, world):
    """The padded flat buffer of group g before training, and its parameter
    mask (False in the padding). Values are multiples of 1/8: exact."""
    offsets, _, padded = flat_layout(numels, world)
    flat = np.zeros(padded, dtype=np.float64)
    mask = np.zeros(padded, dtype=bool)
    for j, (off, n) in enumerate(zip(offsets, numels)):
        k = np.arange(n)
        flat[off:off + n] = ((g * 31 + j * 7 + k) % 9 - 4) * 0.125
        mask[off:off + n] = True
    return flat, mask


def grad_f32(x, mask, mult):
    """The driver's gradient, every operation rounded to float32."""
    idx = np.arange(x.shape[0], dtype=np.float32)
    v = x.astype(np.float32) * np.float32(mult) + idx * np.float32(1e-3)
    return np.where(mask, v, np.float32(0)).astype(np.float32)


# ---------------------------------------------------------------------------
# the driver


def compiler():
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    cc = compiler()
    if cc is None:
        pytest.skip("no C compiler (cc, gcc or clang) on PATH: the engine driver cannot be "
                    "built")
    out = tmp_path_factory.mktemp("engine_driver")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    # The driver is held to -Wall -Wextra -Werror. The engine's sources get
    # the flags setup.py builds them with: its snprintf calls truncate long
    # messages on purpose, which -Wformat-truncation (in -Wall) rejects.
    engine_flags = ["-Wno-format-truncation"]
    if "clang" in version:
        engine_flags.append("-Wno-unknown-warning-option")
    obj, exe = str(out / "driver.o"), str(out / "driver")
    cmds = [
        [cc, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", *INCLUDES, "-c", DRIVER_SOURCE,
         "-o", obj],
        [cc, "-std=c11", "-O2", "-Wall", "-Werror", *engine_flags, *INCLUDES, obj,
         *ENGINE_SOURCES, "-o", exe, "-lpthread", "-lrt", "-lm"],
    ]
    for cmd in cmds:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
        if r.returncode != 0:
            pytest.fail(f"building the engine driver failed:\n{' '.join(cmd)}\n{r.stderr}")
    return exe


def driver_args(cfg, world):
    args = [f"world={world}", f"strategy={cfg['strategy']}", f"compute={cfg['compute']}",
            f"reduce={cfg['reduce']}", f"steps={STEPS}", f"accum={cfg['accum']}", f"lr={LR}",
            f"align={ALIGN}", f"slot={SLOT}", f"timeout={SHM_TIMEOUT}"]
    args += [f"coalesce={int(cfg.get('coalesce', False))}"]
    return args + ["group=" + ",".join(map(str, g)) for g in GROUPS]


def sizes(cfg, world):
    """[(shard_numel, padded_numel)] per group."""
    lw = layout_world(cfg, world)
    return [flat_layout(g, lw)[1:] for g in GROUPS]


def split_output(raw, cfg, world):
    """A rank's output bytes -> ([shard per group], [full per group]) as float32."""
    sz = sizes(cfg, world)
    want = 4 * sum(s + p for s, p in sz)
    assert len(raw) == want, f"driver wrote {len(raw)} bytes, expected {want}"
    a = np.frombuffer(raw, dtype=np.float32)
    shards, fulls, pos = [], [], 0
    for s, _ in sz:
        shards.append(a[pos:pos + s])
        pos += s
    for _, p in sz:
        fulls.append(a[pos:pos + p])
        pos += p
    return shards, fulls


def run_driver(exe, cfg, world, tmp_path):
    """All ranks of one driver run -> [(raw output bytes, summary dict)] by rank."""
    name = new_shm_name()
    outs = [str(tmp_path / f"driver_rank{r}.bin") for r in range(world)]
    procs = []
    try:
        for r in range(world):  # rank 0 creates the segment; the others retry until it is
            procs.append(subprocess.Popen(
                [exe, f"rank={r}", f"shm={name}", f"out={outs[r]}", *driver_args(cfg, world)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        results = []
        for r, p in enumerate(procs):
            try:
                stdout, stderr = p.communicate(timeout=RUN_TIMEOUT)
            except subprocess.TimeoutExpired:
                pytest.fail(f"driver rank {r} did not finish within {RUN_TIMEOUT} s")
            results.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        _C.shm_unlink(name)  # a no-op once every rank attached (the last one removes it)
    report = "\n".join(f"--- rank {r} (exit {rc}):\n{err}{out}"
                       for r, (rc, out, err) in enumerate(results))
    assert all(rc == 0 for rc, _, _ in results), f"the engine driver failed:\n{report}"
    ranks = []
    for r, (_, stdout, _) in enumerate(results):
        summary = json.loads(stdout.strip().splitlines()[-1])
        assert summary["rank"] == r
        with open(outs[r], "rb") as f:
            ranks.append((f.read(), summary))
    return ranks


# ---------------------------------------------------------------------------
# the same steps through flatshard._C.Unit (runs on every dist_pool rank)


def _connect_shm(name, rank, world):
    """Rank 0 creates the segment, then the others attach; the name is removed
    on every rank's way out (comm.py's [Note: shm set-up])."""
    comm, err = None, ""

    def attempt(create):
        nonlocal comm, err
        try:
            comm = _C.Comm("shm", rank, world, name=name, create=create, slot_bytes=SLOT,
                           timeout_s=SHM_TIMEOUT)
        except Exception as e:  # every rank must learn of it, not wait forever
            err = str(e)

    def ok_everywhere():
        ok = torch.tensor([0 if err else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return ok.item() == 1

    try:
        if rank == 0:
            attempt(True)
        ok = ok_everywhere()
        if ok and rank != 0:
            attempt(False)
        ok = ok and ok_everywhere()
    finally:
        _C.shm_unlink(name)
    if not ok:
        raise RuntimeError(f"rank {rank}: shm set-up failed: {err or 'on another rank'}")
    return comm


def _py_train(cfg, name):
    rank, world = dist.get_rank(), dist.get_world_size()
    no_shard = cfg["strategy"] == _C.NO_SHARD
    optim = cfg["strategy"] == _C.SHARD_OPTIM
    mixed = cfg["compute"] != F32
    cdtype = torch.bfloat16 if cfg["compute"] == BF16 else torch.float32
    lw, lrank = (1, 0) if no_shard else (world, rank)
    comm = _connect_shm(name, rank, world)
    groups, masks = [], []
    for g, numels in enumerate(GROUPS):
        offsets, sn, pn = flat_layout(numels, lw)
        layout, entries = _C.layout_flat(list(numels), lw, lrank, ALIGN)  # layout.c agrees
        assert (layout.shard_numel, layout.padded_numel) == (sn, pn)
        assert [e.flat_offset for e in entries] == offsets
        flat, mask = init_flat(g, numels, lw)
        shard = torch.from_numpy(flat[lrank * sn:(lrank + 1) * sn].astype(np.float32))
        if no_shard:
            full = shard.detach()
        else:
            full = torch.empty(pn, dtype=torch.float32)
            full.untyped_storage().resize_(0)
        lp = None
        if mixed:
            lp = torch.empty(pn, dtype=cdtype)
            lp.untyped_storage().resize_(0)
        groups.append(dict(shard=shard, full=full, lp=lp, sn=sn, pn=pn,
                           grad=torch.full((pn,), float("nan"), dtype=cdtype),
                           sgrad=torch.full((pn if optim else sn,), float("nan"))))
        masks.append(mask)
    unit = _C.Unit("driver.unit", comm, cfg["strategy"],
                   [(d["shard"], d["full"], F32, d["sn"], d["pn"], d["lp"], cfg["compute"],
                     cfg["reduce"]) for d in groups], (1 << len(groups)) - 1)
    actions = []
    if optim:
        unit.unshard()
    for _ in range(STEPS):
        for m in range(cfg["accum"]):
            actions.append(unit.event(_C.EV_PRE_FORWARD, _C.FLAG_GRAD_ENABLED))
            actions.append(unit.event(_C.EV_POST_FORWARD, _C.FLAG_GRAD_ENABLED))
            actions.append(unit.event(_C.EV_PRE_BACKWARD, 0))
            for d, mask in zip(groups, masks):
                x = (d["lp"] if mixed else d["full"]).float().numpy()
                d["grad"].copy_(torch.from_numpy(grad_f32(x, mask, rank + 1 + m)))
            for gi, d in enumerate(groups):
                actions.append(unit.event(_C.EV_POST_BACKWARD, 0, gi, d["grad"], d["sgrad"],
                                          m > 0))
            actions.append(unit.event(_C.EV_FINALIZE, 0))
        for d in groups:  # SGD on the shard, in float32
            p = d["shard"].numpy()
            gp = d["sgrad"].numpy()
            if optim:
                gp = gp[rank * d["sn"]:(rank + 1) * d["sn"]]
            p[:] = p - np.float32(LR) * gp
        if optim:
            unit.regather()
    unit.unshard(True)
    out = b"".join(d["shard"].numpy().tobytes() for d in groups)
    out += b"".join(d["full"].clone().numpy().tobytes() for d in groups)
    counts = dict(unit.counts)
    unit.reshard()
    del unit, comm
    return out, actions, counts


# ---------------------------------------------------------------------------
# float64


def reference(cfg, world):
    """The training in float64, on each group's whole flat buffer. -> per
    group (final flat buffer, tolerance per element: tolerance())."""
    lw = layout_world(cfg, world)
    res = []
    for g, numels in enumerate(GROUPS):
        flat, mask = init_flat(g, numels, lw)
        idx = np.arange(flat.shape[0], dtype=np.float64)
        max_p = np.abs(flat)            # per element, over the whole training
        max_g = np.zeros_like(flat)     # per element, over ranks and passes
        for _ in range(STEPS):
            total = np.zeros_like(flat)
            for m in range(cfg["accum"]):
                grads = [np.where(mask, flat * (r + 1 + m) + idx * 1e-3, 0.0)
                         for r in range(world)]
                for x in grads:
                    max_g = np.maximum(max_g, np.abs(x))
                total += sum(grads) / world
            flat = flat - LR * total
            max_p = np.maximum(max_p, np.abs(flat))
        res.append((flat, tolerance(cfg, world, max_g, max_p)))
    return res


def tolerance(cfg, world, max_g, max_p):
    """A bound on |engine - float64|, per element, from the element's largest
    |gradient| (max_g) and |parameter| (max_p) over the training.

    float32 (unit roundoff u = 2^-24): per backward pass a rank's gradient
    takes 4 roundings (the constant 1e-3, two products, one sum) of values
    up to max_g, the sum over `world` ranks world - 1, the mean 2 (1/world,
    the product), the accumulation 1; the SGD step 2, on values up to max_p.
    The update multiplies an earlier error by 1 - lr * (mean multiplier),
    between 0 and 1 here, so the errors of the steps add up and do not grow.
    bfloat16 compute (u = 2^-8): the parameter is rounded before use, which
    the gradient carries times the multiplier, (world + 1) / 2 + m on
    average over the ranks in backward pass m; the gradient is rounded once
    more (max_g); a bfloat16 reduction rounds the summed gradient again
    (max_g after the mean). Doubled, for slack."""
    u32, ubf = 2.0 ** -24, 2.0 ** -8
    accum = cfg["accum"]
    per_pass = (4 + world - 1 + 2 + 1) * u32 * max_g
    tol = STEPS * (LR * accum * per_pass + 2 * u32 * max_p)
    if cfg["compute"] == BF16:
        mult = sum((world + 1) / 2 + m for m in range(accum))
        rounds = 2 if cfg["reduce"] == BF16 else 1
        tol = tol + STEPS * LR * (mult * max_p + accum * rounds * max_g) * ubf
    return 2 * tol


# ---------------------------------------------------------------------------
# the tests


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_engine_driver_matches_unit_and_float64(driver, dist_pool, tmp_path, config, world):
    cfg = CONFIGS[config]
    optim = cfg["strategy"] == _C.SHARD_OPTIM
    no_shard = cfg["strategy"] == _C.NO_SHARD

    engine = run_driver(driver, cfg, world, tmp_path)
    python = dist_pool(world).run(_py_train, cfg, new_shm_name(), timeout=60)

    # 1. The C driver and flatshard._C.Unit: the same bytes, events and collectives.
    for r in range(world):
        raw, summary = engine[r]
        py_raw, py_actions, py_counts = python[r]
        assert summary["actions"] == py_actions, f"rank {r}: the state machine's actions differ"
        assert all(summary[k] == py_counts[k] for k in ("all_gather", "reduce")), r
        if raw != py_raw:
            d_sh, d_full = split_output(raw, cfg, world)
            p_sh, p_full = split_output(py_raw, cfg, world)
            diffs = [f"group {g} {kind}: {int(np.sum(a != b))} elements differ, max "
                     f"|diff| {np.abs(a.astype(np.float64) - b).max():.3g}"
                     for kind, da, pa in (("shard", d_sh, p_sh), ("full", d_full, p_full))
                     for g, (a, b) in enumerate(zip(da, pa)) if a.tobytes() != b.tobytes()]
            pytest.fail(f"rank {r}: the driver and _C.Unit wrote different bytes: "
                        + "; ".join(diffs))
        # the host table: no handle held on the host (nothing is deferred)
        assert summary["held"] == 0
        # every collective went through the ledger
        assert summary["ledger"] == summary["all_gather"] + summary["reduce"]

    # 2. Shards and gathers agree with one another, and the padding stays zero.
    out = [split_output(raw, cfg, world) for raw, _ in engine]
    ref = reference(cfg, world)
    lw = layout_world(cfg, world)
    for g, numels in enumerate(GROUPS):
        full = out[0][1][g]
        for r in range(world):
            assert out[r][1][g].tobytes() == full.tobytes(), f"group {g}: rank {r} gathered " \
                "other bytes than rank 0"
            sn = out[r][0][g].shape[0]
            mine = full if no_shard else full[r * sn:(r + 1) * sn]
            assert out[r][0][g].tobytes() == mine.tobytes(), f"group {g}: rank {r}'s shard " \
                "is not its slice of the gathered buffer"
        _, mask = init_flat(g, numels, lw)
        assert (full[~mask] == 0).all() and not np.signbit(full[~mask]).any(), \
            f"group {g}: the padding is not zero"
        assert np.isfinite(full).all()

        # 3. float64.
        want, tol = ref[g]
        err = np.abs(full.astype(np.float64) - want)
        bad = np.flatnonzero(err > tol)
        assert bad.size == 0, (f"group {g}: |engine - float64| beyond the bound at "
                               f"{bad.size} elements, e.g. [{bad[0]}]: {err[bad[0]]:.3g} > "
                               f"{tol[bad[0]]:.3g}")
        # The bound does not hide the training: the parameters moved far more.
        init, _ = init_flat(g, numels, lw)
        moved = np.abs(want - init)
        assert moved.max() > 10 * tol.max(), (moved.max(), tol.max())

    # 4. What the engine did, per step (both paths agreed on it above).
    acts = engine[0][1]["actions"]
    per_pass = 3 + len(GROUPS) + 1
    assert len(acts) == STEPS * cfg["accum"] * per_pass
    post_forward = acts[1]
    if cfg["strategy"] == _C.FULL_SHARD:
        assert post_forward & _C.ACT_RESHARD  # ZeRO-3 frees after forward
    if no_shard and cfg["compute"] == F32:  # never sharded: nothing to move
        assert all(a & (_C.ACT_UNSHARD | _C.ACT_RESHARD) == 0 for a in acts)
    if optim:  # kept whole: never freed (an unshard request finds it live)
        assert all(a & _C.ACT_RESHARD == 0 for a in acts)
    assert all(a & _C.ACT_REDUCE_GRAD for a in acts[3:3 + len(GROUPS)])


@pytest.mark.parametrize("config", ["full_shard-bf16-accum", "shard_grad_op-accum",
                                    "full_shard-bf16-bf16reduce"])
def test_engine_driver_coalesced_collectives_change_no_byte(driver, tmp_path, config):
    """coalesce=1: each event's gathers of the unit's groups in one all-gather
    ([Note: coalesced gathers]) and every reduction of a backward in one
    bucket flushed at FINALIZE ([Note: reduction buckets]), all in C: the
    same bytes and events as one collective per group, and fewer collectives
    in the ledger. The bucket holds the gradients until the flush (held), and
    gives every one back (the driver checks)."""
    cfg = CONFIGS[config]
    plain = run_driver(driver, cfg, 2, tmp_path)
    coalesced = run_driver(driver, dict(cfg, coalesce=True), 2, tmp_path)
    passes, groups = STEPS * cfg["accum"], len(GROUPS)
    for (raw, summary), (raw_c, summary_c) in zip(plain, coalesced):
        assert raw_c == raw, "coalescing changed the bytes"
        assert summary_c["actions"] == summary["actions"]
        # the engine counts each group's collective either way
        assert {k: summary_c[k] for k in ("all_gather", "reduce")} == \
            {k: summary[k] for k in ("all_gather", "reduce")}
        # each gather event's groups become one all-gather (the final
        # full-precision gather is not an event), each pass's reductions one
        # reduce-scatter
        in_events = summary["all_gather"] - groups
        events = in_events // groups
        saved = (in_events - events) + (groups - 1) * passes
        assert summary["ledger"] - summary_c["ledger"] == saved, (summary, summary_c)
        assert summary_c["held"] > 0 and summary["held"] == 0
