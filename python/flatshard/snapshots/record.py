"""What one rank's snapshot holds, as parts for the segment (engine/snapshot.h)
and back: the rank's fp32 parameter shards (FSDP1's flat parameters,
fully_shard's DTensor local tensors), its optimizer state (tensors, scalars,
the param groups' settings), the random number generators' states and each
registered Stateful object's state_dict.

The tensors go as their own bytes (copied straight from their storage on the
snapshot's thread, and read straight back into it); everything else goes in
one record, the last part, written with torch.save and read with
torch.load(weights_only=True): loading it runs no code from the segment.
"""
import io
import random
import sys

import torch

from ..errors import ConfigError, NotBuiltError

RECORD_VERSION = 1


def local(t):
    """The tensor whose storage holds this rank's part of t."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - every supported torch has it
        return t
    return t._local_tensor if isinstance(t, DTensor) else t


def nbytes(t):
    return t.numel() * t.element_size()


def _checked(t, what):
    if t.device.type != "cpu":
        raise NotBuiltError(
            f"flatshard.Snapshots: {what} is on {t.device}; snapshots of device tensors (a "
            "device-to-host copy on its own stream) are not built in this version: keep the "
            "sharded parameters and optimizer state on the host (CPUOffload) or use "
            "flatshard.save_checkpoint")
    if not t.is_contiguous():
        raise ConfigError(f"flatshard.Snapshots: {what} is not contiguous; its bytes cannot be "
                          "copied as one part")
    return t


def params_of(optimizer):
    return [p for g in optimizer.param_groups for p in g["params"]]


def capture(model, optimizer, stateful, step, world_size):
    """-> (tensors, record bytes): the tensors to copy (in a fixed order the
    record describes) and the record."""
    tensors, shards, opt_state = [], [], []
    for name, p in model.named_parameters():
        t = _checked(local(p).detach(), f"parameter '{name}'")
        shards.append((name, str(t.dtype), tuple(t.shape)))
        tensors.append(t)
    for i, p in enumerate(params_of(optimizer)):
        entry = {}
        for key, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                t = _checked(local(v).detach(), f"optimizer state '{key}' of parameter {i}")
                entry[key] = ("tensor", str(t.dtype), tuple(t.shape), len(tensors),
                              local(v) is not v)
                tensors.append(t)
            else:
                entry[key] = ("value", v)
        opt_state.append(entry)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    record = {
        "version": RECORD_VERSION, "step": step, "world_size": world_size,
        "shards": shards, "optim_state": opt_state, "param_groups": groups,
        "rng": _rng_states(),
        "stateful": {name: obj.state_dict() for name, obj in stateful.items()},
    }
    buf = io.BytesIO()
    torch.save(record, buf)
    return tensors, buf.getvalue()


def load_record(data, where):
    try:
        record = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:  # a record that is not plain data is refused, not run
        raise ConfigError(f"flatshard.Snapshots: the record of {where} cannot be read as plain "
                          f"data: {e}") from None
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
        raise ConfigError(f"flatshard.Snapshots: the record of {where} is not a version "
                          f"{RECORD_VERSION} snapshot record")
    return record


def targets(model, optimizer, record, where):
    """The tensors to read the parts into, in the record's order, the
    optimizer state made where it does not exist yet (before the first step
    after a restart); a model or optimizer that differs from the one saved is
    refused, naming the first difference."""
    out = []
    named = list(model.named_parameters())
    if [n for n, _ in named] != [s[0] for s in record["shards"]]:
        raise ConfigError(f"flatshard.Snapshots: {where} holds parameters "
                          f"{[s[0] for s in record['shards']][:4]}..., this model has "
                          f"{[n for n, _ in named][:4]}...: not the model that was saved")
    for (name, p), (_, dtype, shape) in zip(named, record["shards"]):
        t = local(p).detach()
        if str(t.dtype) != dtype or tuple(t.shape) != tuple(shape):
            raise ConfigError(f"flatshard.Snapshots: parameter '{name}': {where} holds "
                              f"{dtype} {tuple(shape)}, this rank's shard is {t.dtype} "
                              f"{tuple(t.shape)}")
        out.append(_checked(t, f"parameter '{name}'"))
    params = params_of(optimizer)
    if len(params) != len(record["optim_state"]):
        raise ConfigError(f"flatshard.Snapshots: {where} holds optimizer state for "
                          f"{len(record['optim_state'])} parameters, the optimizer has "
                          f"{len(params)}")
    slots = {}
    for i, (p, entry) in enumerate(zip(params, record["optim_state"])):
        state = optimizer.state[p]
        for key, desc in entry.items():
            if desc[0] == "value":
                state[key] = desc[1]
                continue
            _, dtype, shape, index, distributed = desc
            have = state.get(key)
            if have is None or str(local(have).dtype) != dtype or \
                    tuple(local(have).shape) != tuple(shape):
                dt = getattr(torch, dtype.split(".")[-1])
                have = (torch.zeros_like(p, dtype=dt) if distributed else
                        torch.zeros(shape, dtype=dt))
                if tuple(local(have).shape) != tuple(shape):
                    raise ConfigError(f"flatshard.Snapshots: optimizer state '{key}' of "
                                      f"parameter {i}: {where} holds {tuple(shape)}, the "
                                      f"parameter's shard is {tuple(local(have).shape)}")
                state[key] = have
            slots[index] = _checked(local(have), f"optimizer state '{key}' of parameter {i}")
    out.extend(slots[k] for k in sorted(slots))
    return out


def apply(optimizer, stateful, record):
    """The rest of the record put back: the param groups' settings, the
    generators, the Stateful objects."""
    for g, saved in zip(optimizer.param_groups, record["param_groups"]):
        g.update(saved)
    _set_rng_states(record["rng"])
    for name, obj in stateful.items():
        if name not in record["stateful"]:
            raise ConfigError(f"flatshard.Snapshots: stateful object '{name}' is not in the "
                              f"snapshot (it holds {sorted(record['stateful'])})")
        obj.load_state_dict(record["stateful"][name])


def _rng_states():
    py = random.getstate()
    out = {"torch": torch.get_rng_state(), "python": [py[0], list(py[1]), py[2]]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        out["numpy"] = [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss),
                        float(gauss)]
    return out


def _set_rng_states(rng):
    torch.set_rng_state(rng["torch"])
    v, state, gauss = rng["python"]
    random.setstate((v, tuple(state), gauss))
    if "cuda" in rng:
        torch.cuda.set_rng_state_all(rng["cuda"])
    np = sys.modules.get("numpy")
    if "numpy" in rng and np is not None:
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        np.random.set_state((kind, keys.numpy().astype("uint32"), pos, has_gauss, gauss))
