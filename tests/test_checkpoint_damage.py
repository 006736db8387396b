"""A damaged checkpoint is named and never loaded: save_checkpoint on 2 ranks
(the FSDP1 wrapper and fully_shard), then a copy of it with one damage each
(a data file truncated, deleted, one byte of it flipped, one byte of
.metadata flipped, the manifest deleted or garbled, a data file the manifest
does not list) is loaded on 2 ranks: every rank raises the same
CheckpointDamaged (an Exception) naming the file, its rank's part and what
is wrong, and the model's shards and the optimizer are as before the load.
The undamaged checkpoint loads bit-equal. As the contrast, torch's own
dcp.load takes the flipped byte without a word and loads a different model.
A checkpoint without a manifest (plain DCP) loads with one warning, and a
file lost from it is named instead of DCP's CheckpointException (a
BaseException). consolidate checks the manifest too."""
import json
import os
import re
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor

import flatshard
from flatshard import FSDP, StateDictType, fully_shard
from flatshard.state import manifest
from test_diagnostics import documented

TIMEOUT = 240


def _model(api, seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32))
    if api == "fsdp1":
        return FSDP(model, device_id=torch.device("cpu"))
    fully_shard(model[0])
    return fully_shard(model)


def _shards(model):
    """This rank's shards of every parameter, copied."""
    return [(p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for p in model.parameters()]


def _full(model):
    """Every parameter whole (a collective), by name."""
    if isinstance(model, FSDP):
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            return dict(model.state_dict())
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def _sharded_state(model):
    if isinstance(model, FSDP):
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            return {"model": model.state_dict()}
    return {"model": model.state_dict()}


def _save(path, api):
    model = _model(api, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 32, generator=torch.Generator().manual_seed(dist.get_rank())))\
        .square().mean().backward()
    opt.step()
    where = flatshard.save_checkpoint(path, model, opt, extra={"step": 1})
    return where, _full(model)


def _try_load(ckpt, api):
    """-> (what load_checkpoint raised, as (type, text), or "loaded"; whether
    the shards and the optimizer were left as before)."""
    model = _model(api, seed=5)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    before = _shards(model)
    try:
        flatshard.load_checkpoint(ckpt, model, opt)
        got = "loaded"
    except Exception as e:  # CheckpointDamaged is an Exception: this catches it
        got = (type(e).__name__, str(e))
    untouched = all(torch.equal(a, b) for a, b in zip(before, _shards(model))) and not opt.state
    return got, untouched


def _load_all(copies, api, good, flipped):
    out = {name: _try_load(ckpt, api) for name, ckpt in copies.items()}
    model = _model(api, seed=5)
    extra = flatshard.load_checkpoint(good, model, torch.optim.AdamW(model.parameters()))
    loaded = _full(model)
    plain = _model(api, seed=5)  # torch's own load of the flipped byte: no word
    state = _sharded_state(plain)
    dcp.load(state, checkpoint_id=flipped)
    plain.load_state_dict(state["model"])
    return out, extra, loaded, _full(plain)


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def _middle_of_largest_item(ckpt, name):
    """An offset inside the bytes of the largest entry DCP stored in file `name`."""
    metadata = flatshard.state.safe_load.read_metadata(ckpt)
    infos = [i for i in metadata.storage_data.values() if i.relative_path == name]
    info = max(infos, key=lambda i: i.length)
    return info.offset + info.length // 2


def _damaged_copies(ckpt, root):
    """{damage: a copy of checkpoint `ckpt` with it}; rank 1's first data file is the victim."""
    victim = "__1_0.distcp"
    size = os.path.getsize(os.path.join(ckpt, victim))

    def truncate(d):
        os.truncate(os.path.join(d, victim), size // 2)

    def unlist(d):
        files = json.load(open(os.path.join(d, manifest.MANIFEST)))["files"]
        del files[victim]
        manifest.write(d, files, 2)  # sealed again: only the listing is wrong

    damages = {
        "truncate": truncate,
        "delete": lambda d: os.remove(os.path.join(d, victim)),
        "flip_data": lambda d: _flip(os.path.join(d, victim),
                                     _middle_of_largest_item(d, victim)),
        "flip_metadata": lambda d: _flip(os.path.join(d, ".metadata"),
                                         os.path.getsize(os.path.join(d, ".metadata")) // 2),
        "delete_manifest": lambda d: os.remove(os.path.join(d, manifest.MANIFEST)),
        "garble_manifest": lambda d: _flip(os.path.join(d, manifest.MANIFEST), 40),
        "unlist": unlist,
    }
    copies = {}
    for name, damage in damages.items():
        copies[name] = os.path.join(root, name)
        shutil.copytree(ckpt, copies[name])
        damage(copies[name])
    return copies, size


@pytest.mark.parametrize("api", ["fsdp1", "fully_shard"])
def test_damaged_checkpoints_are_named_and_never_loaded(dist_pool, tmp_path, api):
    pool = dist_pool(2)
    ckpt, saved = pool.run(_save, str(tmp_path / "run"), api, timeout=TIMEOUT)[0]
    files = json.load(open(os.path.join(ckpt, manifest.MANIFEST)))["files"]
    assert {n: r["rank"] for n, r in files.items() if n.endswith(".distcp")} == \
        {"__0_0.distcp": 0, "__1_0.distcp": 1}  # each rank's own files, and .metadata
    assert files[".metadata"]["rank"] == 0 and "manifest.json" not in files
    for name, rec in files.items():  # what the manifest says is what is on disk
        assert (rec["size"], rec["crc32c"]) == \
            (os.path.getsize(os.path.join(ckpt, name)),
             f"{manifest.file_crc32c(os.path.join(ckpt, name))[1]:08x}")
    copies, size = _damaged_copies(ckpt, str(tmp_path))
    results = pool.run(_load_all, copies, api, ckpt, copies["flip_data"], timeout=TIMEOUT)
    out, extra, loaded, plain = results[0]
    assert all(r[0] == out for r in results[1:])  # every rank raised the same error

    victim = os.path.join(copies["truncate"], "__1_0.distcp")
    want = {
        "truncate": f"{victim} (rank 1's part): it is truncated: {size // 2} bytes, "
                    f"expected {size}",
        "delete": f"(rank 1's part): it is missing (expected {size} bytes)",
        "flip_data": f"__1_0.distcp (rank 1's part): its CRC-32C is ",
        "flip_metadata": ".metadata (rank 0's part): its CRC-32C is ",
        "delete_manifest": "manifest.json (rank 0's part): it is missing, and .metadata says "
                           "this checkpoint was saved with one",
        "garble_manifest": "manifest.json (rank 0's part): it ",
        "unlist": "__1_0.distcp (in no rank's part): .metadata names it but manifest.json "
                  "does not",
    }
    for damage, text in want.items():
        (kind, message), untouched = out[damage]
        assert kind == "CheckpointDamaged", (damage, kind, message)
        assert message.startswith(f"flatshard: checkpoint {copies[damage]!r} is damaged and "
                                  "nothing of it was loaded: "), message
        assert text in message and "Load another checkpoint" in message, (damage, message)
        assert untouched, damage  # shards as before, the optimizer still fresh
    assert "expected " + files["__1_0.distcp"]["crc32c"] in out["flip_data"][0][1]
    if api == "fsdp1":  # docs/troubleshooting.md shows it, with its own path and CRCs
        def normal(text, ckpt):
            return re.sub(r"CRC-32C is \w{8}, expected \w{8}", "CRC-32C is C, expected E",
                          text.replace(ckpt, "/ckpt/run/ckpt-000001")).strip()
        assert normal(documented("checkpoint-damaged"), "/ckpt/run/ckpt-000001") == \
            normal("CheckpointDamaged: " + out["flip_data"][0][1], copies["flip_data"])

    assert extra == {"step": 1}  # the undamaged checkpoint: bit-equal
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)
    # torch's own load takes the flipped byte silently: the reason for the manifest
    assert plain.keys() == saved.keys()
    assert not all(torch.equal(plain[k], saved[k]) for k in saved)

    with pytest.raises(flatshard.CheckpointDamaged, match="its CRC-32C is "):
        flatshard.consolidate(copies["flip_data"], tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def _save_plain(path):
    model = _model("fsdp1", seed=0)
    dcp.save(_sharded_state(model), checkpoint_id=path)


def _load_plain(good, lost):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            flatshard.load_checkpoint(good, _model("fsdp1", seed=5))
    try:
        flatshard.load_checkpoint(lost, _model("fsdp1", seed=5))
        got = "loaded"
    except Exception as e:
        got = (type(e).__name__, str(e))
    return [str(w.message) for w in seen if "manifest" in str(w.message)], got


def test_checkpoints_without_a_manifest_load_with_a_warning(dist_pool, tmp_path):
    good, lost = str(tmp_path / "good"), str(tmp_path / "lost")
    dist_pool(2).run(_save_plain, good, timeout=TIMEOUT)
    shutil.copytree(good, lost)
    os.remove(os.path.join(lost, "__1_0.distcp"))
    for seen, (kind, message) in dist_pool(2).run(_load_plain, good, lost, timeout=TIMEOUT):
        assert len(seen) == 1 and "has no manifest.json" in seen[0], seen  # once
        assert "its files cannot be verified" in seen[0]
        # DCP's CheckpointException (a BaseException) comes out as CheckpointDamaged
        assert kind == "CheckpointDamaged", message
        assert f"reading {os.path.join(lost, '__1_0.distcp')}: FileNotFoundError" in message
