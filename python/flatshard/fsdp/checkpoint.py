"""Sharded checkpoints through torch.distributed.checkpoint (DCP), written
atomically and loadable on any number of ranks.

Layout of a checkpoint directory `path`:
  path/LATEST              name of the newest complete checkpoint, replaced
                           atomically (write, fsync, rename) as a save's last step
  path/ckpt-000007/        one DCP checkpoint: "model.<name>", "optim.state.<name>.<state>",
                           "optim.param_groups...", "extra.<key>"
  path/.tmp-ckpt-000008/   a save in progress, or one killed midway: never
                           read, removed by the next save
A save writes into the temporary directory, renames it once DCP has written
every rank's files and the metadata, then points LATEST at it, and only then
removes older checkpoints: a crash or kill at any moment leaves LATEST
naming a complete checkpoint. Model entries are SHARDED_STATE_DICT DTensors,
so DCP reshards them for whatever world size loads them. Loading trusts
none of these files: see [Note: untrusted files] in safe_load.py.
"""
import os
import shutil
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ..errors import bad_type, bad_value
from ..options import StateDictType
from ..state.checkpoint_dir import LATEST, PREFIX, TMP, latest_checkpoint
from ..state.safe_load import dcp_load, is_plain, reader
from .optim_state import optim_state_dict, optim_state_dict_to_load
from .state_dict import mismatch_error, state_dict_type, units_of

def _group(model):
    """The group the checkpoint is written over: the model's, or under
    HYBRID_SHARD every rank (DCP writes each replicated chunk once)."""
    units = units_of(model)
    if any(u._cfg.hybrid is not None for u in units):
        return dist.group.WORLD
    return units[0]._cfg.group


def _state(model, optimizer, extra):
    state = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = optim_state_dict(model, optimizer)
    if extra:
        state["extra"] = dict(extra)
    return state


def _check_extra(extra):
    if extra is None:
        return
    if not isinstance(extra, Mapping) or not all(isinstance(k, str) and "." not in k
                                                 for k in extra):
        raise bad_type("extra", extra, "a dict with str keys without dots (values: tensors or "
                       "plain data, the same on every rank)")
    for k, v in extra.items():
        if not _terminal(v):  # DCP would split it into entries of its own
            raise bad_value(f"extra[{k!r}]", type(v).__name__, "dicts, and lists holding "
                            "tensors or dicts, are not stored whole",
                            "store it as a tuple, or as several keys")
        if not torch.is_tensor(v) and not is_plain(v):  # load_checkpoint would refuse it
            raise bad_value(f"extra[{k!r}]", type(v).__name__, "load_checkpoint unpickles "
                            "only plain data (numbers, strings, tuples, lists and dicts of "
                            "them, tensors), never other objects", "store its fields instead")


def save_checkpoint(path, model, optimizer=None, extra=None):
    """Save `model` (and `optimizer`, and the `extra` dict) as a new sharded
    checkpoint under directory `path`; every rank calls it. Returns the
    checkpoint's directory once LATEST names it."""
    import torch.distributed.checkpoint as dcp  # here: importing it costs about a second
    _check_extra(extra)
    group = _group(model)
    rank = dist.get_rank(group)
    box = [None]
    if rank == 0:
        box[0] = _begin(path)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(box[0], BaseException):
        raise box[0]
    name = box[0]
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = _state(model, optimizer, extra)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(os.path.join(path, TMP + name)),
             process_group=group)
    box = [None]
    if rank == 0:
        box[0] = _commit(path, name)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(box[0], BaseException):
        raise box[0]
    return os.path.join(path, name)


def _begin(path):
    """Rank 0: clear a killed save's leftovers and pick the new name (or the error)."""
    try:
        os.makedirs(path, exist_ok=True)
        numbers = [0]
        for entry in os.listdir(path):
            if entry.startswith(TMP):
                shutil.rmtree(os.path.join(path, entry))
            elif entry.startswith(PREFIX) and entry[len(PREFIX):].isdigit():
                numbers.append(int(entry[len(PREFIX):]))
        return f"{PREFIX}{max(numbers) + 1:06d}"
    except OSError as e:
        return e


def _commit(path, name):
    try:
        os.rename(os.path.join(path, TMP + name), os.path.join(path, name))
        tmp = os.path.join(path, LATEST + ".tmp")
        with open(tmp, "w") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, LATEST))
        fd = os.open(path, os.O_RDONLY)  # make the renames durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        for entry in os.listdir(path):  # older checkpoints: LATEST no longer names them
            if entry.startswith(PREFIX) and entry != name:
                shutil.rmtree(os.path.join(path, entry), ignore_errors=True)
        return None
    except OSError as e:
        return e


def load_checkpoint(path, model, optimizer=None):
    """Load what save_checkpoint wrote (on any number of ranks) from `path`
    (a checkpoint directory, or the directory above it: the latest complete
    one is taken, see latest_checkpoint) into `model` and `optimizer`;
    returns the saved `extra` dict ({} if none). Every name, shape and dtype
    is checked against the checkpoint first: a mismatch raises
    StateDictError naming the first mismatching keys, and nothing is loaded.
    Nothing in the files is trusted ([Note: untrusted files] in
    safe_load.py): what a checkpoint may not hold raises UnsafeFileError."""
    ckpt = latest_checkpoint(path)
    storage = reader(ckpt)
    saved = storage.read_metadata().state_dict_metadata
    fresh = optimizer is not None and not optimizer.state
    if fresh:
        _init_optim_state(optimizer)
    try:
        with state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = _template(model, optimizer, saved)
            _check(ckpt, saved, state, optimizer is not None)
            dcp_load(state, storage, process_group=_group(model))
            model.load_state_dict(state["model"])
            if optimizer is not None:
                optimizer.load_state_dict(
                    optim_state_dict_to_load(model, optimizer, state["optim"]))
    except BaseException:
        if fresh:
            optimizer.state.clear()  # as it was: a made-up first step would change training
        raise
    return state.get("extra", {})


def _template(model, optimizer, saved):
    """The state dict DCP loads into: the model's own, plus an entry for each
    saved extra."""
    extra = {}
    for key, md in saved.items():
        if key.startswith("extra."):
            extra[key[len("extra."):]] = (torch.empty(md.size, dtype=md.properties.dtype)
                                          if hasattr(md, "size") else None)
    state = _state(model, optimizer, extra)
    if optimizer is not None:  # parameters that never had state stay without
        had = {k[len("optim.state."):].rsplit(".", 1)[0] for k in saved
               if k.startswith("optim.state.")}
        state["optim"]["state"] = {k: v for k, v in state["optim"]["state"].items() if k in had}
    return state


def _init_optim_state(optim):
    """A fresh optimizer has no state to load into: one step with zero
    gradients and zero learning rates creates it without moving a parameter
    (what torch.distributed.checkpoint.state_dict does)."""
    if optim.state:
        return
    params = [p for pg in optim.param_groups for p in pg["params"]]
    if any(p.grad is not None for p in params):
        raise bad_value("optimizer", type(optim).__name__, "it has gradients but no state",
                        "call optimizer.zero_grad(set_to_none=True) before load_checkpoint")
    for p in params:
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    lrs = [pg.get("lr") for pg in optim.param_groups]
    for pg in optim.param_groups:
        if "lr" in pg:
            pg["lr"] = torch.tensor(0.0) if torch.is_tensor(pg["lr"]) else 0.0
    optim.step()
    for pg, lr in zip(optim.param_groups, lrs):
        if lr is not None:
            pg["lr"] = lr
    optim.zero_grad(set_to_none=True)


def _terminal(value):
    """DCP's flattening rule: a list is one entry unless it holds tensors or dicts."""
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    return not any(torch.is_tensor(v) or (isinstance(v, (Mapping, list)) and not _terminal(v))
                   for v in value)


def _leaves(obj, path=(), out=None):
    """A nested state dict's entries under DCP's flattened keys."""
    out = {} if out is None else out
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _leaves(v, path + (str(k),), out)
    elif _terminal(obj):
        out[".".join(map(str, path))] = obj
    else:
        for i, v in enumerate(obj):
            _leaves(v, path + (i,), out)
    return out


def _check(ckpt, saved, state, with_optim):
    mine = _leaves({k: v for k, v in state.items() if k != "extra"})
    scope = ("model.", "optim.") if with_optim else ("model.",)
    missing = [k for k in mine if k not in saved]
    unexpected = [k for k, md in saved.items() if k.startswith(scope) and hasattr(md, "size")
                  and k not in mine]
    errors = []
    for k, t in mine.items():
        md = saved.get(k)
        if md is None or not hasattr(md, "size") or not torch.is_tensor(t):
            continue
        if tuple(md.size) != tuple(t.shape):
            errors.append(f"shape mismatch for {k}: {list(md.size)} in the checkpoint, "
                          f"{list(t.shape)} in the model")
        elif md.properties.dtype != t.dtype:
            errors.append(f"dtype mismatch for {k}: {md.properties.dtype} in the checkpoint, "
                          f"{t.dtype} in the model")
    if missing or unexpected or errors:
        raise mismatch_error(f"checkpoint {ckpt!r}", missing, unexpected, errors)
