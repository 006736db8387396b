"""Settings that change nothing (flatshard/noop/): each is made here and
its NoEffectWarning checked (the setting, where, the fix), once per process;
the same settings where they do change something say nothing."""
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard
from flatshard import FSDP, MixedPrecision, MixedPrecisionPolicy, noop
from flatshard.errors import NoEffectWarning
from test_diagnostics import assert_documented
from toy_models import MLP, Block, build

TIMEOUT = 180
KINDS = ("mixed_precision", "mp_policy", "output_dtype", "wrap_nothing", "wrap_lopsided",
         "reshard_root")


def _said(fn):
    """[(kind said, message)] while fn() runs, every kind forgotten first."""
    for k in KINDS:
        noop.forget(k)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in got if issubclass(w.category, NoEffectWarning)]


def _fsdp1(**kw):
    def run():
        fs = FSDP(build(), device_id=torch.device("cpu"), **kw)
        fs(torch.randn(2, 5)).sum().backward()
    return run


class _Big(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x)


class _Lopsided(nn.Module):
    """One big unit (1 MiB, 99% of the parameters) and three tiny ones."""

    def __init__(self):
        super().__init__()
        self.big = _Big(512)
        self.small = nn.ModuleList([Block(2), Block(2)])
        self.inp, self.out = nn.Linear(2, 512), nn.Linear(512, 2)

    def forward(self, x):
        for b in self.small:
            x = b(x)
        return self.out(self.big(self.inp(x)))


def _fsdp1_cases():
    policy = flatshard.ModuleWrapPolicy({Block})
    lopsided = flatshard.ModuleWrapPolicy({Block, _Big})
    return {
        "mp_f32": _said(_fsdp1(mixed_precision=MixedPrecision(param_dtype=torch.float32))),
        "mp_bf16": _said(_fsdp1(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                              buffer_dtype=torch.bfloat16))),
        "reduce_f32": _said(_fsdp1(mixed_precision=MixedPrecision(reduce_dtype=torch.float32))),
        "policy_none": _said(_fsdp1(auto_wrap_policy=flatshard.ModuleWrapPolicy({nn.GRU}))),
        "policy_blocks": _said(_fsdp1(auto_wrap_policy=policy)),
        "lopsided": _said(lambda: FSDP(_Lopsided(), device_id=torch.device("cpu"),
                                       auto_wrap_policy=lopsided)),
        "lopsided_no_shard": _said(lambda: FSDP(
            _Lopsided(), device_id=torch.device("cpu"), auto_wrap_policy=lopsided,
            sharding_strategy=flatshard.ShardingStrategy.NO_SHARD)),
    }


def test_fsdp1_settings_that_change_nothing(dist_pool):
    for said in dist_pool(2).run(_fsdp1_cases, timeout=TIMEOUT):
        (mp,) = said["mp_f32"]
        assert "mixed_precision=MixedPrecision(param_dtype=torch.float32" in mp and \
            "changes no dtype: the parameters are torch.float32 already" in mp and \
            "pass mixed_precision=None" in mp
        (mp,) = said["reduce_f32"]
        assert "reduce_dtype=torch.float32" in mp and "changes no dtype" in mp
        (wrap,) = said["policy_none"]
        assert "auto_wrap_policy=" in wrap and "wrapped no module of Net" in wrap and \
            "'Block'" in wrap and "gathered whole on every rank" in wrap
        (lop,) = said["lopsided"]
        assert "unit 'big' holds 99% of the parameters' bytes (1.0 MiB of 1.0 MiB)" in lop \
            and "against 259.1 KiB if the 4 units were even" in lop, lop
        assert said["mp_bf16"] == said["policy_blocks"] == said["lopsided_no_shard"] == []


def _once():
    """A second wrap with the same setting says nothing more."""
    first = _said(_fsdp1(mixed_precision=MixedPrecision(param_dtype=torch.float32)))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        _fsdp1(mixed_precision=MixedPrecision(param_dtype=torch.float32))()
    return len(first), [str(w.message) for w in got if issubclass(w.category, NoEffectWarning)]


def test_each_kind_is_said_once_per_process(dist_pool):
    assert dist_pool(2).run(_once, timeout=TIMEOUT) == [(1, [])] * 2


def _fully_shard(mp=None, root_raf=None, inner_raf=None, lopsided=False):
    def run():
        model = _Lopsided() if lopsided else nn.Sequential(
            nn.Linear(2, 8), MLP(8), MLP(8), MLP(8), nn.Linear(8, 3))
        blocks = [model.big, *model.small] if lopsided else list(model)[1:4]
        inner = {} if mp is None else {"mp_policy": MixedPrecisionPolicy(mp.param_dtype)}
        for b in blocks:  # output_dtype on the root only
            flatshard.fully_shard(b, **inner, **({} if inner_raf is None else
                                                 {"reshard_after_forward": inner_raf}))
        kw = {} if mp is None else {"mp_policy": mp}
        if root_raf is not None:
            kw["reshard_after_forward"] = root_raf
        flatshard.fully_shard(model, **kw)
        model(torch.randn(2, 2)).float().sum().backward()
    return run


def _fully_shard_cases():
    f32, bf16 = torch.float32, torch.bfloat16
    return {
        "mp_f32": _said(_fully_shard(MixedPrecisionPolicy(param_dtype=f32))),
        "mp_bf16": _said(_fully_shard(MixedPrecisionPolicy(param_dtype=bf16))),
        "out_f32": _said(_fully_shard(MixedPrecisionPolicy(output_dtype=f32))),
        "out_after_bf16": _said(_fully_shard(MixedPrecisionPolicy(param_dtype=bf16,
                                                                  output_dtype=f32))),
        "root_only": _said(_fully_shard(root_raf=False)),
        "everywhere": _said(_fully_shard(root_raf=False, inner_raf=False)),
        "lopsided": _said(_fully_shard(lopsided=True)),
    }


def test_fully_shard_settings_that_change_nothing(dist_pool):
    for said in dist_pool(2).run(_fully_shard_cases, timeout=TIMEOUT):
        (mp,) = said["mp_f32"]
        assert "fully_shard(MLP, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32" in mp \
            and "changes no dtype" in mp and "leave mp_policy out" in mp
        (out,) = said["out_f32"]
        assert "output_dtype=torch.float32) of the fully_shard module Sequential changed " \
            "no output" in out and "returned torch.float32 already" in out, out
        (raf,) = said["root_only"]
        assert "reshard_after_forward=False was given to the root's fully_shard (Sequential) only" \
            in raf and "the 3 fully_shard module(s) inside keep the default (True)" in raf \
            and "set_reshard_after_forward(False)" in raf
        (lop,) = said["lopsided"]
        # the root, not resharded after forward, is not one of the units compared
        assert "fully_shard group 'big' holds 100% of the parameters' bytes (1.0 MiB of " \
            "1.0 MiB)" in lop and "against 342.2 KiB if the 3 units were even" in lop, lop
        assert said["mp_bf16"] == said["out_after_bf16"] == said["everywhere"] == []


def _guide_cases():
    policy = flatshard.ModuleWrapPolicy({Block, _Big})
    said = _said(_fsdp1(mixed_precision=MixedPrecision(param_dtype=torch.float32)))
    said += _said(_fsdp1(auto_wrap_policy=flatshard.ModuleWrapPolicy({nn.GRU})))
    said += _said(lambda: FSDP(_Lopsided(), device_id=torch.device("cpu"),
                               auto_wrap_policy=policy))
    said += _said(_fully_shard(root_raf=False))
    return "\n".join("NoEffectWarning: " + m for m in said)


def test_the_guide_shows_these_warnings(dist_pool):
    assert_documented("no-effect-settings", dist_pool(2).run(_guide_cases, timeout=TIMEOUT)[0])
