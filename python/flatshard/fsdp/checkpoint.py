"""Sharded checkpoints through torch.distributed.checkpoint (DCP), written
atomically and loadable on any number of ranks.

Layout of a checkpoint directory `path`:
  path/LATEST              name of the newest complete checkpoint, replaced
                           atomically (write, fsync, rename) as a save's last step
  path/ckpt-000007/        one DCP checkpoint: "model.<name>", "optim.state.<name>.<state>",
                           "optim.param_groups...", "extra.<key>", "flatshard.manifest";
                           and manifest.json: every file's size, CRC-32C and writing
                           rank ([Note: checkpoint manifest] in state/manifest.py)
  path/.tmp-ckpt-000008/   a save in progress, or one killed midway: never
                           read, removed by the next save
A save writes into the temporary directory, renames it once DCP has written
every rank's files and the metadata and rank 0 the manifest, then points
LATEST at it, and only then removes older checkpoints: a crash or kill at
any moment leaves LATEST naming a complete checkpoint. Model entries are
SHARDED_STATE_DICT DTensors (the FSDP1 wrapper's; fully_shard's state dict
as it is), so DCP reshards them for whatever world size loads them. Loading
checks every file against the manifest first (checkpoint_check.py), and
trusts none of them: see [Note: untrusted files] in safe_load.py.
"""
import contextlib
import os
import shutil
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..errors import bad_type, bad_value
from ..options import StateDictType
from ..state import manifest
from ..state.checkpoint_dir import LATEST, PREFIX, TMP, latest_checkpoint
from ..state.safe_load import METADATA, dcp_load, is_plain, reader
from .checkpoint_check import verified
from .optim_state import optim_state_dict, optim_state_dict_to_load
from .state_dict import mismatch_error, state_dict_type, units_of
from .unit import fsdp_units


def _group(model):
    """The group the checkpoint is written over: the FSDP1 wrapper's, or
    under HYBRID_SHARD every rank (DCP writes each replicated chunk once);
    a fully_shard model's one 1-D mesh's, or every rank."""
    units = fsdp_units(model)
    if not units:
        meshes = {v.device_mesh for v in _dtensor_state(model).values()
                  if isinstance(v, DTensor)}
        mesh = meshes.pop() if len(meshes) == 1 else None
        return mesh.get_group() if mesh is not None and mesh.ndim == 1 else dist.group.WORLD
    if any(u._cfg.hybrid is not None for u in units):
        return dist.group.WORLD
    return units[0]._cfg.group


def _dtensor_state(model):
    """The state dict of a model sharded by fully_shard (flatshard's or torch's)."""
    state = model.state_dict()
    if not any(isinstance(v, DTensor) for v in state.values()):
        units_of(model)  # raises naming the model: it is neither
    return state


def _sharded(model):
    """Where the model's state_dict() is the SHARDED one."""
    if fsdp_units(model):
        return state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
    return contextlib.nullcontext()


def _state(model, optimizer, extra):
    if fsdp_units(model):
        state = {"model": model.state_dict()}
        if optimizer is not None:
            state["optim"] = optim_state_dict(model, optimizer)
    else:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        state = {"model": _dtensor_state(model)}
        if optimizer is not None:
            state["optim"] = get_optimizer_state_dict(model, optimizer)
    if extra:
        state["extra"] = dict(extra)
    return state


def _load_optim(model, optimizer, saved):
    if fsdp_units(model):
        optimizer.load_state_dict(optim_state_dict_to_load(model, optimizer, saved))
    else:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        set_optimizer_state_dict(model, optimizer, saved)


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
    """Save `model` (wrapped by FullyShardedDataParallel, or sharded by
    fully_shard), and `optimizer`, and the `extra` dict, as a new sharded
    checkpoint under directory `path`; every rank calls it. The checkpoint
    holds manifest.json: every file's size, CRC-32C and writing rank, which
    load_checkpoint checks. Returns the checkpoint's directory once LATEST
    names it."""
    import torch.distributed.checkpoint as dcp  # here: importing it costs about a second
    _check_extra(extra)
    group = _group(model)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    box = [None]
    if rank == 0:
        box[0] = _begin(path)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(box[0], BaseException):
        raise box[0]
    name = box[0]
    tmp = os.path.join(path, TMP + name)
    with _sharded(model):
        state = _state(model, optimizer, extra)
    state[manifest.MARKER[0]] = {manifest.MARKER[1]: manifest.VERSION}
    writer = _writer(tmp)
    dcp.save(state, storage_writer=writer, process_group=group)
    try:
        mine = manifest.records(tmp, writer.written, rank)  # each rank checksums its own files
    except OSError as e:
        mine = e
    files = [None] * world if rank == 0 else None
    dist.gather_object(mine, files, dst=dist.get_global_rank(group, 0), group=group)
    box = [None]
    if rank == 0:
        box[0] = _commit(path, name, files)
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    if isinstance(box[0], BaseException):
        raise box[0]
    return os.path.join(path, name)


def _writer(path):
    """DCP's FileSystemWriter of `path` that keeps the names of the files
    this rank wrote (.written)."""
    from torch.distributed.checkpoint import FileSystemWriter

    class Writer(FileSystemWriter):
        written = ()

        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)
            future.wait()
            self.written = sorted({r.storage_data.relative_path for r in future.value()})
            return future
    return Writer(path)


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


def _commit(path, name, files):
    """Rank 0: write the manifest of every rank's files and .metadata, then
    commit: rename, point LATEST at it, remove older ones (or the error)."""
    for part in files:
        if isinstance(part, BaseException):
            return part
    try:
        saved = os.path.join(path, TMP + name)
        every = {k: v for part in files for k, v in part.items()}
        every.update(manifest.records(saved, [METADATA], 0))  # DCP's coordinator wrote it
        manifest.write(saved, every, len(files))
        os.rename(saved, os.path.join(path, name))
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
    returns the saved `extra` dict ({} if none). Every file is checked
    against the checkpoint's manifest first (size and CRC-32C, the ranks
    sharing the reading): a damaged checkpoint raises CheckpointDamaged on
    every rank, naming each file, its rank's part and what is wrong, and
    nothing is loaded (a checkpoint without a manifest loads unverified, with
    a warning). Then every name, shape and dtype is checked: a mismatch
    raises StateDictError naming the first mismatching keys, and nothing is
    loaded. Nothing in the files is trusted ([Note: untrusted files] in
    safe_load.py): what a checkpoint may not hold raises UnsafeFileError."""
    ckpt = latest_checkpoint(path)
    group = _group(model)
    storage = reader(ckpt, verified(ckpt, group))
    saved = storage.read_metadata().state_dict_metadata
    fresh = optimizer is not None and not optimizer.state
    if fresh:
        _init_optim_state(optimizer)
    try:
        with _sharded(model):
            state = _template(model, optimizer, saved)
            _check(ckpt, saved, state, optimizer is not None)
            dcp_load(state, storage, process_group=group)
            model.load_state_dict(state["model"])
            if optimizer is not None:
                _load_optim(model, optimizer, state["optim"])
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
