"""overlap_offload: the offloaded optimizer step pipelined with backward and
the next forward (python/flatshard/offload_pipeline.py,
csrc/engine/offload_pipe.c), on the host-emulated device path (a
Comm(kind='device') over the host table, test_device_path.py's) and on
the host path.

The reference is today's sequential step on the same path: backward,
(clip,) flatshard.optim.AdamW.step(). The pipelined step runs the same C
kernel on the same buffers with the same counts, only on another thread
and earlier, so parameters, optimizer state and losses must agree to the
bit, for both APIs, with gradient accumulation, clipping, and a checkpoint
(state dict save and load) between steps. The engine's own counts show
that steps did run on its thread, bounded, and that gathers waited."""
import io

import pytest
import torch
import torch.distributed as dist

import flatshard
import flatshard.fsdp.groups as fgroups
import flatshard.fsdp2.mesh as fmesh
from flatshard import FSDP, CPUOffload, CPUOffloadPolicy, ShardingStrategy
from flatshard.optim import AdamW
from flatshard.runtime.device import host_device_comm
from toy_models import Block, build

STEPS = 4


def _maker(on):
    """What makes a device Comm over a host one: the host table's (True), or
    _C_cuda's CUDA table built for the host with its lazy streams and the
    NCCL backend over shared memory ("cuda_emu", test_cuda_emulated_path.py)."""
    if on == "cuda_emu":
        import test_cuda_emulated_path as emu
        return emu._device_comm
    return lambda group, host: host_device_comm(host)


class _Patched:
    """fsdp/groups.py's or fsdp2/mesh.py's comm_for made to hand out device
    Comms (one per host Comm; _maker(on)), or left alone (on False)."""

    def __init__(self, module, on):
        self.module, self.on = module, on

    def __enter__(self):
        self.saved = self.module.comm_for
        if self.on:
            made, saved, make = {}, self.saved, _maker(self.on)

            def comm_for(group, backend, device=None):
                host = saved(group, backend, device)
                if id(host) not in made:
                    made[id(host)] = (host, make(group, host))
                return made[id(host)][1]
            self.module.comm_for = comm_for
        return self

    def __exit__(self, *exc):
        self.module.comm_for = self.saved


def _build(api, device, strategy="FULL_SHARD", use_orig=False, raf=True, prefetch=False,
           bf16=False):
    torch.manual_seed(0)
    model = build()
    if api == "fsdp":
        mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16,
                                      buffer_dtype=torch.bfloat16) if bf16 else None
        with _Patched(fgroups, device):
            return FSDP(model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                        device_id=torch.device("cpu"), forward_prefetch=prefetch,
                        mixed_precision=mp,
                        sharding_strategy=ShardingStrategy[strategy],
                        cpu_offload=CPUOffload(offload_params=True), use_orig_params=use_orig)
    with _Patched(fmesh, device):
        mods = list(model.blocks) + [model.head]
        kw = dict(offload_policy=CPUOffloadPolicy(), reshard_after_forward=raf)
        if bf16:
            kw["mp_policy"] = flatshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                             reduce_dtype=torch.float32)
        for b in mods:
            flatshard.fully_shard(b, **kw)
        flatshard.fully_shard(model, **kw)
    if prefetch:  # a prefetched gather waits for its unit's step too
        for a, b in zip(mods, mods[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    return model


def _no_sync(model, api, on):
    if api == "fsdp":
        return model.no_sync() if on else _Nothing()
    model.set_requires_gradient_sync(not on)
    return _Nothing()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _clip(model, api, max_norm):
    if api == "fsdp":
        return model.clip_grad_norm_(max_norm)
    return torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None],
                                          max_norm)


def _train(api, device, pipelined, *, micro=1, max_norm=None, checkpoint=False, units=2,
           strategy="FULL_SHARD", use_orig=False, raf=True, prefetch=False, bf16=False):
    model = _build(api, device, strategy, use_orig, raf, prefetch, bf16)
    opt = AdamW(model.parameters(), lr=0.02, weight_decay=0.05, threads=1)
    pipe = flatshard.overlap_offload(model, opt, flatshard.OverlapOffload(
        max_units_in_flight=units, max_norm=max_norm)) if pipelined else None
    g = torch.Generator().manual_seed(dist.get_rank())
    losses, norms = [], []
    for step in range(STEPS):
        for i in range(micro):
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            with _no_sync(model, api, i < micro - 1):
                loss = ((model(x).float() - y) ** 2).mean()
                loss.backward()
            losses.append(loss.item())
        if api != "fsdp":
            model.set_requires_gradient_sync(True)
        if max_norm is not None and pipe is None:
            norms.append(float(_clip(model, api, max_norm)))
        opt.step()
        if pipe is not None and max_norm is not None:
            norms.append(float(pipe.last_norm))
        opt.zero_grad()
        if checkpoint and step == 1:
            _round_trip(model, opt)
    if pipe is not None:
        pipe.wait()
    stats = pipe.stats() if pipe is not None else None
    return losses, norms, _final(model, api, opt), stats


def _round_trip(model, opt):
    """A checkpoint between steps: model and optimizer state saved (bytes),
    loaded back, training goes on from it."""
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])


def _final(model, api, opt):
    if api == "fsdp":
        with FSDP.summon_full_params(model):
            params = [p.detach().clone() for p in model.parameters()]
    else:
        params = [p.full_tensor().clone() for p in model.parameters()]
    state = [(float(s["step"]), s["exp_avg"].clone(), s["exp_avg_sq"].clone())
             for s in (opt.state[p] for p in model.parameters()) if s]
    return params, state


def _both(api, device, **kw):
    seq = _train(api, device, False, **kw)
    pip = _train(api, device, True, **kw)
    (pa, sa), (pb, sb) = seq[2], pip[2]
    same = seq[0] == pip[0] and seq[1] == pip[1] and len(pa) == len(pb) and \
        all(torch.equal(a, b) for a, b in zip(pa, pb)) and len(sa) == len(sb) and \
        all(x[0] == y[0] and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])
            for x, y in zip(sa, sb))
    return same, seq[0], pip[3], len(sa), kw.get("max_norm") is not None


CASES = {
    "plain": dict(),
    "accumulate": dict(micro=2),
    "clip": dict(max_norm=0.05),
    "checkpoint": dict(checkpoint=True),
    "one_unit_in_flight": dict(units=1),
    "clip_accumulate_checkpoint": dict(micro=2, max_norm=0.05, checkpoint=True),
}


@pytest.mark.parametrize("api", ["fsdp", "fully_shard"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pipelined_step_matches_the_sequential_one_to_the_bit(dist_pool, api, case):
    for same, losses, stats, nstate, clipped in dist_pool(2).run(_both, api, True,
                                                                 **CASES[case]):
        assert same
        assert nstate > 0
        assert stats["steps_run"] == stats["queued_at_landing"] + stats["queued_at_step"] > 0
        assert stats["units_in_flight"] == 0
        # the bound holds while backward runs; the norm pass queues every unit
        assert 1 <= stats["peak_units_in_flight"]
        assert clipped or stats["peak_units_in_flight"] <= stats["max_units"]
        # without clipping every step starts at its gradient's landing, in
        # backward; with it, none starts before the norm pass
        assert stats["queued_at_landing" if clipped else "queued_at_step"] == 0


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("api", ["fsdp", "fully_shard"])
def test_other_world_sizes_and_the_host_path(dist_pool, world, api):
    for same, *_ in dist_pool(world).run(_both, api, True, micro=2, max_norm=0.05):
        assert same
    if world == 3:
        for same, *_ in dist_pool(world).run(_both, api, False):
            assert same


@pytest.mark.parametrize("api", ["fsdp", "fully_shard"])
def test_through_the_cuda_table_with_lazy_streams(dist_pool, api):
    """The CUDA table built for the host (tests/cuda_emu): its streams run
    their work only when waited for, so a step that read a gradient before
    its copy to host memory landed would read stale bytes and the bits would
    differ from the sequential step's."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parent / "cuda_emu"))
    import emu_build
    if not emu_build.available():
        pytest.skip("needs gcc/g++ and the csrc/ sources")
    emu_build.load()  # built once, here, before the ranks load it
    for same, *_ in dist_pool(2).run(_both, api, "cuda_emu", micro=2, max_norm=0.05,
                                     checkpoint=True):
        assert same
    for same, *_ in dist_pool(2).run(_both, api, "cuda_emu"):
        assert same


def test_fully_shard_variants(dist_pool):
    for kw in (dict(raf=False), dict(raf=2), dict(prefetch=True, max_norm=0.05),
               dict(prefetch=True), dict(bf16=True, micro=2, max_norm=0.05)):
        for same, *_ in dist_pool(2).run(_both, "fully_shard", True, **kw):
            assert same, kw


def test_wrapper_variants(dist_pool):
    for kw in (dict(strategy="SHARD_GRAD_OP"), dict(use_orig=True),
               dict(use_orig=True, max_norm=0.05), dict(prefetch=True),
               dict(bf16=True, micro=2, max_norm=0.05)):
        for same, *_ in dist_pool(2).run(_both, "fsdp", True, **kw):
            assert same, kw


# ---------------------------------------------------------------------------
# the engine's pipe on its own: the scalar reference is _C.adam_steps

def _adam_buffers(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g), torch.randn(n, generator=g),
            torch.zeros(n), torch.zeros(n), torch.tensor(0.0)]


def _job(b):
    return (b[0].data_ptr(), b[1].data_ptr(), b[2].data_ptr(), b[3].data_ptr(), 0,
            b[4].data_ptr(), b[0].numel())


@pytest.mark.parametrize("max_units", [1, 2, 5])
def test_the_pipe_gives_adam_steps_bits_and_keeps_its_bound(max_units):
    from flatshard import _C
    sizes = [0, 1, 7, 15, 17, 1031, 4099]  # awkward sizes, SIMD width +- 1
    hp = dict(lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decoupled=True,
              maximize=False)
    ref = [_adam_buffers(n, i) for i, n in enumerate(sizes)]
    got = [[t.clone() for t in b] for b in ref]
    pipe = _C.OffloadPipe(max_units, len(sizes))
    for step in range(3):
        for i, b in enumerate(ref):
            _C.adam_steps([_job(b)], **hp)
        for i, b in enumerate(got):  # slot i: the step counts move at submit
            pipe.submit(i, [_job(b)], **hp)
            assert float(b[4]) == step + 1
            assert pipe.stats()["units_in_flight"] <= max_units
        pipe.wait(-1)
    st = pipe.stats()
    assert st["steps_run"] == 3 * len(sizes) and st["units_in_flight"] == 0
    assert st["peak_units_in_flight"] <= max_units and st["grad_bytes_in_flight"] == 0
    assert st["peak_grad_bytes_in_flight"] <= 4 * sum(sorted(sizes)[-max_units:])
    for a, b in zip(ref, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    pipe.close()
    with pytest.raises(ValueError, match="closed"):
        pipe.wait()


def _stress(rounds):
    """Many tiny steps through a bound of one unit, each submit and wait
    racing the worker's finish (a missed wake-up hangs here)."""
    from flatshard import _C
    bufs = [_adam_buffers(n, n) for n in (1, 3, 5)]
    pipe = _C.OffloadPipe(1, 3)
    for r in range(rounds):
        for i, b in enumerate(bufs):
            pipe.submit(i, [_job(b)], lr=0.01)
        pipe.wait(r % 3) if r % 2 else pipe.wait()
    pipe.wait()
    st = pipe.stats()
    pipe.close()
    return st["steps_run"], [float(b[4]) for b in bufs]


def test_the_pipe_never_misses_a_finish(dist_pool):
    for steps_run, counts in dist_pool(1).run(_stress, 3000, timeout=60):
        assert steps_run == 9000 and counts == [3000.0] * 3


def test_the_pipe_refuses_bad_arguments_by_name():
    from flatshard import _C
    with pytest.raises(ValueError, match="max_units"):
        _C.OffloadPipe(0, 3)
    pipe = _C.OffloadPipe(1, 2)
    b = _adam_buffers(8, 0)
    with pytest.raises(ValueError, match="slot=2"):
        pipe.submit(2, [_job(b)])
    with pytest.raises(ValueError, match="job 0"):
        pipe.submit(0, [(*_job(b)[:5], 0, 8)])  # no step count
    with pytest.raises(TypeError, match="Unit or ShardGroup"):
        pipe.attach(0, object())
    pipe.close()


# ---------------------------------------------------------------------------
# what is refused, and the accounting

def _refusals(api):
    out = []

    def expect(fn, *words):
        try:
            fn()
        except (flatshard.ConfigError, flatshard.ConfigTypeError, flatshard.NotBuiltError) as e:
            out.append(all(w in str(e) for w in words) or str(e))
            return
        out.append(f"nothing raised for {words}")

    model = _build(api, True)
    expect(lambda: flatshard.overlap_offload(model, torch.optim.AdamW(model.parameters())),
           "optimizer", "flatshard.optim.AdamW")
    expect(lambda: flatshard.overlap_offload(model, AdamW(list(model.parameters())[:2])),
           "optimizer", "exactly")
    expect(lambda: flatshard.OverlapOffload(max_units_in_flight=0), "max_units_in_flight")
    expect(lambda: flatshard.OverlapOffload(max_norm=-1.0), "max_norm")
    opt = AdamW(model.parameters(), lr=0.02)
    pipe = flatshard.overlap_offload(model, opt)
    expect(lambda: flatshard.overlap_offload(model, AdamW(model.parameters())), "already")
    x = torch.randn(4, 5)
    model(x).sum().backward()
    if api == "fsdp":
        expect(lambda: model.clip_grad_norm_(1.0), "clip_grad_norm_", "max_norm")
    # a second synced backward before the step would step twice
    expect(lambda: model(x).sum().backward(), "no_sync", "accumulated")
    pipe.close()
    if api == "fsdp":
        torch.manual_seed(0)
        with _Patched(fgroups, True):
            plain = FSDP(build(), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                         device_id=torch.device("cpu"))
        expect(lambda: flatshard.overlap_offload(plain, AdamW(plain.parameters())),
               "CPUOffload(offload_params=True)")
        ns = _build(api, False, strategy="NO_SHARD")
        expect(lambda: flatshard.overlap_offload(ns, AdamW(ns.parameters())), "NO_SHARD",
               "FULL_SHARD")
    return out


@pytest.mark.parametrize("api", ["fsdp", "fully_shard"])
def test_refusals_name_the_option(dist_pool, api):
    for out in dist_pool(2).run(_refusals, api):
        assert out and all(o is True for o in out), out


def _accounting(api):
    model = _build(api, True)
    opt = AdamW(model.parameters(), lr=0.02, threads=1)
    pipe = flatshard.overlap_offload(model, opt, flatshard.OverlapOffload(max_units_in_flight=2))
    x = torch.randn(4, 5)
    before = flatshard.memory_stats(model, opt)["offload_in_flight"]
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()  # the queued steps keep what they read
    held = sum(t.untyped_storage().nbytes() for t in pipe.held_grads())
    during = flatshard.memory_stats(model, opt)["offload_in_flight"]
    pipe.wait()
    after = flatshard.memory_stats(model, opt)["offload_in_flight"]
    return before, during, held, after, pipe.stats()


@pytest.mark.parametrize("api", ["fsdp", "fully_shard"])
def test_memory_stats_count_the_gradients_of_queued_steps(dist_pool, api):
    for before, during, held, after, stats in dist_pool(2).run(_accounting, api):
        assert before == 0 and after == 0
        assert during == held  # whatever the worker had not reached yet, exactly
        assert stats["peak_grad_bytes_in_flight"] > 0


def test_the_planner_adds_the_units_in_flight():
    from flatshard.plan import plan
    base = plan(params=10_000_000, units=5, world_size=4, offload_params=True)
    for k in (1, 2, 5):
        p = plan(params=10_000_000, units=5, world_size=4, offload_params=True,
                 offload_pipeline=k)
        line = next(ln for ln in p.lines if ln.key == "offload_in_flight")
        grads = next(ln for ln in base.lines if ln.key == "grads").bytes
        assert line.where == "host" and line.bytes * 5 == grads * k  # 5 equal units
        assert p.total("device") == base.total("device")  # nothing more on the device
        assert p.total("host") == base.total("host") + line.bytes
    with pytest.raises(flatshard.ConfigError, match="offload_pipeline"):
        plan(params=1e6, offload_pipeline=2)  # needs offload_params=True


def _predicted(k):
    from flatshard.plan import predict
    model = _build("fsdp", True)
    opt = AdamW(model.parameters(), lr=0.02)
    flatshard.overlap_offload(model, opt, flatshard.OverlapOffload(max_units_in_flight=k))
    p = predict(model, opt)
    units = [sum(g.shard.numel() * 4 for g in m._unit.groups)
             for m in model.modules() if isinstance(m, FSDP)]
    return p["offload_in_flight"], sum(sorted(units)[-k:])


def test_the_planner_reads_the_units_in_flight_from_a_wrapped_model(dist_pool):
    for line, want in dist_pool(2).run(_predicted, 2):
        assert line == want > 0


def test_the_plan_command_takes_the_units_in_flight(capsys):
    from flatshard.__main__ import main
    from flatshard.plan import plan
    main(["plan", "--params", "7e9", "--world", "8", "--offload", "params",
          "--offload-pipeline", "2", "--strategy", "FULL_SHARD"])
    out = capsys.readouterr().out
    want = plan(params=7e9, world_size=8, offload_params=True, offload_pipeline=2,
                strategy="FULL_SHARD", comm_backend="nccl")["offload_in_flight"]
    row = next(ln for ln in out.splitlines() if ln.startswith("gradients of queued steps"))
    assert want > 0 and f"{want / 2**30:.2f}" in row
    with pytest.raises(SystemExit, match="--offload params"):
        main(["plan", "--params", "7e9", "--offload-pipeline", "2"])
