"""Optimizer state keyed by the plain model's parameter names: torch FSDP1's
FSDP.optim_state_dict / FSDP.optim_state_dict_to_load.

The optimizer holds either flat shards (use_orig_params=False: each state
tensor is shard-sized) or the original parameters' pieces of them
(use_orig_params=True: each state tensor is piece-sized). Either way one
shard-sized tensor per (unit, group, state name) is assembled, gathered once
and cut into whole per-parameter tensors:
  FULL_STATE_DICT     {"state": {name: {"step": ..., "exp_avg": whole tensor}},
                       "param_groups": [{..., "params": [names]}]}
  SHARDED_STATE_DICT  the same with DTensors (Shard(0)) for the per-element
                      state, for torch.distributed.checkpoint
  LOCAL_STATE_DICT    optim.state_dict() as it is (same wrapping, same world)
Per-element state is any state tensor shaped like the parameter the
optimizer holds; 0-dim tensors and other values (Adam's "step") are copied
as they are. Loading cuts each rank's pieces out of the whole (or DTensor)
values; the DTensors' gathers are its only collectives.

torch's older API (deprecated there, still in many scripts) is the same
dicts: full_optim_state_dict / sharded_optim_state_dict give the FULL /
SHARDED form whatever the model's state dict type; shard_full_,
scatter_full_ (rank 0's dict broadcast) and flatten_sharded_optim_state_dict
give what optim.load_state_dict takes, with IDs from optim, the deprecated
optim_input or model.parameters() (then the parameter groups are the saved
ones, as torch's); rekey_optim_state_dict swaps names and IDs.
"""
import copy
import warnings

import torch
import torch.distributed as dist

from .. import _C
from ..errors import StateDictError, bad_type, bad_value, not_built
from ..options import OptimStateKeyType, StateDictType, normalize_enum
from ..tensors import dtype_code
from .state_dict import (alias_keys, checked_config, get_state_dict_type, mesh_of, plain_key,
                         to_dtensor, units_with_paths, whole, units_of)
from .summon import all_gather_shard
from .unit import fsdp_units


class _Slot:
    """One parameter the optimizer may hold. kind "flat": group g's shard
    (keys: its parameters' names); "piece": parameter i of group g; "plain":
    a parameter flatshard does not manage (whole on every rank)."""

    def __init__(self, kind, keys, fs=None, g=None, i=None, group_keys=None):
        self.kind, self.keys, self.fs, self.g, self.i = kind, keys, fs, g, i
        self.group_keys = group_keys  # names of every parameter of group g

    def params(self):
        """(parameter index in the group, name) pairs this slot covers."""
        if self.kind == "flat":
            return list(enumerate(self.keys))
        return [(self.i, self.keys[0])]


def _slots(model):
    """id(parameter) -> _Slot, for everything an optimizer of `model` may hold."""
    out = {}
    for path, fs in units_with_paths(model):
        names = {}
        for g, i, keys in alias_keys(fs, path):
            names.setdefault(id(g), []).append(keys[0])  # a tied parameter: its first name
        for g in fs._unit.groups:
            out[id(g.shard)] = _Slot("flat", names[id(g)], fs, g, group_keys=names[id(g)])
            for i, p in enumerate(g.params):
                out[id(p)] = _Slot("piece", [names[id(g)][i]], fs, g, i, names[id(g)])
    for name, p in model.named_parameters():
        out.setdefault(id(p), _Slot("plain", [plain_key(name)]))
    return out


def _check_process_group(units, group):
    if group is not None and any(u._cfg.group is not group for u in units):
        raise bad_value("group", group, "it is not the process group the model is sharded "
                        "over", "pass group=None")


def _slots_of(model, params, arg, what):
    """[_Slot of each of `params`, in their order]; arg/what name where the
    parameters came from, for the error."""
    slots = _slots(model)
    held = []
    for p in params:
        if id(p) not in slots:
            raise bad_value(arg, what, f"it holds a parameter of shape {list(p.shape)} that is "
                            "not in the model", "build the optimizer from the wrapped model's "
                            "parameters()")
        held.append(slots[id(p)])
    return held


def _optim_params(optim):
    return [p for pg in optim.param_groups for p in pg["params"]]


def _held(model, optim, group):
    """(settings, a unit, [_Slot of each optimizer parameter, in its order])."""
    if not isinstance(optim, torch.optim.Optimizer):
        raise bad_type("optim", optim, "a torch.optim.Optimizer")
    settings = get_state_dict_type(model)
    checked_config(settings, "optim_state_dict_config")
    units = fsdp_units(model)
    _check_process_group(units, group)
    return settings, units[0], _slots_of(model, _optim_params(optim), "optim",
                                         type(optim).__name__)


def _per_element(value, shape):
    return torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) == tuple(shape)


def _copy(v):
    return v.detach().clone() if torch.is_tensor(v) else v


# ---------------------------------------------------------------------------
# optim_state_dict


def optim_state_dict(model, optim, optim_state_dict=None, group=None):
    settings, root, held = _held(model, optim, group)
    osd = optim.state_dict() if optim_state_dict is None else optim_state_dict
    kind = settings.state_dict_type
    if kind is StateDictType.LOCAL_STATE_DICT:
        return osd
    rank0_only = getattr(settings.optim_state_dict_config, "rank0_only", False)
    return _keyed_by_name(root, held, osd, kind is StateDictType.SHARDED_STATE_DICT, rank0_only)


def _keyed_by_name(root, held, osd, sharded, rank0_only):
    """optim.state_dict() (`osd`, its parameters `held`) -> the state keyed by
    the plain model's names: whole values, or DTensors when `sharded`."""
    mesh = mesh_of(root) if sharded else None
    by_group = {}  # id(group) -> [(slot, its state)], to gather each group once
    for idx, slot in enumerate(held):
        if slot.kind != "plain":
            by_group.setdefault(id(slot.g), []).append((slot, osd["state"].get(idx)))
    wholes = {}  # name -> whole per-parameter state
    for entries in by_group.values():
        wholes.update(_gather_group(entries, mesh))
    state = {}
    for idx, slot in enumerate(held):
        if slot.kind == "plain":
            st = osd["state"].get(idx)
            if st is not None:
                state[slot.keys[0]] = {n: to_dtensor(v, mesh) if mesh is not None and
                                       torch.is_tensor(v) and v.dim() > 0 else _copy(v)
                                       for n, v in st.items()}
            continue
        for _, key in slot.params():
            if key in wholes:
                state[key] = wholes[key]
    groups = []
    for pg in osd["param_groups"]:
        names = [k for idx in pg["params"] for _, k in held[idx].params()]
        groups.append({**{k: v for k, v in pg.items() if k != "params"}, "params": names})
    if rank0_only and mesh is None and dist.get_rank(root._cfg.group) != 0:
        return {}  # torch FSDP: only rank 0 gets the full optimizer state
    return {"state": state, "param_groups": groups}


def _gather_group(entries, mesh):
    """One flat group's optimizer state -> {name: {state name: whole value}}.
    entries: [(slot, state)], the shard's or each held parameter's."""
    g, fs = entries[0][0].g, entries[0][0].fs
    local, other, order = {}, {}, {}  # shard-sized per-element state, the rest, names
    held = []
    for slot, st in entries:
        if not st:
            continue
        for i, _ in slot.params():
            held.append((i, slot.keys[0] if slot.kind == "piece" else slot.keys[i]))
        for n, v in st.items():
            order[n] = None
            if _per_element(v, (g.shard_numel,) if slot.kind == "flat" else
                            g.params[slot.i].shape):
                if slot.kind == "flat":
                    local[n] = v.detach()
                    continue
                if n not in local:
                    local[n] = torch.zeros(g.shard_numel, dtype=v.dtype)
                g.piece(local[n], slot.i, False).copy_(v.detach().reshape(-1))
            else:
                for i, _ in slot.params():
                    other.setdefault(n, {})[i] = v
    fulls = {n: all_gather_shard(fs, t) for n, t in local.items()}
    out = {}
    for i, key in held:
        e = g.entries[i]
        st = {}
        for n in order:
            if n in fulls:
                v = fulls[n].narrow(0, e.flat_offset, e.numel).view(g.shapes[i])
                st[n] = to_dtensor(v, mesh) if mesh is not None else v.clone()
            elif i in other.get(n, {}):
                st[n] = _copy(other[n][i])
        out[key] = st
    return out


# ---------------------------------------------------------------------------
# optim_state_dict_to_load


def optim_state_dict_to_load(model, optim, optim_state_dict, is_named_optimizer=False,
                             load_directly=False, group=None):
    if is_named_optimizer:
        raise not_built("is_named_optimizer", is_named_optimizer, "NamedOptimizer state is "
                        "not supported; pass the state of a torch.optim.Optimizer")
    settings, root, held = _held(model, optim, group)
    osd = optim_state_dict
    kind = settings.state_dict_type
    if kind is StateDictType.FULL_STATE_DICT and \
            getattr(settings.optim_state_dict_config, "rank0_only", False):
        osd = _from_rank0(osd, root._cfg.group)
    if kind is not StateDictType.LOCAL_STATE_DICT:
        osd = _to_local(_whole_sharded_tensors(osd), optim, held)
    if load_directly:
        optim.load_state_dict(osd)
    return osd


def _sharded_tensor_type():
    try:
        from torch.distributed._shard.sharded_tensor import ShardedTensor
    except ImportError:  # a torch without it cannot have made one
        return None
    return ShardedTensor


def _whole_sharded_tensors(osd):
    """osd with each ShardedTensor value made whole on every rank: what
    torch.distributed.checkpoint's load_sharded_optimizer_state_dict returns
    (values chunked over the ranks along dim 0), which torch's
    optim_state_dict_to_load accepts beside flatshard's own DTensors. Each
    rank places its shards in a zero tensor of the whole size and the ranks
    add them up (the shards do not overlap: exact); every rank walks the
    same keys in the same order, so the collectives line up."""
    kind = _sharded_tensor_type()
    state = osd.get("state") if isinstance(osd, dict) else None
    if kind is None or not isinstance(state, dict) or not any(
            isinstance(v, kind) for st in state.values() if isinstance(st, dict)
            for v in st.values()):
        return osd
    new = {}
    for key in sorted(state, key=str):
        st = state[key]
        if isinstance(st, dict):
            st = {n: _whole_of(v) if isinstance(v, kind) else v
                  for n, v in sorted(st.items(), key=lambda kv: str(kv[0]))}
        new[key] = st
    return {**osd, "state": {k: new[k] for k in state}}


def _whole_of(st):
    md = st.metadata()
    out = torch.zeros(tuple(md.size), dtype=md.tensor_properties.dtype)
    for shard in st.local_shards():
        at = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets,
                                                   shard.metadata.shard_sizes))
        out[at] = shard.tensor.to(out.device)
    dist.all_reduce(out, group=getattr(st, "_process_group", None))
    return out


def _from_rank0(osd, group):
    box = [osd if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _to_local(osd, optim, held):
    """A state keyed by names (whole values or DTensors) -> this rank's
    optim.state_dict() for the parameters `held` (IDs: positions in it).
    optim None (torch's optim_input path): the parameter groups are the
    saved ones, each listing the sorted IDs of its parameters."""
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise bad_type("optim_state_dict", osd, 'a dict with "state" and "param_groups" (from '
                       "FSDP.optim_state_dict)")
    if optim is not None:
        _check_groups(osd["param_groups"], optim, held)
    errors = []
    state = {}
    for idx, slot in enumerate(held):
        st = _local_state(slot, osd["state"], errors)
        if st:
            state[idx] = st
    if errors:
        raise StateDictError("flatshard: optimizer state does not match the model:\n\t" +
                             "\n\t".join(errors[:5]))
    if optim is None:
        return {"state": state, "param_groups": _groups_by_id(osd["param_groups"], held)}
    groups, start = [], 0
    for pg, mine in zip(osd["param_groups"], optim.param_groups):
        n = len(mine["params"])
        groups.append({**{k: v for k, v in pg.items() if k != "params"},
                       "params": list(range(start, start + n))})
        start += n
    return {"state": state, "param_groups": groups}


def _groups_by_id(saved, held):
    """The saved parameter groups with each name replaced by the ID of the
    parameter holding it (a flat shard holds several), sorted, as torch's."""
    ids = {k: idx for idx, slot in enumerate(held) for _, k in slot.params()}
    unknown = [k for pg in saved for k in pg["params"] if k not in ids]
    if unknown:
        raise StateDictError(f"flatshard: optimizer state names parameters {unknown[:5]} that "
                             "are not among the parameters the optimizer is given "
                             "(optim_input, or model.parameters())")
    return [{**{k: v for k, v in pg.items() if k != "params"},
             "params": sorted({ids[k] for k in pg["params"]})} for pg in saved]


def _check_groups(saved, optim, held):
    start, problems = 0, []
    if len(saved) != len(optim.param_groups):
        problems.append(f"the state has {len(saved)} parameter groups, the optimizer "
                        f"{len(optim.param_groups)}")
    for j, (pg, mine) in enumerate(zip(saved, optim.param_groups)):
        n = len(mine["params"])
        want = [k for slot in held[start:start + n] for _, k in slot.params()]
        start += n
        want_set, saved_set = set(want), set(pg["params"])
        extra = [k for k in pg["params"] if k not in want_set]
        missing = [k for k in want if k not in saved_set]
        if extra or missing:
            problems.append(f"parameter group {j}: missing {missing[:5]}, unexpected {extra[:5]}")
    if problems:
        raise StateDictError("flatshard: optimizer state does not match the optimizer's "
                             "parameter groups: " + "; ".join(problems))


def _local_state(slot, saved, errors):
    """This rank's state for one optimizer parameter, cut from whole values."""
    if slot.kind == "plain":
        st = saved.get(slot.keys[0])
        return {n: _copy(whole(v)) for n, v in st.items()} if st else None
    g = slot.g
    present = [(i, k, saved[k]) for i, k in slot.params() if k in saved]
    if not present:
        return None
    elementwise = _element_names(g, slot.group_keys, saved)
    if slot.kind == "piece":
        i, key, st = present[0]
        return {n: _cut(whole(v), g, i, key, n, errors).view(g.params[i].shape)
                if n in elementwise else _copy(v) for n, v in st.items()}
    if len(present) != len(g.params):
        have = {k for _, k, _ in present}
        errors.append(f"state of {[k for k in slot.keys if k not in have][:5]} is missing, "
                      f"but their flat group has state for {sorted(have)[:5]}")
        return None
    out = {}
    for n, v in present[0][2].items():
        if n not in elementwise:
            out[n] = _copy(v)  # the same for every parameter of a flat group
            continue
        # every parameter's piece of its whole value, in one C pass that also
        # zeroes the padding (and a piece whose value had the wrong shape)
        shard = torch.empty(g.shard_numel, dtype=v.dtype)
        values, pieces = [], []
        for i, key, st in present:
            value = _flat(whole(st[n]), g, i, key, n, errors)
            e = g.entries[i]
            if value is not None and e.piece_numel > 0:
                values.append(value)
                pieces.append((value.data_ptr(), dtype_code(value.dtype), e.param_offset,
                               e.shard_offset, e.piece_numel))
        pieces.sort(key=lambda p: p[3])
        _C.gather_pieces(shard.data_ptr(), dtype_code(shard.dtype), g.shard_numel, pieces)
        out[n] = shard
    return out


def _element_names(g, keys, saved):
    """Names of group g's per-element state, read off a parameter that is not
    0-dim: on a 0-dim one, a 0-dim value could be either (Adam's "step")."""
    for i, k in enumerate(keys):
        if len(g.shapes[i]) > 0 and k in saved:
            return {n for n, v in saved[k].items() if _per_element(v, g.shapes[i])}
    return set()


def _flat(value, g, i, key, name, errors):
    """Parameter i's whole state value as a flat, contiguous host tensor;
    None (and an error noted) when its shape is not the parameter's."""
    if tuple(value.shape) != tuple(g.shapes[i]):
        errors.append(f"state {key}.{name} has shape {list(value.shape)}, the parameter "
                      f"{list(g.shapes[i])}")
        return None
    return value.detach().reshape(-1).cpu().contiguous()


def _cut(value, g, i, key, name, errors):
    """Parameter i's piece (1-D) of its whole state value."""
    e = g.entries[i]
    flat = _flat(value, g, i, key, name, errors)
    if flat is None:
        return torch.zeros(e.piece_numel, dtype=value.dtype)
    return flat.narrow(0, e.param_offset, e.piece_numel).clone()


# ---------------------------------------------------------------------------
# torch FSDP1's older optimizer-state API (deprecated in torch, still in many
# scripts): the same dicts, from the functions above.


def _warn_legacy(name, new):
    warnings.warn(f"FullyShardedDataParallel.{name} is deprecated in torch and replaced by "
                  f"FullyShardedDataParallel.{new}; flatshard keeps it with torch's meaning",
                  FutureWarning, stacklevel=3)


def _input_params(model, optim_input, optim):
    """The parameters in ID order, as torch assigns IDs: from optim_input (a
    deprecated argument: an iterable of parameters or of parameter groups)
    when given, else from `optim` when given, else model.parameters()."""
    if optim_input is not None:
        warnings.warn("The optim_input argument is deprecated (in torch too): the parameters "
                      "are read from optim, or model.parameters(); you may remove it",
                      FutureWarning, stacklevel=3)
        if isinstance(optim_input, (torch.Tensor, dict, str)):
            raise bad_type("optim_input", optim_input, "an iterable of parameters or of "
                           "parameter groups (dicts with 'params')")
        try:
            items = list(optim_input)
        except TypeError:
            raise bad_type("optim_input", optim_input, "an iterable of parameters or of "
                           "parameter groups (dicts with 'params')") from None
        if not items:
            raise bad_value("optim_input", optim_input, "it is empty",
                            "pass the parameters given to the optimizer, or None")
        if all(isinstance(x, torch.Tensor) for x in items):
            return items
        if all(isinstance(x, dict) and "params" in x for x in items):
            out = []
            for pg in items:
                ps = pg["params"]
                out += [ps] if isinstance(ps, torch.Tensor) else list(ps)
            return out
        raise bad_type("optim_input", optim_input, "an iterable of parameters or of parameter "
                       "groups (dicts with 'params'), not a mix")
    if optim is not None:
        if not isinstance(optim, torch.optim.Optimizer):
            raise bad_type("optim", optim, "a torch.optim.Optimizer or None")
        return _optim_params(optim)
    return list(model.parameters())


def _units(model, group):
    units = units_of(model)
    _check_process_group(units, group)
    return units


def full_optim_state_dict(model, optim, optim_input=None, rank0_only=True, group=None):
    """FSDP.full_optim_state_dict: FULL, whatever the model's state dict type."""
    _warn_legacy("full_optim_state_dict", "optim_state_dict")
    if not isinstance(optim, torch.optim.Optimizer):
        raise bad_type("optim", optim, "a torch.optim.Optimizer")
    if not isinstance(rank0_only, bool):
        raise bad_type("rank0_only", rank0_only, "True or False")
    units = _units(model, group)
    held = _slots_of(model, _input_params(model, optim_input, optim),
                     "optim_input" if optim_input is not None else "optim", type(optim).__name__)
    return _keyed_by_name(units[0], held, optim.state_dict(), False, rank0_only)


def sharded_optim_state_dict(model, optim, group=None):
    """FSDP.sharded_optim_state_dict: the SHARDED form, whatever the model's
    state dict type; DTensors where torch gives ShardedTensors."""
    _warn_legacy("sharded_optim_state_dict", "optim_state_dict")
    if not isinstance(optim, torch.optim.Optimizer):
        raise bad_type("optim", optim, "a torch.optim.Optimizer")
    units = _units(model, group)
    held = _slots_of(model, _optim_params(optim), "optim", type(optim).__name__)
    return _keyed_by_name(units[0], held, optim.state_dict(), True, False)


def _load_legacy(osd, model, optim_input, optim, rank0_only=False, group=None):
    units = _units(model, group)
    if rank0_only:
        osd = _from_rank0(osd, units[0]._cfg.group)
    using_input = optim_input is not None or optim is None  # torch's choice of ID source
    held = _slots_of(model, _input_params(model, optim_input, optim),
                     "optim_input" if optim_input is not None else "optim",
                     type(optim).__name__ if optim is not None else optim_input)
    return _to_local(osd, None if using_input else optim, held)


def shard_full_optim_state_dict(full_optim_state_dict, model, optim_input=None, optim=None):
    """FSDP.shard_full_optim_state_dict: every rank holds the full dict; each
    cuts its own part, with no communication beyond gathering DTensors."""
    _warn_legacy("shard_full_optim_state_dict", "optim_state_dict_to_load")
    return _load_legacy(full_optim_state_dict, model, optim_input, optim)


def flatten_sharded_optim_state_dict(sharded_optim_state_dict, model, optim):
    """FSDP.flatten_sharded_optim_state_dict: from sharded_optim_state_dict's
    DTensors to what optim.load_state_dict takes."""
    _warn_legacy("flatten_sharded_optim_state_dict", "optim_state_dict_to_load")
    if not isinstance(optim, torch.optim.Optimizer):
        raise bad_type("optim", optim, "a torch.optim.Optimizer")
    return _load_legacy(sharded_optim_state_dict, model, None, optim)


def scatter_full_optim_state_dict(full_optim_state_dict, model, optim_input=None, optim=None,
                                  group=None):
    """FSDP.scatter_full_optim_state_dict: only rank 0's dict is read (the
    others may pass None); it is broadcast, and each rank cuts its part."""
    _warn_legacy("scatter_full_optim_state_dict", "optim_state_dict_to_load")
    return _load_legacy(full_optim_state_dict, model, optim_input, optim, rank0_only=True,
                        group=group)


def rekey_optim_state_dict(optim_state_dict, optim_state_key_type, model, optim_input=None,
                           optim=None):
    """FSDP.rekey_optim_state_dict: parameter names <-> parameter IDs, for
    the wrapped model or the plain one. IDs: positions in optim_input, or
    optim's param_groups, or model.parameters(). Returns the dict itself when
    its keys are already of that type."""
    kind = normalize_enum("optim_state_key_type", optim_state_key_type, OptimStateKeyType,
                          "OptimStateKeyType")
    osd = optim_state_dict
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise bad_type("optim_state_dict", osd, 'a dict with "state" and "param_groups"')
    by_name = [type(k) is str for k in osd["state"]]
    by_id = [type(k) is int for k in osd["state"]]
    if (any(by_name) and not all(by_name)) or (any(by_id) and not all(by_id)):
        raise bad_value("optim_state_dict", f"<keys {list(osd['state'])[:5]}>",
                        "its state keys must all be names or all be IDs")
    if (kind is OptimStateKeyType.PARAM_NAME and all(by_name)) or \
            (kind is OptimStateKeyType.PARAM_ID and all(by_id)):
        return osd
    params = _input_params(model, optim_input, optim) if optim_input is not None or \
        optim is None else _optim_params(optim)
    slots = _slots(model)
    names = []
    for p in params:
        slot = slots.get(id(p))
        if slot is None:
            raise bad_value("optim" if optim is not None else "optim_input", "the parameters",
                            f"a parameter of shape {list(p.shape)} is not in the model")
        if len(slot.keys) != 1:  # a flat shard (use_orig_params=False): as torch
            raise StateDictError("flatshard: each parameter should map to one parameter name "
                                 f"but got {len(slot.keys)}: {slot.keys[:5]} (a flat "
                                 "parameter); rekey against the plain model or a model wrapped "
                                 "with use_orig_params=True")
        names.append(slot.keys[0])
    new = {}
    if kind is OptimStateKeyType.PARAM_NAME:  # IDs -> names
        bad = [k for k in osd["state"] if not 0 <= k < len(names)]
        if bad:
            raise StateDictError(f"flatshard: optimizer state IDs {bad[:5]} are not among the "
                                 f"{len(names)} parameters")
        new["state"] = {names[k]: st for k, st in osd["state"].items()}
        new["param_groups"] = copy.deepcopy(osd["param_groups"])
        for pg in new["param_groups"]:
            pg["params"] = sorted(names[k] for k in pg["params"])
        return new
    ids = {}
    for i, n in enumerate(names):
        ids.setdefault(n, i)
    unknown = [k for k in list(osd["state"]) + [k for pg in osd["param_groups"]
                                                for k in pg["params"]] if k not in ids]
    if unknown:
        raise StateDictError(f"flatshard: optimizer state names {unknown[:5]}, which are not "
                             "parameters of the model (or not given to the optimizer)")
    new["state"] = {ids[k]: st for k, st in osd["state"].items()}
    new["param_groups"] = copy.deepcopy(osd["param_groups"])
    for pg in new["param_groups"]:
        pg["params"] = sorted(ids[k] for k in pg["params"])
    return new
