"""Model state dicts with torch FSDP1's three types, keyed like the plain model.

  FULL_STATE_DICT     every parameter whole (cloned), under the plain model's
                      keys: loads into the unwrapped model and back. With
                      rank0_only, ranks other than 0 return {}.
  SHARDED_STATE_DICT  every parameter as a DTensor (1-D mesh over the unit's
                      process group, Shard(0): torch's chunking, the layout
                      torch FSDP and torch.distributed.checkpoint use), so a
                      checkpoint reshards to any world size on load.
  LOCAL_STATE_DICT    each unit's flat shards as plain tensors under
                      `<unit>._flat_param[_<group>]`: loads only into the
                      same wrapping on the same world size.
Buffers (persistent ones, as nn.Module decides) are plain tensors in all
three. Keys never carry `_fsdp_wrapped_module.`.

How: nn.Module.state_dict walks the model and calls FSDP.state_dict on each
nested unit; a context variable tells those nested calls that a walk is in
progress. Each unit is summoned (fsdp/summon.py) while its own entries are
taken, so one unit at a time is whole, and its entries are then cloned or
cut into DTensors before it is freed. Loading needs no gathering for full
values: every rank copies its pieces straight into its shards.
"""
import contextlib
import contextvars
import dataclasses
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.module import _IncompatibleKeys

from ..errors import StateDictError, StateError, bad_type, bad_value, not_built
from ..options import (FullOptimStateDictConfig, FullStateDictConfig,
                       LocalOptimStateDictConfig, LocalStateDictConfig, OptimStateDictConfig,
                       ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType,
                       normalize_dataclass, normalize_enum)
from .flat_param import flat_param_name
from .groups import hybrid_groups
from .summon import summon_unit
from .unit import fsdp_units, unit_of

WRAPPED = "_fsdp_wrapped_module"
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"  # torch's checkpoint_wrapper


@dataclass
class StateDictSettings:
    """torch's: what FSDP.get_state_dict_type returns, a new object each
    time: the state_dict_type in force, and the state_dict_config and
    optim_state_dict_config objects given to set_state_dict_type (assigning
    to their fields changes the next state dict, as with torch's)."""
    state_dict_type: StateDictType
    state_dict_config: Any
    optim_state_dict_config: Any


_CONFIGS = {  # type -> (model config class, optimizer config class)
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}
_SETTINGS = "_flatshard_state_dict_settings"


# ---------------------------------------------------------------------------
# state_dict_type


def units_of(module):
    if not isinstance(module, nn.Module):
        raise bad_type("module", module, "an nn.Module")
    units = fsdp_units(module)
    if not units:
        raise bad_value("module", type(module).__name__, "it holds no FullyShardedDataParallel "
                        "module", "pass the wrapped model")
    return units


def settings_of(fs):
    """The unit's settings; until set_state_dict_type, its own defaults (its
    own config objects, as each of torch's FSDP modules has)."""
    settings = fs.__dict__.get(_SETTINGS)
    if settings is None:
        settings = fs.__dict__[_SETTINGS] = StateDictSettings(
            StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())
    return settings


def get_state_dict_type(module):
    """The StateDictSettings shared by every FSDP module under `module` (a
    new object holding the first one's configs, as torch returns)."""
    found = [settings_of(u) for u in units_of(module)]
    if any(s != found[0] for s in found[1:]):
        raise bad_value("module", type(module).__name__, "its FSDP modules have different "
                        f"state_dict types ({sorted({str(s) for s in found})})",
                        "set them together with FSDP.set_state_dict_type(model, ...)")
    first = found[0]
    return StateDictSettings(first.state_dict_type, first.state_dict_config,
                             first.optim_state_dict_config)


def checked_config(settings, which):
    """settings.<which> ("state_dict_config" or "optim_state_dict_config"),
    its fields checked now, where they are read: the configs are mutable
    (frameworks assign to them after set_state_dict_type), so a bad value
    is refused here, naming the field. Every field of torch's configs is a
    bool."""
    cfg = getattr(settings, which)
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if not isinstance(v, bool):
            raise bad_type(f"{which}.{f.name}", v, "True or False",
                           f"set {type(cfg).__name__}.{f.name} to a bool")
    return cfg


def set_state_dict_type(module, state_dict_type, state_dict_config=None,
                        optim_state_dict_config=None):
    """Set the type (and configs) on every FSDP module under `module`; accepts
    flatshard's or torch's enum and config objects. Returns the previous
    settings."""
    kind = normalize_enum("state_dict_type", state_dict_type, StateDictType, "StateDictType")
    model_cls, optim_cls = _CONFIGS[kind]
    # kept as given, torch's objects too: the caller's later assignments count
    cfg = normalize_dataclass("state_dict_config", state_dict_config, model_cls,
                              model_cls.__name__, keep=True) or model_cls()
    ocfg = normalize_dataclass("optim_state_dict_config", optim_state_dict_config, optim_cls,
                               optim_cls.__name__, keep=True) or optim_cls()
    units = units_of(module)
    previous = get_state_dict_type(module)
    for u in units:
        u.__dict__[_SETTINGS] = StateDictSettings(kind, cfg, ocfg)
    return previous


@contextlib.contextmanager
def state_dict_type(module, state_dict_type, state_dict_config=None,
                    optim_state_dict_config=None):
    previous = set_state_dict_type(module, state_dict_type, state_dict_config,
                                   optim_state_dict_config)
    try:
        yield
    finally:
        set_state_dict_type(module, previous.state_dict_type, previous.state_dict_config,
                            previous.optim_state_dict_config)


# ---------------------------------------------------------------------------
# keys and DTensors


def plain_key(key):
    """A wrapped model's key -> the plain model's key (without torch's
    activation-checkpoint wrapper prefix either, as torch FSDP's keys)."""
    return ".".join(p for p in key.split(".") if p not in (WRAPPED, CHECKPOINT_WRAPPED))


def join(prefix, name):
    return f"{prefix}.{name}" if prefix and name else prefix or name


def alias_keys(fs, prefix):
    """Plain keys of every alias of parameter i of group g in unit `fs`, which
    sits at plain path `prefix`: [(g, i, [keys])]."""
    name = "" if fs._unit.name == "<root>" else fs._unit.name
    cut = len(name) + 1 if name else 0
    return [(g, i, [join(prefix, plain_key(a.fqn[cut:])) for a in aliases])
            for g in fs._unit.groups for i, aliases in enumerate(g.aliases)]


def units_with_paths(model):
    """(plain path, FSDP module) of every unit in `model`, parents first."""
    return [(plain_key(n), m) for n, m in model.named_modules() if unit_of(m) is not None]


_MESHES = {}


def mesh_of(fs):
    """The DeviceMesh of a unit's sharded state: 1-D over its process group,
    or under HYBRID_SHARD 2-D (replicate, shard) (cached)."""
    from torch.distributed.device_mesh import DeviceMesh
    group, hybrid = fs._cfg.group, fs._cfg.hybrid
    hit = _MESHES.get(id(group))
    if hit is None or hit[0] is not group:
        if hybrid is None:
            mesh = DeviceMesh.from_group(group, fs._cfg.device.type)
        elif isinstance(hybrid, tuple) and hybrid[2] is not None:
            mesh = hybrid[2]  # the user's own 2-D mesh
        else:
            mesh = _hybrid_mesh(fs)
        hit = (group, mesh)
        _MESHES[id(group)] = hit
    return hit[1]


def _hybrid_mesh(fs):
    """The 2-D mesh of HYBRID_SHARD groups: a row per shard group, the
    replicas of a shard rank down a column (every rank tells its shard
    group's ranks: a collective, as state dicts are)."""
    from torch.distributed.device_mesh import DeviceMesh
    shard, replicate = hybrid_groups(fs._cfg.hybrid)
    rows = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(
        rows, torch.distributed.get_process_group_ranks(shard))
    layout = torch.tensor(sorted({tuple(r) for r in rows}))
    return DeviceMesh.from_group([replicate, shard], fs._cfg.device.type, mesh=layout,
                                 mesh_dim_names=("replicate", "shard"))


def to_dtensor(full, mesh):
    """A whole tensor (the same on every rank) -> a DTensor holding this rank's
    Shard(0) chunk (on the mesh's last dim; replicated on a 2-D mesh's
    first), copied (the whole tensor is freed next); 0-dim ones are
    replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    full = full.detach()
    rep = [Replicate()] * mesh.ndim
    if full.dim() == 0:
        return DTensor.from_local(full.clone(), mesh, rep, run_check=False)
    cut_on = rep[:-1] + [Shard(0)]
    cut = DTensor.from_local(full, mesh, rep, run_check=False).redistribute(mesh, cut_on)
    return DTensor.from_local(cut.to_local().clone(), mesh, cut_on, run_check=False,
                              shape=cut.shape, stride=cut.stride())


def is_dtensor(v):
    from torch.distributed.tensor import DTensor
    return isinstance(v, DTensor)


def whole(v):
    """A state dict value -> the whole tensor (gathers a DTensor: collective)."""
    return v.full_tensor() if is_dtensor(v) else v


# ---------------------------------------------------------------------------
# state_dict

_RAW = object()  # walk marker: nested units answer as plain nn.Modules
_WALK = contextvars.ContextVar("flatshard_state_dict_walk", default=None)


def state_dict(fs, destination=None, prefix="", keep_vars=False):
    """FSDP.state_dict: see the module docstring."""
    walk = _WALK.get()
    if walk is not None:  # a nested unit inside a walk: add entries, raw keys
        _unit_entries(fs, walk, destination, prefix, keep_vars)
        return destination
    settings = settings_of(fs)
    checked_config(settings, "state_dict_config")
    raw = OrderedDict()
    raw._metadata = OrderedDict()
    token = _WALK.set(settings)
    try:
        _unit_entries(fs, settings, raw, "", keep_vars)
    finally:
        _WALK.reset(token)
    out = destination if destination is not None else OrderedDict()
    if destination is None:
        out._metadata = OrderedDict()
    if _rank0_only(settings) and torch.distributed.get_rank(fs._cfg.group) != 0:
        return out  # torch FSDP: the other ranks' full state dict is empty
    for k, v in raw.items():
        out[prefix + plain_key(k)] = v
    meta = getattr(out, "_metadata", None)
    if meta is not None:
        for k, v in raw._metadata.items():  # later (inner) modules win: same plain key
            meta[join(prefix[:-1], plain_key(k))] = v
    return out


def raw_state_dict(fs, keep_vars=True):
    """nn.Module.state_dict of the wrapped model as it is (wrapper keys, flat
    shards): what nn.Module's loading sees."""
    token = _WALK.set(_RAW)
    try:
        return nn.Module.state_dict(fs, keep_vars=keep_vars)
    finally:
        _WALK.reset(token)


def _rank0_only(settings):
    return settings is not _RAW and getattr(settings.state_dict_config, "rank0_only", False)


def _unit_entries(fs, settings, dest, prefix, keep_vars):
    if settings is _RAW:
        nn.Module.state_dict(fs, destination=dest, prefix=prefix, keep_vars=keep_vars)
        return
    if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        _local_entries(fs, dest, prefix, keep_vars)
        return
    sharded = settings.state_dict_type is StateDictType.SHARDED_STATE_DICT
    with summon_unit(fs, rank0_only=_rank0_only(settings)) as shown:
        before = set(dest)
        nn.Module.state_dict(fs, destination=dest, prefix=prefix, keep_vars=keep_vars)
        if not shown:
            return
        fulls = {g.full.untyped_storage().data_ptr() for g in fs._unit.groups}
        fulls.discard(0)
        mesh = mesh_of(fs) if sharded else None
        for k in [k for k in dest if k not in before]:
            v = dest[k]
            if torch.is_tensor(v) and not is_dtensor(v) and \
                    v.untyped_storage().data_ptr() in fulls:
                # A view of the full buffer, which is freed when the unit reshards.
                dest[k] = to_dtensor(v, mesh) if sharded else v.detach().clone()


def _local_entries(fs, dest, prefix, keep_vars):
    nn.Module.state_dict(fs, destination=dest, prefix=prefix, keep_vars=keep_vars)
    unit = fs._unit
    if not unit.use_orig_params:
        return  # the flat shards are the registered parameters already
    shards = {g.shard.untyped_storage().data_ptr() for g in unit.groups}
    for k in [k for k, v in dest.items() if k.startswith(prefix) and torch.is_tensor(v)
              and v.untyped_storage().data_ptr() in shards]:
        del dest[k]  # the original parameters' pieces: replaced by the shards
    for g in unit.groups:
        dest[f"{prefix}{WRAPPED}.{flat_param_name(g.index)}"] = \
            g.shard if keep_vars else g.shard.detach()


# ---------------------------------------------------------------------------
# load_state_dict


def _targets(model, local):
    """Plain key -> (unit, group, parameter index, or None for a flat shard)."""
    out = OrderedDict()
    for path, fs in units_with_paths(model):
        if local:
            for g in fs._unit.groups:
                out[join(path, flat_param_name(g.index))] = (fs, g, None)
            continue
        for g, i, keys in alias_keys(fs, path):
            for k in keys:
                out[k] = (fs, g, i)
    return out


def _managed_ids(model):
    ids = set()
    for fs in fsdp_units(model):
        for g in fs._unit.groups:
            ids.add(id(g.shard))
            ids.update(id(p) for p in g.params)
    return ids


def _first(keys, limit=5):
    shown = ", ".join(f'"{k}"' for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def mismatch_error(what, missing, unexpected, errors):
    lines = [f"flatshard: error(s) loading {what}:"]
    if missing:
        lines.append(f"Missing key(s): {_first(missing)}.")
    if unexpected:
        lines.append(f"Unexpected key(s): {_first(unexpected)}.")
    lines += errors[:5] + ([f"... and {len(errors) - 5} more mismatches"]
                           if len(errors) > 5 else [])
    return StateDictError("\n\t".join(lines))


def load_state_dict(fs, state_dict, strict=True, assign=False):
    """FSDP.load_state_dict: validates everything first (names, shapes), then
    copies. Full tensors and DTensors are accepted in FULL and SHARDED mode
    alike; LOCAL takes the flat shards of the same wrapping and world size."""
    if not isinstance(strict, bool):
        raise bad_type("strict", strict, "True or False")
    if assign:
        raise not_built("assign", assign, "the parameters are shards of flat buffers and "
                        "cannot be replaced by the given tensors; pass assign=False (copies)")
    if not hasattr(state_dict, "keys"):
        raise bad_type("state_dict", state_dict, "a mapping of keys to tensors")
    units = fsdp_units(fs)
    busy = [u._unit.name for u in units if u._unit.c.state != "IDLE"]
    if busy:
        raise StateError(f"flatshard: load_state_dict() needs every unit idle, but units "
                         f"{busy} are in forward/backward or summon_full_params")
    settings = settings_of(fs)
    checked_config(settings, "state_dict_config")
    local = settings.state_dict_type is StateDictType.LOCAL_STATE_DICT
    targets = _targets(fs, local)
    managed = _managed_ids(fs)
    others = OrderedDict((k, v) for k, v in raw_state_dict(fs).items()
                         if id(v) not in managed)
    expected = list(targets) + [plain_key(k) for k in others]
    expected_set = set(expected)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected_set]
    errors = []
    for key, (_, g, i) in targets.items():
        if key in state_dict:
            want = (g.shard_numel,) if i is None else tuple(g.shapes[i])
            _check_shape(errors, key, state_dict[key], want, local)
    for k, cur in others.items():
        if plain_key(k) in state_dict and torch.is_tensor(cur):
            _check_shape(errors, plain_key(k), state_dict[plain_key(k)], tuple(cur.shape), False)
    if errors or (strict and (missing or unexpected)):
        raise mismatch_error("state_dict into the flatshard model", missing, unexpected, errors)

    _copy_into_shards(targets, state_dict)
    for u in units:  # a full buffer left live by a forward would be stale now
        if u._unit.c.is_unsharded and not u._unit.no_shard:
            u._unit.c.regather()  # the compute buffers, refreshed from the new shards
    rest = OrderedDict((k, state_dict[plain_key(k)]) for k in others
                       if plain_key(k) in state_dict)
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        rest._metadata = OrderedDict((n, meta[plain_key(n)]) for n, _ in fs.named_modules()
                                     if plain_key(n) in meta)
    nn.Module.load_state_dict(fs, rest, strict=False)
    return _IncompatibleKeys(missing, unexpected)


def _check_shape(errors, key, value, want, local):
    got = tuple(value.shape) if torch.is_tensor(value) else None
    if got is None:
        errors.append(f"{key}: expected a tensor of shape {list(want)}, got "
                      f"{type(value).__name__}")
    elif got != want:
        hint = (" (a local state dict loads only into the same wrapping on the same world "
                "size)" if local else "")
        errors.append(f"size mismatch for {key}: copying a param with shape {list(got)} from "
                      f"checkpoint, the shape in current model is {list(want)}{hint}.")


@torch.no_grad()
def _copy_into_shards(targets, state_dict):
    done = set()
    for key, (_, g, i) in targets.items():
        if key not in state_dict or (id(g), i) in done:
            continue  # a tied parameter's other names hold the same value
        done.add((id(g), i))
        value = whole(state_dict[key])
        shard = g.shard.detach()
        if i is None:
            shard.copy_(value)
            continue
        e = g.entries[i]
        shard.narrow(0, e.shard_offset, e.piece_numel).copy_(
            value.reshape(-1).narrow(0, e.param_offset, e.piece_numel))
