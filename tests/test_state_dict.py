"""summon_full_params and model state dicts against plain torch: the same
names, shapes and values as the unwrapped model, full state dicts that load
into the plain model and back, torch's enum and config objects, LOCAL and
SHARDED types, and mismatches refused before anything changes."""
import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard import FSDP, ShardingStrategy, StateDictType
from parity import ATOL, RTOL, SCALE_ATOL, batches, optimizer, policy, train_steps as _steps
from toy_models import build

CASES = [(s, u) for s in ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"] for u in [False, True]]


def _wrap(strategy="FULL_SHARD", use_orig=False, wrap="nested", seed=0, **model_kw):
    model_kw.setdefault("nested", True)
    return FSDP(build(seed=seed, **model_kw), sharding_strategy=ShardingStrategy[strategy],
                auto_wrap_policy=policy(wrap), use_orig_params=use_orig)


def _train(fs, ref=None, steps=2, seed=1):
    """A few AdamW steps on this rank's slice of the batch (and, for `ref`,
    the whole batch), so that values are no longer the initial ones."""
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = optimizer("adamw", fs.parameters())
    ropt = optimizer("adamw", [p for p in ref.parameters() if p.requires_grad]) if ref else None
    for x, y in batches(steps, 2, world, seed):
        ((fs(x[2 * rank:2 * rank + 2]) - y[2 * rank:2 * rank + 2]) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        if ref is not None:
            ((ref(x) - y) ** 2).mean().backward()
            ropt.step()
            ropt.zero_grad()
    return opt, ropt


def _plain(name):
    return name.replace("_fsdp_wrapped_module.", "")


# ---------------------------------------------------------------------------
# summon_full_params


def _summon_shows_plain_params(strategy, use_orig, kw):
    fs, ref = _wrap(strategy, use_orig, **kw), build(nested=True, **kw)
    outside = [(n, p.shape) for n, p in fs.named_parameters()]
    want = {n: p for n, p in ref.named_parameters()}
    with FSDP.summon_full_params(fs):
        inside = {_plain(n): p for n, p in fs.named_parameters()}
        assert set(inside) == set(want), set(inside) ^ set(want)
        for n, p in inside.items():
            assert p.shape == want[n].shape and torch.equal(p, want[n]), n
            assert p.requires_grad == want[n].requires_grad, n
    assert [(n, p.shape) for n, p in fs.named_parameters()] == outside
    assert flatshard.memory_stats(fs)["unsharded"] == 0 or strategy == "NO_SHARD"
    return [u._unit.c.state for u in fs.modules() if isinstance(u, FSDP)]


@pytest.mark.parametrize("strategy,use_orig", CASES)
@pytest.mark.parametrize("kw", [{}, {"tied": True, "frozen": True}])
def test_summon_shows_the_plain_models_parameters(dist_pool, strategy, use_orig, kw):
    for states in dist_pool(2).run(_summon_shows_plain_params, strategy, use_orig, kw):
        assert set(states) == {"IDLE"}


def _summon_writeback(strategy, use_orig, writeback):
    rank = dist.get_rank()
    fs, ref = _wrap(strategy, use_orig), build(nested=True)
    x = torch.randn(3, 5, generator=torch.Generator().manual_seed(5))
    with FSDP.summon_full_params(fs, writeback=writeback), torch.no_grad():
        for p in fs.parameters():
            p.mul_(0.5).add_(0.25)
    if writeback or strategy == "NO_SHARD":  # NO_SHARD: the full buffer is the shard
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(0.5).add_(0.25)
    with torch.no_grad():
        torch.testing.assert_close(fs(x), ref(x), rtol=0, atol=0)
    return rank


@pytest.mark.parametrize("strategy,use_orig", CASES)
@pytest.mark.parametrize("writeback", [True, False])
def test_summon_writeback_reaches_the_shards(dist_pool, strategy, use_orig, writeback):
    dist_pool(2).run(_summon_writeback, strategy, use_orig, writeback)


def _summon_rank0_only_and_recurse(use_orig):
    fs, ref = _wrap(use_orig=use_orig), build(nested=True)
    shapes = {n: p.shape for n, p in ref.named_parameters()}
    with FSDP.summon_full_params(fs, rank0_only=True, writeback=False, offload_to_cpu=True):
        seen = {_plain(n): p.shape for n, p in fs.named_parameters()}
    inner = fs.blocks[0]
    with FSDP.summon_full_params(inner, recurse=False):  # not its nested unit blocks.0.inner
        inner_seen = {_plain(n): p.shape for n, p in inner.named_parameters()
                      if not _plain(n).startswith("inner.")}
    return seen == shapes, inner_seen == {n[len("blocks.0."):]: s for n, s in shapes.items()
                                          if n.startswith("blocks.0.")
                                          and not n.startswith("blocks.0.inner.")}


@pytest.mark.parametrize("use_orig", [False, True])
def test_summon_rank0_only_and_recurse_false(dist_pool, use_orig):
    res = dist_pool(2).run(_summon_rank0_only_and_recurse, use_orig)
    assert res == [(True, True), (False, True)]  # rank 1 keeps its shards under rank0_only


def _summon_with_grads():
    rank, world = dist.get_rank(), dist.get_world_size()
    fs, ref = _wrap(use_orig=True), build(nested=True)
    x, y = batches(1, 2, world, seed=3)[0]
    ((fs(x[2 * rank:2 * rank + 2]) - y[2 * rank:2 * rank + 2]) ** 2).mean().backward()
    ((ref(x) - y) ** 2).mean().backward()
    want = {n: p.grad for n, p in ref.named_parameters()}
    before = {n: p.grad.clone() for n, p in fs.named_parameters()}
    with FSDP.summon_full_params(fs, with_grads=True, writeback=False):
        for n, p in fs.named_parameters():
            # Two half-batch means averaged vs one whole-batch mean differ by
            # float32 rounding, relative to the gradient's scale (parity.py's rule).
            want_n = want[_plain(n)]
            scale = want_n.abs().max().item() if want_n.numel() else 0.0
            atol = max(1e-7, 2e-6 * scale)
            torch.testing.assert_close(p.grad, want_n, rtol=2e-6, atol=atol)
    for n, p in fs.named_parameters():  # the gradient pieces are back, unchanged
        assert torch.equal(p.grad, before[n]), n
    return True


def test_summon_with_grads_shows_full_gradients(dist_pool):
    assert dist_pool(2).run(_summon_with_grads) == [True, True]


def _summon_refusals():
    out = []
    fs = _wrap()
    for kw in [dict(writeback=True, rank0_only=True), dict(with_grads=True),
               dict(recurse="yes")]:
        try:
            with FSDP.summon_full_params(fs, **kw):
                pass
        except flatshard.ConfigError as e:
            out.append(str(e).split("=")[0].split(" ")[1])
    try:
        with FSDP.summon_full_params(fs):
            with FSDP.summon_full_params(fs):
                pass
    except flatshard.StateError as e:
        out.append("nested" if "summon_enter" in str(e) else str(e))
    fs(torch.randn(2, 5)).sum().backward()  # everything is usable afterwards
    return out


def test_summon_refusals_name_the_argument(dist_pool):
    assert dist_pool(2).run(_summon_refusals)[0] == ["writeback", "with_grads", "recurse",
                                                      "nested"]


# ---------------------------------------------------------------------------
# FULL_STATE_DICT: the plain model's state dict


def _full_round_trip(strategy, use_orig, kw):
    rank = dist.get_rank()
    fs, ref = _wrap(strategy, use_orig, **kw), build(nested=True, **kw)
    _train(fs, ref)
    sd = fs.state_dict()
    want = ref.state_dict()
    assert sorted(sd) == sorted(want)  # the same keys, buffers included
    if use_orig or not kw:
        # Also the same order; use_orig_params=False registers a module's frozen
        # and trainable parameters group by group while shown.
        assert list(sd) == list(want)
    for k, v in want.items():
        assert sd[k].shape == v.shape and sd[k].dtype == v.dtype, k
        scale = v.abs().max().item() if v.numel() else 0.0  # parity.py's tolerance
        torch.testing.assert_close(sd[k], v, rtol=RTOL, atol=max(ATOL, SCALE_ATOL * scale))
    # Into the plain model: it computes what the wrapped one computes.
    plain = build(nested=True, seed=7, **kw)
    plain.load_state_dict(sd)
    x = torch.randn(2, 5, generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        torch.testing.assert_close(plain(x), fs(x), rtol=0, atol=0)
    # And back: a differently initialised wrapped model takes the plain one's.
    other = _wrap(strategy, use_orig, seed=9, **kw)
    res = other.load_state_dict(want)
    assert res.missing_keys == [] and res.unexpected_keys == []
    back = other.state_dict()
    assert all(torch.equal(back[k], v) for k, v in want.items())
    assert flatshard.memory_stats(other)["unsharded"] == 0 or strategy == "NO_SHARD"
    return sorted(k for k in sd if "scale" in k)


@pytest.mark.parametrize("strategy,use_orig", CASES)
@pytest.mark.parametrize("kw", [{}, {"tied": True, "frozen": True}])
def test_full_state_dict_is_the_plain_models(dist_pool, strategy, use_orig, kw):
    buffers = dist_pool(2).run(_full_round_trip, strategy, use_orig, kw)[0]
    assert buffers == ["blocks.0.scale", "blocks.1.scale", "blocks.2.scale"]


def _full_with_torch_objects():
    from torch.distributed import fsdp as tfsdp
    fs = _wrap()
    ref = build(nested=True)
    assert FSDP.get_state_dict_type(fs).state_dict_type is StateDictType.FULL_STATE_DICT
    cfg = tfsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(fs, tfsdp.StateDictType.FULL_STATE_DICT, cfg):
        got = FSDP.get_state_dict_type(fs)
        sd = fs.state_dict()
    assert FSDP.get_state_dict_type(fs).state_dict_config == flatshard.FullStateDictConfig()
    ok = all(torch.equal(sd[k], v) for k, v in ref.state_dict().items()) if sd else None
    # the object given, torch's, is the one in force (as torch keeps it): a
    # field assigned to it later is read at the next state dict
    return (got.state_dict_config is cfg, got.state_dict_config.rank0_only, len(sd), ok)


def test_torch_enums_and_configs_are_accepted(dist_pool):
    r0, r1 = dist_pool(2).run(_full_with_torch_objects)
    assert r0[:2] == (True, True) and r0[3] is True
    assert r1[2] == 0  # rank0_only: the other ranks get an empty dict, as in torch


def _wrong_configs():
    fs = _wrap()
    out = []
    for args in [("FULL_STATE_DICT",), (StateDictType.FULL_STATE_DICT,
                                        flatshard.ShardedStateDictConfig())]:
        try:
            FSDP.set_state_dict_type(fs, *args)
        except flatshard.ConfigTypeError as e:
            out.append(str(e).split(" got")[0])
    return out


def test_wrong_types_and_configs_name_the_argument(dist_pool):
    assert dist_pool(1).run(_wrong_configs)[0] == ["flatshard: state_dict_type",
                                                   "flatshard: state_dict_config"]


# ---------------------------------------------------------------------------
# SHARDED_STATE_DICT and LOCAL_STATE_DICT


def _sharded_and_local(kind, use_orig):
    from torch.distributed.tensor import DTensor
    fs, ref = _wrap(use_orig=use_orig), build(nested=True)
    _train(fs, ref)
    with FSDP.state_dict_type(fs, StateDictType[kind]):
        sd = fs.state_dict()
    with FSDP.state_dict_type(fs, StateDictType.FULL_STATE_DICT):
        full = fs.state_dict()
    other = _wrap(use_orig=not use_orig, seed=4)  # the stored form does not depend on it
    with FSDP.state_dict_type(other, StateDictType[kind]):
        other.load_state_dict(sd)
    back = other.state_dict()
    assert all(torch.equal(back[k], v) for k, v in full.items())
    params = dict(ref.named_parameters())
    kinds = {k: type(v).__name__ for k, v in sd.items() if k not in params}
    if kind == "SHARDED_STATE_DICT":
        for k, p in params.items():
            assert isinstance(sd[k], DTensor) and sd[k].shape == p.shape, k
            assert torch.equal(sd[k].full_tensor(), full[k]), k
    return sorted(kinds.items())


@pytest.mark.parametrize("use_orig", [False, True])
def test_sharded_state_dict_holds_dtensors_of_the_plain_shapes(dist_pool, use_orig):
    res = dist_pool(2).run(_sharded_and_local, "SHARDED_STATE_DICT", use_orig)
    assert res[0] == [(f"blocks.{i}.scale", "Tensor") for i in range(3)]  # buffers stay plain


@pytest.mark.parametrize("use_orig", [False, True])
def test_local_state_dict_holds_the_flat_shards(dist_pool, use_orig):
    res = dist_pool(2).run(_sharded_and_local, "LOCAL_STATE_DICT", use_orig)
    flat = [k for k, _ in res[0] if "_flat_param" in k]
    assert flat == ["_flat_param", "blocks.0._flat_param", "blocks.0.inner._flat_param",
                    "blocks.1._flat_param", "blocks.2._flat_param", "blocks.2.inner._flat_param"]


# ---------------------------------------------------------------------------
# mismatches: refused, naming the keys, before anything changes


def _mismatches():
    fs = _wrap()
    good = build(nested=True, seed=3).state_dict()
    before = fs.state_dict()
    cases = {
        "missing": {k: v for k, v in good.items() if k != "blocks.1.ff.lin.weight"},
        "unexpected": {**good, "blocks.9.weight": torch.zeros(1)},
        "shape": {**good, "head.weight": torch.zeros(4, 7), "blocks.0.scale": torch.zeros(3)},
    }
    out = {}
    for name, sd in cases.items():
        try:
            fs.load_state_dict(sd)
            out[name] = "loaded"
        except flatshard.StateDictError as e:
            out[name] = str(e)
    after = fs.state_dict()
    unchanged = all(torch.equal(after[k], v) for k, v in before.items())
    loose = fs.load_state_dict(cases["missing"], strict=False)
    return out, unchanged, loose.missing_keys


def test_mismatching_state_dicts_are_refused_naming_keys(dist_pool):
    out, unchanged, loose_missing = dist_pool(2).run(_mismatches)[0]
    assert 'Missing key(s): "blocks.1.ff.lin.weight"' in out["missing"]
    assert 'Unexpected key(s): "blocks.9.weight"' in out["unexpected"]
    assert "size mismatch for head.weight" in out["shape"] and "[4, 7]" in out["shape"]
    assert "size mismatch for blocks.0.scale" in out["shape"]
    assert unchanged
    assert loose_missing == ["blocks.1.ff.lin.weight"]


# ---------------------------------------------------------------------------
# optimizer state: a resumed run continues exactly as an uninterrupted one


def _resume(strategy, use_orig, opt_name, kind, kw, optim_rank0_only=False):
    world = dist.get_world_size()
    data = batches(6, 2, world, seed=11)
    straight = _wrap(strategy, use_orig, **kw)
    want = _steps(straight, optimizer(opt_name, straight.parameters()), data)

    first = _wrap(strategy, use_orig, **kw)
    opt = optimizer(opt_name, first.parameters())
    got = _steps(first, opt, data[:3])
    ocfg = flatshard.FullOptimStateDictConfig(rank0_only=True) if optim_rank0_only else None
    with FSDP.state_dict_type(first, StateDictType[kind], optim_state_dict_config=ocfg):
        model_sd, optim_sd = first.state_dict(), FSDP.optim_state_dict(first, opt)

    again = _wrap(strategy, use_orig, seed=5, **kw)  # other initial values: all overwritten
    opt2 = optimizer(opt_name, again.parameters())
    for pg in opt2.param_groups:
        pg["lr"] = 123.0  # hyperparameters come back too
    with FSDP.state_dict_type(again, StateDictType[kind], optim_state_dict_config=ocfg):
        again.load_state_dict(model_sd)
        FSDP.optim_state_dict_to_load(again, opt2, optim_sd, load_directly=True)
    got += _steps(again, opt2, data[3:])
    return got == want, got, want, sorted(optim_sd.get("state", {}))[:2]


@pytest.mark.parametrize("strategy,use_orig,kind", [
    ("FULL_SHARD", False, "FULL_STATE_DICT"), ("FULL_SHARD", True, "SHARDED_STATE_DICT"),
    ("SHARD_GRAD_OP", True, "FULL_STATE_DICT"), ("SHARD_GRAD_OP", False, "SHARDED_STATE_DICT"),
    ("NO_SHARD", False, "SHARDED_STATE_DICT"), ("NO_SHARD", True, "FULL_STATE_DICT")])
def test_resumed_training_matches_a_straight_run_exactly(dist_pool, strategy, use_orig, kind):
    for same, got, want, keys in dist_pool(2).run(_resume, strategy, use_orig, "adamw", kind,
                                                   {"tied": True, "frozen": True}):
        assert same, (got, want)
        assert keys == ["blocks.0.ff.back.bias", "blocks.0.ff.back.weight"]  # plain names


def test_resume_from_local_and_rank0_only_optimizer_state(dist_pool):
    for same, got, want, keys in dist_pool(2).run(_resume, "FULL_SHARD", False, "adamw",
                                                   "LOCAL_STATE_DICT", {}):
        assert same and keys == [0, 1], (got, want)  # LOCAL: optim.state_dict() itself
    res = dist_pool(2).run(_resume, "FULL_SHARD", True, "adamw", "FULL_STATE_DICT", {},
                           optim_rank0_only=True)
    assert [r[0] for r in res] == [True, True]  # rank 1 had {} and got rank 0's broadcast
    assert res[1][3] == [] and res[0][3] == ["blocks.0.ff.back.bias", "blocks.0.ff.back.weight"]


@pytest.mark.parametrize("world", [1, 4])
def test_resume_sgd_momentum_other_worlds(dist_pool, world):
    for same, got, want, _ in dist_pool(world).run(_resume, "FULL_SHARD", True, "sgd",
                                                   "SHARDED_STATE_DICT", {}):
        assert same, (got, want)


def _optim_state_vs_plain(use_orig):
    fs, ref = _wrap(use_orig=use_orig, frozen=True), build(nested=True, frozen=True)
    opt, ropt = _train(fs, ref)
    osd = FSDP.optim_state_dict(fs, opt)
    names = {p: n for n, p in ref.named_parameters()}
    want = {names[p]: st for p, st in ropt.state.items()}
    assert sorted(osd["state"]) == sorted(want)  # frozen parameters have no state
    for n, st in want.items():
        assert list(osd["state"][n]) == list(st), n
        for k, v in st.items():
            scale = v.abs().max().item() if v.numel() else 0.0
            torch.testing.assert_close(osd["state"][n][k], v, rtol=RTOL * 5,
                                       atol=max(ATOL, SCALE_ATOL * scale), msg=f"{n}.{k}")
    groups = osd["param_groups"]
    return len(groups), sorted(groups[0]["params"]) == sorted(names.values()), groups[0]["lr"]


@pytest.mark.parametrize("use_orig", [False, True])
def test_full_optim_state_matches_the_plain_optimizers(dist_pool, use_orig):
    for res in dist_pool(2).run(_optim_state_vs_plain, use_orig):
        assert res == (1, True, 0.01)


class _Scaled(torch.nn.Module):
    """A 0-dim parameter registered first: its state looks like Adam's "step"."""

    def __init__(self):
        super().__init__()
        self.t = torch.nn.Parameter(torch.tensor(0.7))
        self.lin = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.lin(x) * self.t


def _resume_scaled(use_orig, kind):
    data = batches(4, 2, dist.get_world_size(), seed=13)
    models = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        m = FSDP(_Scaled(), use_orig_params=use_orig)
        models.append((m, optimizer("adamw", m.parameters())))
    want = _steps(*models[0], data)
    got = _steps(*models[1], data[:2])
    with FSDP.state_dict_type(models[1][0], StateDictType[kind]):
        sd, osd = models[1][0].state_dict(), FSDP.optim_state_dict(*models[1])
    with FSDP.state_dict_type(models[2][0], StateDictType[kind]):
        models[2][0].load_state_dict(sd)
        FSDP.optim_state_dict_to_load(*models[2], osd, load_directly=True)
    return got + _steps(*models[2], data[2:]) == want


@pytest.mark.parametrize("use_orig,kind", [(False, "FULL_STATE_DICT"),
                                           (True, "SHARDED_STATE_DICT")])
def test_resume_with_a_zero_dim_parameter(dist_pool, use_orig, kind):
    assert dist_pool(2).run(_resume_scaled, use_orig, kind) == [True, True]
