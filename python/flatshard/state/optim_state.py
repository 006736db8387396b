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
"""
import torch
import torch.distributed as dist

from ..errors import StateDictError, bad_type, bad_value, not_built
from ..fsdp.summon import all_gather_shard
from ..fsdp.unit import fsdp_units
from ..options import StateDictType
from .state_dict import (alias_keys, get_state_dict_type, mesh_of, plain_key, to_dtensor,
                         units_with_paths, whole)


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


def _held(model, optim, group):
    """(settings, a unit, [_Slot of each optimizer parameter, in its order])."""
    if not isinstance(optim, torch.optim.Optimizer):
        raise bad_type("optim", optim, "a torch.optim.Optimizer")
    settings = get_state_dict_type(model)
    units = fsdp_units(model)
    if group is not None and any(u._cfg.group is not group for u in units):
        raise bad_value("group", group, "it is not the process group the model is sharded "
                        "over", "pass group=None")
    slots = _slots(model)
    held = []
    for pg in optim.param_groups:
        for p in pg["params"]:
            if id(p) not in slots:
                raise bad_value("optim", type(optim).__name__, f"it holds a parameter of shape "
                                f"{list(p.shape)} that is not in the model",
                                "build the optimizer from the wrapped model's parameters()")
            held.append(slots[id(p)])
    return settings, units[0], held


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
    mesh = mesh_of(root) if kind is StateDictType.SHARDED_STATE_DICT else None
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
    if getattr(settings.optim_state_dict_config, "rank0_only", False) and \
            mesh is None and dist.get_rank(root._cfg.group) != 0:
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
        osd = _to_local(osd, optim, held)
    if load_directly:
        optim.load_state_dict(osd)
    return osd


def _from_rank0(osd, group):
    box = [osd if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def _to_local(osd, optim, held):
    if not isinstance(osd, dict) or "state" not in osd or "param_groups" not in osd:
        raise bad_type("optim_state_dict", osd, 'a dict with "state" and "param_groups" (from '
                       "FSDP.optim_state_dict)")
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
    groups, start = [], 0
    for pg, mine in zip(osd["param_groups"], optim.param_groups):
        n = len(mine["params"])
        groups.append({**{k: v for k, v in pg.items() if k != "params"},
                       "params": list(range(start, start + n))})
        start += n
    return {"state": state, "param_groups": groups}


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
        shard = torch.zeros(g.shard_numel, dtype=v.dtype)
        for i, key, st in present:
            e = g.entries[i]
            shard.narrow(0, e.shard_offset, e.piece_numel).copy_(_cut(whole(st[n]), g, i, key, n, errors))
        out[n] = shard
    return out


def _element_names(g, keys, saved):
    """Names of group g's per-element state, read off a parameter that is not
    0-dim: on a 0-dim one, a 0-dim value could be either (Adam's "step")."""
    for i, k in enumerate(keys):
        if len(g.shapes[i]) > 0 and k in saved:
            return {n for n, v in saved[k].items() if _per_element(v, g.shapes[i])}
    return set()


def _cut(value, g, i, key, name, errors):
    """Parameter i's piece (1-D) of its whole state value."""
    e = g.entries[i]
    if tuple(value.shape) != tuple(g.shapes[i]):
        errors.append(f"state {key}.{name} has shape {list(value.shape)}, the parameter "
                      f"{list(g.shapes[i])}")
        return torch.zeros(e.piece_numel, dtype=value.dtype)
    return value.reshape(-1).narrow(0, e.param_offset, e.piece_numel).clone()
