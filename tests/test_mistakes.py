"""Mistakes that train wrong without an error under torch's FSDP, made loud
(python/flatshard/checks/): for each, the mistake made under torch's own
FSDP1 / fully_shard (it trains through it, silently: the reason the check
exists), then under flatshard (the message names the rank, the parameter
or unit and the fix, and quotes docs/troubleshooting.md's entry), then the
correct pattern (no false alarm). 2 gloo ranks on CPU."""
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flatshard
from flatshard import FSDP, ConfigError, ShardingStrategy, fully_shard
from flatshard.errors import (InitDiffersWarning, MistakeWarning, ReplicaDriftWarning,
                              StaleOptimizerError, UnsyncedStepWarning)
from test_diagnostics import assert_documented

TIMEOUT = 240
CPU = torch.device("cpu")


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _flatshard_fully_shard(m, **kw):
    fully_shard(m[0], **kw)
    fully_shard(m, **kw)
    return m


def _torch_fully_shard(m):
    torch_fully_shard(m[0])
    torch_fully_shard(m)
    return m


def _full(model):
    """Every parameter's full value, by name (FSDP1 inside summon, DTensors
    gathered)."""
    out = {}
    for n, p in model.named_parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n] = p.detach().clone()
    return out


def _loss(model, seed):
    torch.manual_seed(100 + seed + dist.get_rank())
    return model(torch.randn(4, 6)).pow(2).sum()


def _mistake_warnings(fn):
    """fn() -> (its result, the MistakeWarnings it raised, as text)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = fn()
    return out, [f"{w.category.__name__}: {w.message}" for w in seen
                 if issubclass(w.category, MistakeWarning)]


# ---------------------------------------------------------------------------
# 1. an optimizer built before wrapping


def _optimizer_before_wrap():
    out = {}
    # torch: both wrappers train through it; the model never changes.
    for name, wrap in (("torch_fsdp1", lambda m: TorchFSDP(m, device_id=CPU)),
                       ("torch_fully_shard", _torch_fully_shard)):
        m = _model()
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        m = wrap(m)

        def train():
            with (m.summon_full_params(m) if name == "torch_fsdp1" else _nothing()):
                before = _full(m)
            for s in range(2):
                _loss(m, s).backward()
                opt.step()
                opt.zero_grad()
            with (m.summon_full_params(m) if name == "torch_fsdp1" else _nothing()):
                after = _full(m)
            return all(torch.equal(before[k], after[k]) for k in before)
        out[name] = _mistake_warnings(train)
    # flatshard: the first step raises, naming the parameters; torch's SGD
    # and flatshard's own optimizers alike, both wrappers.
    for name, wrap, optim in (
            ("fsdp1", lambda m: FSDP(m), torch.optim.SGD),
            ("fsdp1_flatshard_optim", lambda m: FSDP(m), flatshard.optim.SGD),
            ("fully_shard", _flatshard_fully_shard, torch.optim.AdamW)):
        m = _model()
        opt = optim(m.parameters(), lr=0.5)
        m = wrap(m)
        _loss(m, 0).backward()
        try:
            opt.step()
            out[name] = None
        except StaleOptimizerError as e:
            out[name] = f"{type(e).__name__}: {e}"
    # the correct order: no error, and the model changes
    for name, wrap in (("fsdp1_after", lambda m: FSDP(m)),
                       ("fully_shard_after", _flatshard_fully_shard)):
        m = wrap(_model())
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        _loss(m, 0).backward()
        out[name] = _mistake_warnings(lambda: opt.step())[1]
    # use_orig_params=True keeps the original parameters: nothing was replaced
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    m = FSDP(m, use_orig_params=True)
    _loss(m, 0).backward()
    out["orig_params"] = _mistake_warnings(lambda: opt.step())[1]
    return out


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_an_optimizer_built_before_wrapping(dist_pool):
    for rank, out in enumerate(dist_pool(2).run(_optimizer_before_wrap, timeout=TIMEOUT)):
        for name in ("torch_fsdp1", "torch_fully_shard"):
            unchanged, warned = out[name]
            assert unchanged and warned == [], (name, out[name])  # torch: silent, trains nothing
        for name in ("fsdp1", "fsdp1_flatshard_optim", "fully_shard"):
            msg = out[name]
            assert msg is not None, name
            assert f"rank {rank}:" in msg and "all parameters it holds" in msg, msg
            assert "0.weight" in msg and "build it after" in msg, msg
            assert "An optimizer built before wrapping" in msg, msg
        assert "FullyShardedDataParallel replaced" in out["fsdp1"]
        assert "fully_shard replaced" in out["fully_shard"]
        assert out["fsdp1_after"] == out["fully_shard_after"] == out["orig_params"] == []
        if rank == 0:
            assert_documented("optimizer-before-wrap", out["fsdp1"])


# ---------------------------------------------------------------------------
# 2. ranks that start from different weights


def _different_init():
    rank = dist.get_rank()
    out = {}
    # torch: wraps and trains a patchwork of the ranks' weights, silently.
    m = _model(seed=rank)
    mine = {k: v.clone() for k, v in _model(seed=rank).state_dict().items()}
    fsdp, warned = _mistake_warnings(lambda: TorchFSDP(m, device_id=CPU))
    with fsdp.summon_full_params(fsdp):
        full = {k.replace("_fsdp_wrapped_module.", ""): v.detach().clone()
                for k, v in fsdp.named_parameters()}
    out["torch"] = (warned, any(not torch.equal(full[k], mine[k]) for k in mine))
    # flatshard: both wrappers warn, naming the first parameter and the ranks
    out["fsdp1"] = _mistake_warnings(lambda: FSDP(_model(seed=rank)))[1]
    out["fully_shard"] = _mistake_warnings(
        lambda: _flatshard_fully_shard(_model(seed=rank)))[1]
    # no false alarm: the same seed; sync_module_states; a meta-device model
    # materialized by reset_parameters() (excluded); the check turned off
    out["same_seed"] = _mistake_warnings(lambda: FSDP(_model(seed=3)))[1]
    out["same_seed_fully_shard"] = _mistake_warnings(
        lambda: _flatshard_fully_shard(_model(seed=3)))[1]
    out["synced"] = _mistake_warnings(
        lambda: FSDP(_model(seed=rank), sync_module_states=True))[1]

    def meta():
        torch.manual_seed(rank)
        with torch.device("meta"):
            m = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
        return FSDP(m, device_id=CPU)
    out["meta"] = _mistake_warnings(meta)[1]
    os.environ["FLATSHARD_CHECK_INIT"] = "0"
    try:
        out["off"] = _mistake_warnings(lambda: FSDP(_model(seed=rank)))[1]
    finally:
        del os.environ["FLATSHARD_CHECK_INIT"]
    return out


def test_ranks_that_start_from_different_weights(dist_pool):
    for rank, out in enumerate(dist_pool(2).run(_different_init, timeout=TIMEOUT)):
        warned, patchwork = out["torch"]
        assert warned == [] and patchwork, out["torch"]
        # one warning per wrap: FSDP(model), fully_shard(model[0]) then (model)
        for name, param, n in (("fsdp1", "parameter 0.weight ", 1),
                               ("fully_shard", "parameter weight (of Linear) ", 2)):
            assert len(out[name]) == n, out[name]
            msg = out[name][0]
            assert msg.startswith("InitDiffersWarning"), msg
            assert f"rank {rank}:" in msg and param in msg, msg
            assert "differs between rank 0 and rank 1" in msg, msg
            assert "4 parameters in all differ" in msg or name == "fully_shard", msg
            assert "sync_module_states=True" in msg and "FLATSHARD_CHECK_INIT=0" in msg, msg
        for name in ("same_seed", "same_seed_fully_shard", "synced", "meta", "off"):
            assert out[name] == [], (name, out[name])
        if rank == 0:
            assert_documented("init-differs", out["fsdp1"][0])


# ---------------------------------------------------------------------------
# 4. a step on gradients that were never reduced


def _unsynced():
    out = {}
    # torch's fully_shard: every micro-batch without sync, then step: the
    # sharded gradients are never set and the step changes nothing, silently.
    m = _torch_fully_shard(_model())
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    before = _full(m)

    def torch_steps():
        m.set_requires_gradient_sync(False)
        for s in range(2):
            _loss(m, s).backward()
        opt.step()
    out["torch"] = (_mistake_warnings(torch_steps)[1],
                    all(torch.equal(before[k], v) for k, v in _full(m).items()))

    def fsdp1(last_synced):
        m = FSDP(_model(), auto_wrap_policy=flatshard.ModuleWrapPolicy({nn.Linear}))
        opt = torch.optim.SGD(m.parameters(), lr=0.5)

        def steps():
            for step in range(2):
                with m.no_sync():
                    _loss(m, 0).backward()
                if last_synced:
                    _loss(m, 1).backward()
                else:
                    with m.no_sync():
                        _loss(m, 1).backward()
                opt.step()
                opt.zero_grad()
        return _mistake_warnings(steps)[1]

    def fsdp2(last_synced):
        m = _flatshard_fully_shard(_model())
        opt = torch.optim.SGD(m.parameters(), lr=0.5)

        def steps():
            m.set_requires_gradient_sync(False)
            _loss(m, 0).backward()
            m.set_requires_gradient_sync(last_synced)
            _loss(m, 1).backward()
            opt.step()
        return _mistake_warnings(steps)[1]

    out["fsdp1"], out["fsdp1_ok"] = fsdp1(False), fsdp1(True)
    out["fully_shard"], out["fully_shard_ok"] = fsdp2(False), fsdp2(True)
    # another optimizer, of another model, steps while this one accumulates
    m = _flatshard_fully_shard(_model())
    other = _flatshard_fully_shard(_model())
    opt_other = torch.optim.SGD(other.parameters(), lr=0.5)
    m.set_requires_gradient_sync(False)
    _loss(m, 0).backward()
    _loss(other, 0).backward()
    out["other_model"] = _mistake_warnings(lambda: opt_other.step())[1]
    return out


def test_a_step_on_gradients_never_reduced(dist_pool):
    for rank, out in enumerate(dist_pool(2).run(_unsynced, timeout=TIMEOUT)):
        warned, unchanged = out["torch"]
        assert warned == [] and unchanged, out["torch"]
        # one warning per step (two steps under FSDP1)
        assert len(out["fsdp1"]) == 2 and len(out["fully_shard"]) == 1, out
        for name, how, unit in (("fsdp1", "no_sync()", "'0'"),
                                ("fully_shard", "set_requires_gradient_sync(False)", "'0'")):
            msg = out[name][0]
            assert msg.startswith("UnsyncedStepWarning") and f"rank {rank}:" in msg, msg
            assert f"ran with gradient sync off ({how})" in msg and unit in msg, msg
            assert "before optimizer.step()" in msg, msg
        for name in ("fsdp1_ok", "fully_shard_ok", "other_model"):
            assert out[name] == [], (name, out[name])
        if rank == 0:
            assert_documented("unsynced-step", out["fsdp1"][0])


# ---------------------------------------------------------------------------
# 3. replicas that drift apart


def _drift(case):
    rank = dist.get_rank()
    if case == "fully_shard_2d":
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        os.environ["FLATSHARD_CHECK_REPLICAS_EVERY"] = "2"  # fully_shard: torch's arguments
        try:
            m = _flatshard_fully_shard(_model(), mesh=mesh)
        finally:
            del os.environ["FLATSHARD_CHECK_REPLICAS_EVERY"]
    elif case == "hybrid":
        m = FSDP(_model(), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 process_group=(dist.new_group([rank]), dist.new_group([0, 1])),
                 check_replicas_every=2)
    else:
        m = FSDP(_model(), sharding_strategy=getattr(ShardingStrategy, case),
                 check_replicas_every=2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)

    def step(s):
        _loss(m, s).backward()
        opt.step()
        opt.zero_grad()
    clean = _mistake_warnings(lambda: [step(s) for s in range(4)])[1]
    if rank == 1:  # one rank writes to its copy, as a rank-dependent branch would
        with torch.no_grad():
            p = next(iter(m.parameters()))
            (p.to_local() if hasattr(p, "to_local") else p).add_(1e-3)
    drifted = _mistake_warnings(lambda: [step(s) for s in range(2)])[1]
    return clean, drifted


@pytest.mark.parametrize("case", ["NO_SHARD", "hybrid", "fully_shard_2d"])
def test_replicas_that_drift_apart(dist_pool, case):
    for rank, (clean, drifted) in enumerate(dist_pool(2).run(_drift, case, timeout=TIMEOUT)):
        assert clean == [], clean
        assert len(drifted) == 1, drifted
        msg = drifted[0]
        assert msg.startswith("ReplicaDriftWarning") and f"rank {rank}:" in msg, msg
        assert "after step 6 of SGD, parameter 0.weight" in msg, msg
        assert "differs between rank 0 and rank 1" in msg, msg
        if case == "NO_SHARD":
            if rank == 0:
                assert_documented("replicas-drift", msg)


def _replicas_every_checked():
    out = []
    for kw in ({"check_replicas_every": -1}, {"check_replicas_every": 1.5}):
        try:
            FSDP(_model(), **kw)
            out.append(None)
        except ConfigError as e:
            out.append(str(e))
    os.environ["FLATSHARD_CHECK_REPLICAS_EVERY"] = "often"
    for wrap in (lambda: FSDP(_model()), lambda: _flatshard_fully_shard(_model())):
        try:
            wrap()
            out.append(None)
        except ConfigError as e:
            out.append(str(e))
    del os.environ["FLATSHARD_CHECK_REPLICAS_EVERY"]
    return out


def test_check_replicas_every_is_validated(dist_pool):
    out = dist_pool(2).run(_replicas_every_checked, timeout=TIMEOUT)[0]
    assert all(m is not None and "check_replicas_every=" in m for m in out[:2]), out
    assert all(m is not None and "FLATSHARD_CHECK_REPLICAS_EVERY='often'" in m
               for m in out[2:]), out
