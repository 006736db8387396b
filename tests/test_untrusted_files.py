"""Files written by someone who can write into a checkpoint directory (or a
DiskOffload directory): a pickled payload in .metadata or in an extra entry
never runs (the marker file it would create never appears), and a name read
from a file or a state dict (LATEST, a data file .metadata lists, a state
dict's disk_offload.file) that leads out of its directory, by "..", an
absolute path or a symbolic link, is never read, adopted or deleted. Each is
refused with UnsafeFileError naming the file or key and why, by
load_checkpoint, consolidate (and its command line) and load_state_dict."""
import copy
import json
import os
import pickle
import re
import shutil
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

import flatshard
import flatshard.optim as fo
from flatshard import FSDP, StateDictType
from flatshard.__main__ import main
from flatshard.errors import UnsafeFileError
from flatshard.state import manifest
from parity import policy
from toy_models import build


# How pickle names the payload's callable, open: io.open, builtins.open, or
# from Python 3.13 on _io.open (the refusal quotes it).
OPEN = r"(_io|io|builtins)\.open\b"


class Payload:
    """Unpickles as open(marker, "w"): the marker exists iff the payload ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _dcp_save(state, path):
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


def _edit_metadata(ckpt, edit):
    """Rewrite ckpt/.metadata (written by DCP just before) after edit(metadata)."""
    path = os.path.join(ckpt, ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)
    with open(path, "wb") as f:
        pickle.dump(metadata, f)


def _add_payload(marker):
    def edit(metadata):  # an attribute DCP never uses: the load goes on as if nothing ran
        metadata.storage_meta.modules = [Payload(marker)]
    return edit


@pytest.fixture
def ckpt(tmp_path):
    _dcp_save({"model": {"w": torch.arange(6.0)}}, tmp_path / "ckpt")
    return str(tmp_path / "ckpt")


@pytest.fixture
def opened(monkeypatch):
    """Every file DCP opens while the test runs."""
    paths = []
    create_stream = FileSystem.create_stream

    def record(self, path, mode):
        paths.append(os.path.realpath(path))
        return create_stream(self, path, mode)
    monkeypatch.setattr(FileSystem, "create_stream", record)
    return paths


# ---------------------------------------------------------------------------
# payloads: .metadata and extra


def test_metadata_payload_never_runs_in_consolidate(ckpt, tmp_path, capsys):
    marker = tmp_path / "ran"
    _edit_metadata(ckpt, _add_payload(marker))
    why = r"\.metadata is not loaded: it refers to " + OPEN
    with pytest.raises(UnsafeFileError, match=re.escape(ckpt + "/") + why):
        flatshard.consolidate(ckpt, tmp_path / "out.pt")
    with pytest.raises(SystemExit) as e:
        main(["consolidate", ckpt, str(tmp_path / "out.safetensors")])
    assert e.value.code == 1
    assert ".metadata is not loaded" in capsys.readouterr().err
    assert not marker.exists()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no output, not even a partial one


def _model():
    return FSDP(build(seed=0, nested=True), auto_wrap_policy=policy("nested"))


def _load_extra(path):
    return flatshard.load_checkpoint(path, _model())


def _load(path):
    """The refusal's message, or what was loaded (as text: it may be a payload's
    result, which does not pickle)."""
    try:
        return f"loaded {_load_extra(path)!r}"
    except UnsafeFileError as e:
        return str(e)


def _save(path):
    flatshard.save_checkpoint(path, _model(), extra={"step": 3})


def _save_dcp(path, extra, marker=None):
    """A DCP checkpoint load_checkpoint reads: the SHARDED model and `extra`,
    plus extra["note"], a Payload, with a marker. Made here: sending a payload
    to the ranks would unpickle it."""
    model = _model()
    if marker is not None:
        extra = {**extra, "note": Payload(marker)}
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "extra": extra}, checkpoint_id=path)


def _refused_at_save(path, marker):
    try:
        flatshard.save_checkpoint(path, _model(), extra={"note": Payload(marker)})
    except flatshard.ConfigError as e:
        return str(e)


def test_metadata_payload_never_runs_in_load_checkpoint(dist_pool, tmp_path):
    path, marker = str(tmp_path / "run"), tmp_path / "ran"
    dist_pool(2).run(_save, path)
    ckpt = flatshard.latest_checkpoint(path)
    _edit_metadata(ckpt, _add_payload(marker))
    # whoever can write the files can write the manifest too: its CRCs find damage, not intent
    files = json.load(open(os.path.join(ckpt, manifest.MANIFEST)))["files"]
    files.update(manifest.records(ckpt, [".metadata"], 0))
    manifest.write(ckpt, files, 2)
    for got in dist_pool(2).run(_load, path):
        assert not marker.exists()
        assert re.search(r"ckpt-000001/\.metadata is not loaded: it refers to " + OPEN, got), got


def test_extra_payload_never_runs_and_plain_extras_still_load(dist_pool, tmp_path):
    marker = tmp_path / "ran"
    plain = {"step": 3, "names": ("a", "b"), "lr": [0.1, 0.2], "seen": torch.ones(2)}
    dist_pool(2).run(_save_dcp, str(tmp_path / "plain"), plain)
    dist_pool(2).run(_save_dcp, str(tmp_path / "evil"), {"step": 3}, str(marker))
    for got in dist_pool(2).run(_load_extra, str(tmp_path / "plain")):
        assert got.keys() == plain.keys() and torch.equal(got.pop("seen"), plain["seen"])
        assert got == {k: v for k, v in plain.items() if k != "seen"}
    for got in dist_pool(2).run(_load, str(tmp_path / "evil")):
        assert not marker.exists()
        assert f"flatshard: {tmp_path / 'evil'}/__" in got and ".distcp (entry 'extra.note') is " \
            "not loaded: it holds a pickled object that is not plain data" in got, got
    # save_checkpoint refuses what load_checkpoint would (pickling runs nothing)
    for got in dist_pool(2).run(_refused_at_save, str(tmp_path / "run"), str(marker)):
        assert "extra['note']='Payload' is not allowed; load_checkpoint unpickles only " \
            "plain data" in got, got
    assert not marker.exists()


# ---------------------------------------------------------------------------
# names that lead out of their directory: DCP's data files, .metadata, LATEST


@pytest.mark.parametrize("how", ["up", "absolute", "symlink", "metadata_symlink"])
def test_data_files_outside_the_checkpoint_are_never_read(ckpt, tmp_path, opened, how):
    victim = tmp_path / "victim.distcp"  # a valid copy: followed, it would load fine
    shard = os.path.join(ckpt, "__0_0.distcp")
    shutil.copy(shard, victim)
    if how == "up" or how == "absolute":
        name = "../victim.distcp" if how == "up" else str(victim)

        def edit(metadata):
            for info in metadata.storage_data.values():
                info.relative_path = name
        _edit_metadata(ckpt, edit)
        match = f"{ckpt}/.metadata (entry 'model.w') names {name!r}"
    elif how == "symlink":
        os.remove(shard)
        os.symlink(victim, shard)
        match = f"names '__0_0.distcp': it leads through a symbolic link to '{victim}'"
    else:
        victim = tmp_path / "victim.metadata"
        os.rename(os.path.join(ckpt, ".metadata"), victim)
        os.symlink(victim, os.path.join(ckpt, ".metadata"))
        match = f"checkpoint '{ckpt}' names '.metadata': it leads through a symbolic link " \
                f"to '{victim}'"
    with pytest.raises(UnsafeFileError, match=re.escape(match)):
        flatshard.consolidate(ckpt, tmp_path / "out.pt")
    assert str(victim) not in opened and not (tmp_path / "out.pt").exists()


def _outside(root, how):
    """root/run holding a LATEST that names root/outside (a valid checkpoint)."""
    run = os.path.join(root, "run")
    os.makedirs(run)
    name = {"up": "../outside", "absolute": os.path.join(root, "outside"),
            "symlink": "ckpt-000009"}[how]
    if how == "symlink":
        os.symlink(os.path.join(root, "outside"), os.path.join(run, name))
    with open(os.path.join(run, "LATEST"), "w") as f:
        f.write(name + "\n")
    return run, name


@pytest.mark.parametrize("how", ["up", "absolute", "symlink"])
def test_latest_never_leads_out_of_the_checkpoint_directory(ckpt, tmp_path, opened, how):
    os.rename(ckpt, tmp_path / "outside")
    run, name = _outside(str(tmp_path), how)
    match = re.escape(f"flatshard: '{run}/LATEST' names '{name}'")
    with pytest.raises(UnsafeFileError, match=match):
        flatshard.latest_checkpoint(run)
    with pytest.raises(UnsafeFileError, match=match):
        flatshard.consolidate(run, tmp_path / "out.pt")
    assert not opened and not (tmp_path / "out.pt").exists()


def _load_outside(root):
    if dist.get_rank() == 0:
        _outside(root, "up")
    dist.barrier()
    return _load(os.path.join(root, "run"))


def test_load_checkpoint_never_follows_latest_out(dist_pool, tmp_path):
    dist_pool(2).run(_save_dcp, str(tmp_path / "outside"), {"step": 3})
    for got in dist_pool(2).run(_load_outside, str(tmp_path)):
        assert f"flatshard: '{tmp_path}/run/LATEST' names '../outside': it goes up " in got, got


# ---------------------------------------------------------------------------
# DiskOffload: the generation file a state dict names


def _step(opt, params):
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.parametrize("how", ["up", "absolute", "symlink"])
def test_disk_offload_never_adopts_a_file_outside_its_directory(tmp_path, how):
    state = tmp_path / "state"
    params = [torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(3))]
    opt = fo.AdamW(params, offload=fo.DiskOffload(str(state)))
    _step(opt, params)
    sd = copy.deepcopy(opt.state_dict())
    kept = sd["disk_offload"]["file"]
    del opt  # releases the directory
    victim = tmp_path / "gen-000000001-0123456789ab.bin"  # the size the layout needs
    victim.write_bytes(bytes(range(8 * 8)))
    name = {"up": f"../{victim.name}", "absolute": str(victim),
            "symlink": "gen-000000009-0123456789ab.bin"}[how]
    if how == "symlink":
        os.symlink(victim, state / name)
    sd["disk_offload"]["file"] = name
    params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = fo.AdamW(params, offload=fo.DiskOffload(str(state)))
    with pytest.raises(UnsafeFileError, match=re.escape(f"the state dict's disk_offload.file "
                                                        f"names '{name}'")):
        opt.load_state_dict(sd)
        # What an adopted file goes through: read as the moments, deleted once released.
        _step(opt, params)
        opt.state_dict()
    assert victim.read_bytes() == bytes(range(8 * 8))
    assert sorted(os.listdir(state)) == sorted(["LOCK", kept] + ([name] if how == "symlink"
                                                                else []))
