"""flatshard's option classes that torch also has behave as the installed
torch's: every dataclass of torch.distributed.fsdp that flatshard provides
its own class for (found from torch at run time: MixedPrecision, CPUOffload,
the state-dict and optimizer state-dict configs, StateDictSettings, and any
torch adds) has the same fields in the same order with the same defaults,
is as mutable, and compares, hashes and prints as torch's, each built both
ways and compared against torch's own class.

Mutable, they are checked where they are read: a bad value assigned after
construction is refused by FSDP(...) (MixedPrecision, CPUOffload) or by the
next state dict call (the configs), naming the field; a good one assigned
the way frameworks do (accelerate's save_fsdp_model sets
state_dict_config.offload_to_cpu and .rank0_only) takes effect, as it does
on torch's FSDP1 in the same run."""
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
import torch.nn as nn

import flatshard
from flatshard import FSDP, ConfigError, ConfigTypeError, NotBuiltError
from toy_models import build

TIMEOUT = 240


def _ours_and_torchs():
    """(name, torch's class, flatshard's class) of every torch dataclass at
    torch.distributed.fsdp that flatshard has its own class for."""
    out = []
    for name in sorted(tfsdp.__all__):
        theirs = getattr(tfsdp, name)
        ours = getattr(flatshard, name, None)
        if dataclasses.is_dataclass(theirs) and isinstance(theirs, type) and ours is not None \
                and ours is not theirs:
            out.append((name, theirs, ours))
    return out


CLASSES = _ours_and_torchs()
NAMES = [n for n, _, _ in CLASSES]


def test_the_enumeration_finds_torchs_option_classes():
    assert {"MixedPrecision", "CPUOffload", "StateDictConfig", "FullStateDictConfig",
            "ShardedStateDictConfig", "LocalStateDictConfig", "OptimStateDictConfig",
            "FullOptimStateDictConfig", "ShardedOptimStateDictConfig",
            "LocalOptimStateDictConfig", "StateDictSettings"} <= set(NAMES)


def _required(cls, side):
    """Arguments for the fields without a default (StateDictSettings'), from
    `side`'s own objects ("ours" or "torch")."""
    mod = flatshard if side == "ours" else tfsdp
    values = {"state_dict_type": mod.StateDictType.SHARDED_STATE_DICT,
              "state_dict_config": mod.ShardedStateDictConfig(),
              "optim_state_dict_config": mod.ShardedOptimStateDictConfig()}
    return {f.name: values[f.name] for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def _other_value(field, side):
    """A valid value for `field` other than its default, on `side`."""
    mod = flatshard if side == "ours" else tfsdp
    if field.name.endswith("_dtype"):
        return torch.bfloat16
    if field.name == "_module_classes_to_ignore":
        return (nn.LayerNorm,)
    if field.name == "state_dict_type":
        return mod.StateDictType.LOCAL_STATE_DICT
    if field.name == "state_dict_config":
        return mod.LocalStateDictConfig(offload_to_cpu=True)
    if field.name == "optim_state_dict_config":
        return mod.LocalOptimStateDictConfig(offload_to_cpu=True)
    if isinstance(field.default, bool):
        return not field.default
    raise AssertionError(f"no test value for the new field {field.name}: add one here")


@pytest.mark.parametrize("name,theirs,ours", CLASSES, ids=NAMES)
def test_fields_defaults_and_mutability_are_torchs(name, theirs, ours):
    tf, of = dataclasses.fields(theirs), dataclasses.fields(ours)
    assert [f.name for f in of] == [f.name for f in tf]
    for t, o in zip(tf, of):
        assert o.default == t.default, (name, t.name)
        assert (o.default_factory is dataclasses.MISSING) == \
            (t.default_factory is dataclasses.MISSING), (name, t.name)
        assert (o.init, o.repr, o.compare) == (t.init, t.repr, t.compare), (name, t.name)
    tp, op = theirs.__dataclass_params__, ours.__dataclass_params__
    assert (op.frozen, op.eq, op.order) == (tp.frozen, tp.eq, tp.order), name
    assert (ours.__hash__ is None) == (theirs.__hash__ is None), name


@pytest.mark.parametrize("name,theirs,ours", CLASSES, ids=NAMES)
def test_equality_and_repr_are_torchs(name, theirs, ours):
    def both(**changed):
        return (ours(**{**_required(ours, "ours"), **changed.get("ours", {})}),
                theirs(**{**_required(theirs, "torch"), **changed.get("torch", {})}))
    o0, t0 = both()
    assert repr(o0) == repr(t0)
    assert (o0 == both()[0]) == (t0 == both()[1]) is True
    for f in dataclasses.fields(theirs):
        o1, t1 = both(ours={f.name: _other_value(f, "ours")},
                      torch={f.name: _other_value(f, "torch")})
        assert repr(o1) == repr(t1), f.name
        assert (o1 == o0) == (t1 == t0) is False, f.name
        # built with the value, or assigned it after: the same object
        o2, t2 = both()
        setattr(o2, f.name, _other_value(f, "ours"))
        setattr(t2, f.name, _other_value(f, "torch"))
        assert o2 == o1 and t2 == t1 and repr(o2) == repr(t2), f.name


# ---------------------------------------------------------------------------
# MixedPrecision and CPUOffload: a bad value assigned is refused by FSDP(...),
# which reads them, before it needs a process group


def _bad(field):
    if field.name.endswith("_dtype"):
        return "bf16"
    if field.name == "_module_classes_to_ignore":
        return 5
    return 1  # a bool field given an int


@pytest.mark.parametrize("cls_name,field", [
    (n, f.name) for n in ("MixedPrecision", "CPUOffload")
    for f in dataclasses.fields(getattr(flatshard, n))])
def test_a_bad_value_assigned_is_refused_where_used(cls_name, field):
    cls = getattr(flatshard, cls_name)
    opt = cls(param_dtype=torch.bfloat16) if cls is flatshard.MixedPrecision else cls()
    f = next(f for f in dataclasses.fields(cls) if f.name == field)
    setattr(opt, field, _bad(f))  # mutable, as torch's: refused where read
    arg = "mixed_precision" if cls is flatshard.MixedPrecision else "cpu_offload"
    with pytest.raises(ConfigError, match=rf"{arg}\.{field}\b"):
        FSDP(build(), **{arg: opt})


def test_a_wrapped_unit_keeps_the_mixed_precision_it_was_given():
    """What FSDP(...) checked is what its units use: a copy, so a later
    assignment to the caller's object cannot bypass the check."""
    from flatshard.fsdp.config import _mixed_precision
    mp = flatshard.MixedPrecision(param_dtype=torch.bfloat16)
    kept = _mixed_precision(mp, flatshard.ShardingStrategy.FULL_SHARD)
    mp.param_dtype = "anything"
    assert kept.param_dtype is torch.bfloat16 and kept is not mp


# ---------------------------------------------------------------------------
# state-dict configs: assigned after set_state_dict_type, read (and checked)
# at the next state dict, against torch's FSDP1 in the same run


def _model(which):
    """toy_models' model wrapped by torch's FSDP1 or flatshard's, after one
    step (torch's FULL_STATE_DICT with offload_to_cpu fails before a forward)."""
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from toy_models import Block
    if which == "torch":
        m = tfsdp.FullyShardedDataParallel(build(), auto_wrap_policy=ModuleWrapPolicy({Block}),
                                           device_id=torch.device("cpu"))
    else:
        m = FSDP(build(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    m(torch.randn(2, 5)).square().mean().backward()
    return m


def _assigned_configs():
    rank = dist.get_rank()
    out = {}
    for which, C, mod in (("torch", tfsdp.FullyShardedDataParallel, tfsdp),
                          ("ours", FSDP, flatshard)):
        m = _model(which)
        res = {}
        # accelerate's save_fsdp_model: the plugin's config, assigned, then
        # passed (it sets offload_to_cpu too, which torch's FSDP1 on CPU
        # devices fails on, "setStorage: ... out of bounds": flatshard's
        # alone below)
        cfg = mod.FullStateDictConfig()
        cfg.rank0_only = True
        with C.state_dict_type(m, mod.StateDictType.FULL_STATE_DICT, cfg):
            res["passed"] = len(m.state_dict())
        # assigned after set_state_dict_type, to the object given
        cfg = mod.FullStateDictConfig()
        C.set_state_dict_type(m, mod.StateDictType.FULL_STATE_DICT, cfg)
        before = len(m.state_dict())
        cfg.rank0_only = True
        res["assigned"] = (before, len(m.state_dict()))
        # through the settings get_state_dict_type returns: a new object, the same config
        settings = C.get_state_dict_type(m)
        res["settings"] = (settings is C.get_state_dict_type(m),
                           settings.state_dict_config is cfg, type(settings).__name__)
        settings.state_dict_config.rank0_only = False
        res["through_settings"] = len(m.state_dict())
        settings.state_dict_type = mod.StateDictType.LOCAL_STATE_DICT  # the copy only
        res["type_after"] = C.get_state_dict_type(m).state_dict_type.name
        # one model's default config is its own, not another's
        a, b = _model(which), _model(which)
        C.get_state_dict_type(a).state_dict_config.rank0_only = True
        res["defaults_apart"] = len(b.state_dict())
        out[which] = res
    # accelerate's assignments whole, on flatshard: the same values as torch's
    # rank0_only alone above (offload_to_cpu has nothing to move on CPU)
    m = _model("ours")
    cfg = flatshard.FullStateDictConfig()
    cfg.offload_to_cpu = cfg.rank0_only = True
    with FSDP.state_dict_type(m, flatshard.StateDictType.FULL_STATE_DICT, cfg):
        out["accelerate"] = len(m.state_dict())
    # a bad value assigned: refused at the next use, naming the field
    refused = {}
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    for kind, model_cls, optim_cls in (
            ("FULL_STATE_DICT", "FullStateDictConfig", "FullOptimStateDictConfig"),
            ("SHARDED_STATE_DICT", "ShardedStateDictConfig", "ShardedOptimStateDictConfig"),
            ("LOCAL_STATE_DICT", "LocalStateDictConfig", "LocalOptimStateDictConfig")):
        for which, cls_name in (("state_dict_config", model_cls),
                                ("optim_state_dict_config", optim_cls)):
            for f in dataclasses.fields(getattr(flatshard, cls_name)):
                cfg = getattr(flatshard, cls_name)()
                configs = {which: cfg}
                FSDP.set_state_dict_type(m, flatshard.StateDictType[kind], **configs)
                setattr(cfg, f.name, "yes")
                try:
                    if which == "state_dict_config":
                        m.state_dict()
                    else:
                        FSDP.optim_state_dict(m, o)
                    refused[f"{cls_name}.{f.name}"] = None
                except ConfigTypeError as e:
                    refused[f"{cls_name}.{f.name}"] = str(e)
                try:  # loading reads the model's config too
                    if which == "state_dict_config":
                        m.load_state_dict({})
                except ConfigTypeError as e:
                    refused[f"{cls_name}.{f.name} (load)"] = str(e)
                except Exception:  # noqa: BLE001 - an empty dict fails later, past the check
                    refused[f"{cls_name}.{f.name} (load)"] = None
    FSDP.set_state_dict_type(m, flatshard.StateDictType.FULL_STATE_DICT)
    out["refused"] = refused
    return out


def test_configs_assigned_after_set_state_dict_type_act_as_torchs(dist_pool):
    for rank, res in enumerate(dist_pool(2).run(_assigned_configs, timeout=TIMEOUT)):
        ours, theirs = res["ours"], res["torch"]
        assert ours == theirs, (rank, ours, theirs)
        full = theirs["assigned"][0]
        assert full > 0
        assert theirs["passed"] == theirs["assigned"][1] == (full if rank == 0 else 0)
        assert theirs["through_settings"] == full  # rank0_only off again
        assert theirs["settings"] == (False, True, "StateDictSettings")
        assert theirs["type_after"] == "FULL_STATE_DICT"
        assert theirs["defaults_apart"] == full
        assert res["accelerate"] == theirs["passed"]
        for field, msg in res["refused"].items():
            if field.endswith("(load)"):
                if "OptimStateDictConfig" not in field:
                    assert msg is not None and "state_dict_config." in msg, (field, msg)
                continue
            where = "optim_state_dict_config." if "Optim" in field else "state_dict_config."
            name = field.split(".", 1)[1]
            assert msg is not None and f"{where}{name} got str 'yes'" in msg, (field, msg)


# ---------------------------------------------------------------------------
# MixedPrecision._module_classes_to_ignore: torch runs those modules in full
# precision under an auto_wrap_policy; flatshard refuses instead of running
# them otherwise


class _Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x))


def _full_precision_classes():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    out = []
    for mp in (flatshard.MixedPrecision(param_dtype=torch.bfloat16),
               tfsdp.MixedPrecision(param_dtype=torch.bfloat16)):
        try:
            FSDP(nn.Sequential(_Normed(), _Normed()), mixed_precision=mp,
                 auto_wrap_policy=ModuleWrapPolicy({_Normed}))
            out.append(None)
        except NotBuiltError as e:
            out.append(str(e))
    # opted out, or without a policy (torch applies it only with one): wrapped
    FSDP(nn.Sequential(_Normed()), auto_wrap_policy=ModuleWrapPolicy({_Normed}),
         mixed_precision=flatshard.MixedPrecision(param_dtype=torch.bfloat16,
                                                  _module_classes_to_ignore=()))
    FSDP(nn.Sequential(_Normed()), mixed_precision=flatshard.MixedPrecision(
        param_dtype=torch.bfloat16))
    return out


def test_full_precision_module_classes_are_refused_not_ignored(dist_pool):
    for msgs in dist_pool(2).run(_full_precision_classes, timeout=TIMEOUT):
        for msg in msgs:
            assert msg is not None and "mixed_precision._module_classes_to_ignore" in msg
            assert "BatchNorm1d" in msg and "_module_classes_to_ignore=()" in msg
