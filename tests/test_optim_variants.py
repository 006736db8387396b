"""Variants of the fused CPU optimizer loop (csrc/optim/optim_cpu.c) and their
run-time choice (csrc/optim/optim_tune.c, the cache file of optim_cache.c):
every variant, forced by name, against the scalar reference variant, bit for
bit (one formula with FMA on every path: [Note: one formula]; the float64
bound is tests/test_optim_ulp.py), on awkward sizes and unaligned views; the
bf16 copy's rounding on every path (integer arithmetic, and vcvtneps2bf16
where the CPU has AVX512_BF16) on the values where roundings differ; the
tuned step against the reference; what tuning records; the cache file
reused by a second process, and ignored when it is unreadable or malformed."""
import itertools
import os
import subprocess
import sys

import pytest
import torch

from flatshard import _C, optim as fo
from flatshard.tensors import dtype_code

REFERENCE = "scalar.u1.pf0.st.t1.c0"
LEVELS = ["scalar", "avx2", "avx512"][:["scalar", "avx2", "avx512"].index(_C.simd_level()) + 1]


def _cpu_runs(simd):
    """Whether variants may name this simd level here (avx512bf16: the CPU
    has AVX512_BF16; a level the CPU lacks is refused by name)."""
    p = torch.zeros(0)
    try:
        fo.adamw_step_(p, p, p, p, 1, lr=0.1, variant=f"{simd}.u1.pf0.st.t1.c0")
    except ValueError:
        return False
    return True


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


# AVX-512 with the bf16 copy rounded by vcvtneps2bf16: where the CPU has it
BF16_INSN = _cpu_runs("avx512bf16")
if BF16_INSN:
    LEVELS.append("avx512bf16")
# Each field of a variant at each of its kinds of value: SIMD level, unroll,
# prefetch (none, one line, a page ahead), copy stores, and threads (started
# for the step, or the process's OpenMP team) with contiguous slices or with
# 32-element chunks claimed in turn.
VARIANTS = [f"{s}.u{u}.pf{pf}.{st}.{t}.c{c}" for s, u, pf, st, (t, c) in itertools.product(
    LEVELS, (1, 2, 4), (0, 64, 4096), ("st", "nt"),
    (("t1", 0), ("t3", 0), ("t3", 32), ("omp3", 0), ("omp3", 32)))]
SIZES = [0, 1, 15, 16, 17, 33, 63, 65, 97, 1031]


def _views(n, seed, offset):
    """Buffers of n elements starting `offset` elements into their storage,
    so that vector loads and streaming-store peels meet unaligned addresses."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n + offset, generator=g)[offset:] for _ in range(4)] + \
        [torch.rand(n + offset, generator=g)[offset:]]


def _adam(n, variant, offset, copy, decoupled, maximize, amsgrad, threads=3, steps=3):
    p, grad, m, mx, v = _views(n, n + offset, offset)
    mx = mx.abs() if amsgrad else None
    out = torch.empty(n + offset, dtype=copy)[offset:] if copy else None
    for step in range(1, steps + 1):
        fo.adamw_step_(p, grad, m, v, step, lr=0.01, betas=(0.8, 0.95), eps=1e-6,
                       weight_decay=0.1, decoupled=decoupled, maximize=maximize,
                       max_exp_avg_sq=mx, out_copy=out, threads=threads, variant=variant)
    return [t for t in (p, m, v, mx, out) if t is not None]


def _sgd(n, variant, offset, copy, momentum, nesterov, maximize, threads=3, steps=3):
    g = torch.Generator().manual_seed(n)
    p, grad, buf = (torch.randn(n + offset, generator=g)[offset:] for _ in range(3))
    out = torch.empty(n + offset, dtype=copy)[offset:] if copy else None
    for first in [True] + [False] * (steps - 1):
        _C.sgd_step(p.data_ptr(), grad.data_ptr(), buf.data_ptr() if momentum else 0,
                    out.data_ptr() if copy else 0, dtype_code(copy) if copy else _C.BF16, n,
                    lr=0.05, momentum=momentum, dampening=0.0 if nesterov else 0.1,
                    weight_decay=0.01, nesterov=nesterov, maximize=maximize, first_step=first,
                    threads=threads, variant=variant)
    return [t for t in (p, buf if momentum else None, out) if t is not None]


def _same_bits(got, want):
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.int16) if a.element_size() == 2 else a.view(torch.int32),
                           b.view(torch.int16) if b.element_size() == 2 else b.view(torch.int32))


# (copy, decoupled, maximize, amsgrad): AdamW (the AVX-512 kernel's loop of
# its own) with each copy and without, and the other paths
ADAM_OPTIONS = [(torch.bfloat16, True, False, False), (torch.float16, False, True, True),
                (None, True, False, True), (None, True, False, False),
                (torch.float16, True, False, False)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_adam_variant_gives_the_reference_bits(variant):
    for n, offset, (copy, decoupled, maximize, amsgrad) in itertools.product(
            SIZES, (0, 3), ADAM_OPTIONS):
        want = _adam(n, REFERENCE, offset, copy, decoupled, maximize, amsgrad)
        _same_bits(_adam(n, variant, offset, copy, decoupled, maximize, amsgrad), want)
        if copy:  # the copy is the updated parameter, rounded
            assert torch.equal(want[-1], want[0].to(copy))


SGD_OPTIONS = [(torch.bfloat16, 0.9, False, False), (torch.float16, 0.9, True, True),
               (None, 0.0, False, False)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_sgd_variant_gives_the_reference_bits(variant):
    for n, offset, (copy, momentum, nesterov, maximize) in itertools.product(
            SIZES, (0, 3), SGD_OPTIONS):
        want = _sgd(n, REFERENCE, offset, copy, momentum, nesterov, maximize)
        _same_bits(_sgd(n, variant, offset, copy, momentum, nesterov, maximize), want)
        if copy:
            assert torch.equal(want[-1], want[0].to(copy))


# f32 bit patterns where roundings to bf16 part ways: NaNs (quiet, signalling,
# either sign, with payloads, one whose payload's top bits round up),
# infinities, zeros, subnormals (which vcvtneps2bf16 flushes to zero: the
# kernels round those on integers), the smallest normal, the largest finite
# (rounds to inf) and its neighbours, and ties that round to even both ways.
SPECIAL_F32 = [
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FC12345, 0xFF812345, 0x7FBFFFFF, 0x7FFFFFFF,
    0x7F800000, 0xFF800000, 0x00000000, 0x80000000,
    0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x00007FFF, 0x00400000, 0x807FFFFF,
    0x007FFFFF, 0x007F8000, 0x00800000, 0x80800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF,
    0x7F7F8000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF, 0xBF808000, 0xBF818000]


def _special_params(n, seed, where):
    """n f32 values, mostly ordinary, with SPECIAL_F32 placed so that vectors
    with and without them (and specials in vector heads, tails and the
    scalar tail) all occur."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randn(n, generator=g).view(torch.int32)
    special = torch.tensor(SPECIAL_F32, dtype=torch.int64).to(torch.int32)
    if where == "dense":  # all of them, repeated
        idx = torch.arange(n)
        bits = special[idx % len(special)].clone()
    else:  # a few, scattered: most vectors ordinary
        idx = torch.randperm(n, generator=g)[:min(n, 3 * len(special))]
        bits[idx] = special[torch.arange(len(idx)) % len(special)]
    return bits.view(torch.float32)


@pytest.mark.parametrize("simd", LEVELS)
@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_bf16_copy_rounds_special_values_as_the_reference(simd, kind):
    # A step that leaves the parameters as they are (lr 0, zero gradient and
    # state), so its bf16 copy is the rounding of the chosen bit patterns,
    # through every unroll, store kind and alignment of this level's kernels.
    variants = [REFERENCE] + [f"{simd}.u{u}.pf0.{st}.{t}.c{c}" for u in (1, 2, 4)
                              for st in ("st", "nt") for t, c in (("t1", 0), ("t3", 32))]
    for n, offset, where in itertools.product((1031, 4096 + 77), (0, 3, 16), ("dense", "sparse")):
        outs = []
        for variant in variants:
            p = torch.empty(n + offset)[offset:]
            p.copy_(_special_params(n, n + offset, where))
            zero = torch.zeros(n)
            out = torch.full((n + offset,), 0x5555, dtype=torch.int16)[offset:].view(
                torch.bfloat16)
            if kind == "adam":
                fo.adamw_step_(p, zero, zero.clone(), zero.clone(), 1, lr=0.0, weight_decay=0.1,
                               out_copy=out, threads=3, variant=variant)
            else:
                _C.sgd_step(p.data_ptr(), zero.data_ptr(), 0, out.data_ptr(), _C.BF16, n, lr=0.0,
                            momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False,
                            maximize=False, first_step=True, threads=3, variant=variant)
            outs.append((p.view(torch.int32).clone(), out.view(torch.int16).clone()))
        want_p, want = outs[0]
        # The step leaves every value as it was (arithmetic quiets a
        # signalling NaN), and the reference copy is torch's rounding of it
        # but for NaNs, which keep their sign and payload's top bits, quiet.
        src = _special_params(n, n + offset, where)
        nan = torch.isnan(src)
        assert torch.equal(want_p[~nan], src.view(torch.int32)[~nan])
        assert torch.equal(want_p[nan], src.view(torch.int32)[nan] | 0x400000)
        assert torch.equal(want[~nan], src.to(torch.bfloat16).view(torch.int16)[~nan])
        assert torch.equal(want[nan].to(torch.int32) & 0xFFFF, (want_p[nan] >> 16) & 0xFFFF)
        for variant, (got_p, got) in zip(variants[1:], outs[1:]):
            assert torch.equal(got_p, want_p), variant
            assert torch.equal(got, want), (variant, n, offset, where)


def test_bf16_instruction_is_used_where_the_cpu_has_it():
    # avx512bf16 variants are refused by name on a CPU without AVX512_BF16
    # (or AVX512DQ) and accepted on one with it; the tuned bf16-copy step
    # starts from them there.
    flags = _cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags")
    assert BF16_INSN == ({"avx512f", "avx512bw", "avx512dq", "avx512_bf16"} <= flags)
    if not BF16_INSN:
        p = torch.zeros(4)
        with pytest.raises(ValueError, match="variant="):
            fo.adamw_step_(p, p.clone(), p.clone(), p.clone(), 1, lr=0.1,
                           variant="avx512bf16.u1.pf0.st.t1.c0")


def _records(kind, n):
    return [r for r in _C.optim_tune_records()
            if r["kind"] == kind and r["size_log2"] == n.bit_length() - 1]


def _winner(stage):
    fastest = min(stage, key=lambda c: c["ns_per_elem"])
    return (fastest if fastest["ns_per_elem"] < stage[0]["ns_per_elem"] * 0.95
            else stage[0])["variant"]


@pytest.fixture
def cache_file(tmp_path, monkeypatch):
    """A cache file of this test's own, and no choice in memory."""
    path = tmp_path / "tune" / "optim_tune.txt"
    monkeypatch.setenv("FLATSHARD_OPTIM_TUNE_CACHE", str(path))
    _C.optim_tune_reset()
    yield path
    _C.optim_tune_reset()


@pytest.mark.parametrize("n", [1031, (1 << 20) + 13])
def test_tuned_step_gives_the_reference_bits_and_records_its_choice(n, cache_file):
    # A small class is measured on scratch buffers before its first step
    # (the step itself runs once, with the winner); a class of 2^16 elements
    # and more on its own first steps, each timed run a slice of a step
    # ([Note: measured on the steps]). 300 steps see it decided whatever the
    # machine does: at most 24 rounds a stage, 4 runs a step in stages 0-2
    # and one in stage 3 here, 198 steps at the very most. Every step gives
    # the reference's bits either way.
    live = n >= 1 << 16
    steps = 300 if live else 3
    for copy in (None, torch.bfloat16):
        want = _adam(n, REFERENCE, 0, copy, True, False, False, steps=steps)
        _same_bits(_adam(n, None, 0, copy, True, False, False, threads=2, steps=steps), want)
    want = _sgd(n, REFERENCE, 0, torch.float16, 0.9, False, False, steps=steps)
    _same_bits(_sgd(n, None, 0, torch.float16, 0.9, False, False, threads=2, steps=steps), want)
    adam, sgd = _records("adam", n), _records("sgd", n)
    assert sorted(r["copy"] for r in adam) == ["bfloat16", "none"] and \
        [r["copy"] for r in sgd] == ["float16"]
    for r in adam + sgd:
        assert r["tuned"] and r["source"] == ("steps" if live else "measured")
        assert r["tuned_numel"] == n and (r["live_steps"] >= 1) == live
        assert r["stored"] and r["tune_s"] > 0
        assert r["threads_max"] == 2 and r["simd_max"] == _C.simd_level()
        names = [c["variant"] for c in r["candidates"]]
        stages = {c["stage"] for c in r["candidates"]}
        # stages 0-2 time the loop on started threads; a split not measured
        # is the default's (the team, where the process has one)
        timed = r["chosen"] if "threads" in stages else r["chosen"].replace(".omp2.", ".t2.")
        assert timed in names and all(c["ns_per_elem"] > 0 for c in r["candidates"])
        assert all(c["rounds"] >= 1 for c in r["candidates"])
        # on a busy machine the split is not measured ([Note: busy machine]);
        # a measurement cut short at its hard stop leaves stages out
        if r["busy"]:
            assert "threads" not in stages
        elif not r["cut_short"]:
            assert "threads" in stages
        if r["copy"] != "none" and _C.simd_level() != "scalar" and not r["cut_short"]:
            assert {"simd/unroll", "prefetch", "copy stores"} <= stages
        # AVX-512 candidates round a bf16 copy with the instruction where the
        # CPU has it, and only a bf16 copy
        simds = {c["variant"].split(".")[0] for c in r["candidates"]}
        assert ("avx512bf16" in simds) == (BF16_INSN and r["copy"] == "bfloat16")
        # each stage starts from the winner of the one before, and the chosen
        # variant wins the last: the fastest, unless within 5% of the stage's
        # first candidate (the incumbent)
        order = list(dict.fromkeys(c["stage"] for c in r["candidates"]))
        by_stage = [[c for c in r["candidates"] if c["stage"] == st] for st in order]
        # (stage 3 sets the split fields, the last two, of every candidate)
        for before, after in zip(by_stage, by_stage[1:]):
            split = after[0]["stage"] == "threads"
            keep = (lambda v: v.rsplit(".", 2)[0]) if split else (lambda v: v)
            assert keep(_winner(before)) in [keep(c["variant"]) for c in after]
        assert _winner(by_stage[-1]) == timed
        # stage 3's incumbent is the default split: all threads, contiguous
        # slices, on the OpenMP team where the process has one
        split = (by_stage[-1][0]["variant"] if "threads" in stages else r["chosen"]).split(".")
        assert split[-2] == ("omp2" if _has_team(cache_file) else "t2") and split[-1] == "c0"


def test_a_class_measured_on_its_steps_gives_the_reference_bits_at_every_step(cache_file):
    # Three parameters of one size class (2^17 up to 2^18 - 1 elements) in one
    # AdamW: each step's timed runs are slices of its parameters, stepped by
    # one candidate or another, the rest by the winner so far; every step's
    # bits are the reference's, and the class is decided, measured on them
    # ([Note: measured on the steps]).
    sizes = [1 << 17, (1 << 17) + 777, (1 << 18) - 1]
    g = torch.Generator().manual_seed(3)
    ps = [torch.randn(n, generator=g) for n in sizes]
    refs = [p.clone() for p in ps]
    state = [(torch.zeros(n), torch.zeros(n)) for n in sizes]
    hp = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    opt = fo.AdamW(ps, **hp, threads=2)
    decided = None
    for step in range(1, 301):  # 3 runs a step, 24 rounds a stage at most: 104 steps
        for p, r in zip(ps, refs):
            p.grad = torch.randn(p.shape, generator=g)
            r.grad = p.grad
        opt.step()
        for r, (m, v) in zip(refs, state):
            fo.adamw_step_(r, r.grad, m, v, step, **hp, variant=REFERENCE)
        _same_bits(ps, refs)
        for k, r in enumerate(refs):
            _same_bits([opt.state[ps[k]]["exp_avg"], opt.state[ps[k]]["exp_avg_sq"]],
                       list(state[k]))
        if _records("adam", 1 << 17):
            decided = step
            break
    assert decided is not None, "the class was not decided in 300 steps"
    r, = _records("adam", 1 << 17)
    # live_steps counts the class's parameter steps: three in each optimizer step
    assert r["source"] == "steps" and 1 <= r["live_steps"] <= 3 * decided and r["stored"]
    assert r["tuned_numel"] == sizes[0] and r["tune_s"] >= 0
    assert " adam 2^17 " in cache_file.read_text()


def _has_team(path):
    """Whether this process runs on an OpenMP team: the cache key says."""
    return " omp=1 " in path.read_text()


def test_whole_step_split_ladder_stays_within_the_candidate_table(cache_file):
    # With many threads the thread ladder stays within the candidate table
    # (here 96 threads on any machine: a thread count is a cap, not a check
    # of the CPU).
    n = 1031
    want = _adam(n, REFERENCE, 0, torch.bfloat16, True, False, False)
    _same_bits(_adam(n, None, 0, torch.bfloat16, True, False, False, threads=96), want)
    rec = [r for r in _records("adam", n) if r["threads_max"] == 96]
    assert len(rec) == 1
    if rec[0]["busy"] or rec[0]["cut_short"]:
        # the default split, also where stages 0-2 timed started threads
        assert rec[0]["chosen"].split(".")[-2] == ("omp96" if _has_team(cache_file) else "t96")
        pytest.skip("the machine is busy: thread splits are not measured now")
    trials = [c["variant"] for c in rec[0]["candidates"] if c["stage"] == "threads"]
    assert len(rec[0]["candidates"]) <= 32 and len(trials) > 1
    simd = _C.simd_level()
    if simd != "scalar":
        head = ("avx512bf16" if BF16_INSN and simd == "avx512" else simd) + "."
        assert all(t.startswith(head) or t.startswith("avx2.") for t in trials), trials
    assert trials[0].split(".")[-2] in ("omp96", "t96") and trials[0].endswith(".c0")
    assert {t.split(".")[-2] for t in trials} >= {"t96", "t48"}


_SECOND = """
import torch
from flatshard import _C, optim as fo
p, g, m, v = (torch.randn(1031) for _ in range(4))
fo.adamw_step_(p, g, m, v, 1, lr=1e-3, threads=2)
r, = [r for r in _C.optim_tune_records() if r["kind"] == "adam" and r["size_log2"] == 10]
print(r["source"], r["chosen"])
"""


def _second_process(path):
    env = dict(os.environ, FLATSHARD_OPTIM_TUNE_CACHE=str(path))
    out = subprocess.run([sys.executable, "-c", _SECOND], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _first_choice(n):
    p, g, m, v = (torch.randn(n) for _ in range(4))
    fo.adamw_step_(p, g, m, v, 1, lr=1e-3, threads=2)
    r, = [r for r in _records("adam", n) if r["copy"] == "none" and r["threads_max"] == 2]
    return r


def _busy():
    return os.getloadavg()[0] > os.cpu_count()


def _as_quiet(path):
    """The file's lines marked as measured on a quiet machine, so that they
    are used whatever the load now ([Note: busy machine])."""
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + [ln[:-1] + "0" for ln in lines[1:]]) + "\n")


def test_a_second_process_reuses_the_stored_choice(cache_file):
    r = _first_choice(1031)
    lines = cache_file.read_text().splitlines()
    assert lines[0] == "flatshard optim tune cache 2"
    assert any(line.endswith(f"\t{r['chosen']}\t{int(r['busy'])}") for line in lines[1:])
    assert [f.name for f in cache_file.parent.iterdir()] == [cache_file.name]  # no temp file
    _as_quiet(cache_file)
    assert _second_process(cache_file) == ["cache", r["chosen"]]
    _C.optim_tune_reset()  # in this process too: from the file, no measuring
    again = _first_choice(1031)
    assert again["source"] == "cache" and again["chosen"] == r["chosen"] and \
        not again["candidates"] and not again["busy"]


def test_a_choice_stored_on_a_busy_machine_is_provisional(cache_file):
    # [Note: busy machine]: used while the machine is busy, measured again
    # (and replaced) when it is not.
    r = _first_choice(1031)
    lines = cache_file.read_text().splitlines()
    cache_file.write_text("\n".join(lines[:1] + [ln[:-1] + "1" for ln in lines[1:]]) + "\n")
    _C.optim_tune_reset()
    busy = _busy()
    again = _first_choice(1031)
    if busy == _busy():  # the load did not cross the line meanwhile
        assert again["source"] == ("cache" if busy else "measured")
        assert again["busy"] or not busy
    assert again["chosen"] == r["chosen"] or again["source"] == "measured"


@pytest.mark.parametrize("content", [
    b"", b"\x80\x81 not text\n" * 10, b"flatshard optim tune cache 0\n",
    b"flatshard optim tune cache 2\nno tab here\n" + b"x" * 5000 + b"\n",
    None])  # None: a line for the class naming a variant that does not parse
def test_a_malformed_cache_file_is_ignored_and_rewritten(cache_file, content):
    cache_file.parent.mkdir(parents=True)
    if content is None:
        _first_choice(1031)  # learn this class's key
        key = cache_file.read_text().splitlines()[1].split("\t")[0]
        content = (f"flatshard optim tune cache 2\n{key}\tavx9.u3.pf0.st.t1.c0\t0\n"
                   f"{key}\tavx2.u1.pf0.st.t1.c0\n").encode()  # the latter: no busy field
        _C.optim_tune_reset()
    cache_file.write_bytes(content)
    r = _first_choice(1031)
    assert r["source"] == "measured" and r["tuned"] and r["stored"]
    lines = cache_file.read_text().splitlines()
    assert lines[0] == "flatshard optim tune cache 2"
    assert lines[-1].endswith(f"\t{r['chosen']}\t{int(r['busy'])}")


def test_a_cache_file_of_the_first_format_is_not_used(cache_file):
    # Format 1 kept busy machines' choices on started threads, which lost to
    # the OpenMP team (benchmarks/results/optim.md, "CPU AdamW on AVX2 (Zen 3)"):
    # its lines are measured again.
    _first_choice(1031)  # learn this class's key
    key = cache_file.read_text().splitlines()[1].split("\t")[0]
    cache_file.write_text(f"flatshard optim tune cache 1\n{key}\tavx2.u1.pf0.st.t2.c0\t1\n")
    _C.optim_tune_reset()
    r = _first_choice(1031)
    assert r["source"] == "measured" and r["stored"]
    assert cache_file.read_text().splitlines()[0] == "flatshard optim tune cache 2"


def test_an_unusable_cache_path_means_no_cache(cache_file):
    cache_file.mkdir(parents=True)  # a folder where the file should be: nothing can be read
    r = _first_choice(1031)
    assert r["source"] == "measured" and r["tuned"] and not r["stored"]
    assert cache_file.is_dir() and list(cache_file.iterdir()) == []


def test_simd_cap_limits_the_candidates():
    _C.optim_tune_reset()
    p = torch.zeros(64)
    for step in range(1, 9):  # the calibrating step, then the thread trial steps
        fo.adamw_step_(p, p.clone(), p.clone(), p.clone(), step, lr=0.1, simd="scalar",
                       threads=1)
    rec = [r for r in _C.optim_tune_records() if r["simd_max"] == "scalar"]
    assert rec and all(c["variant"].startswith("scalar.") for c in rec[0]["candidates"])


@pytest.mark.parametrize("name", ["avx2", "avx2.u3.pf0.st.t1.c0", "avx2.u8.pf0.st.t1.c0",
                                  "avx2.u1.pf0.xx.t1.c0",
                                  "avx2.u1.pf0.st.mp2.c0",
                                  "avx2.u1.pf0.st.t0.c0", "avx2.u1.pf0.st.t1.c17",
                                  "auto.u1.pf0.st.t1.c0", "avx1024.u1.pf0.st.t1.c0",
                                  "avx2.u1.pf0.st.t1.c0 "])
def test_malformed_variant_names_are_refused(name):
    p = torch.zeros(8)
    with pytest.raises(ValueError, match="variant="):
        fo.adamw_step_(p, p.clone(), p.clone(), p.clone(), 1, lr=0.1, variant=name)


def test_doctor_reports_the_measured_choice():
    from flatshard.__main__ import optimizer_tuning_lines
    lines = optimizer_tuning_lines(log2=16)
    text = "\n".join(lines)
    assert "AdamW" in text and "bf16 copy" in text and "SGD" in text
    assert "chosen" in text and "ns/element" in text
