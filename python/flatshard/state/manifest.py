"""A checkpoint's manifest: every file save_checkpoint wrote, its size, its
CRC-32C and the rank that wrote it, so that a damaged checkpoint is named and
never loaded.

[Note: checkpoint manifest] `manifest.json` is plain JSON, written atomically
into the checkpoint before the directory is committed:
    {"format": FORMAT, "version": 1, "world_size": 2,
     "files": {".metadata": {"size": 1234, "crc32c": "8a9136aa", "rank": 0},
               "__1_0.distcp": {...}, ...},
     "files_crc32c": "..."}        the CRC-32C of "files" as canonical JSON
Each rank checksums the files it wrote; rank 0 adds .metadata and writes the
manifest. A checkpoint saved with a manifest also holds the DCP entry MARKER,
so a deleted manifest is told from a checkpoint written before manifests
existed (those load unverified, with a warning).

Before anything of the checkpoint is read, every file of the manifest is
checked: present, of its size, of its CRC-32C; the files are shared out
between the loading ranks (each reads its share once), and .metadata is
checked by every rank, which then reads it to check that every data file it
names is in the manifest. The CRC guards against damage (a truncated copy, a
lost file, a flipped bit), not against someone who rewrites files and
manifest alike: see [Note: untrusted files] in safe_load.py.

Imports: errors, _C (the CRC) and safe_load; no process group here (the
ranks' exchange is fsdp/checkpoint.py's).
"""
import json
import os
import warnings

from .._C import crc32c
from ..errors import CheckpointDamaged
from . import safe_load

MANIFEST = "manifest.json"
FORMAT = "flatshard checkpoint manifest"
VERSION = 1
MARKER = ("flatshard", "manifest")  # {"flatshard": {"manifest": VERSION}} in the saved state
_CHUNK_BYTES = 8 << 20
_RANK0 = {"rank": 0}  # who writes .metadata (DCP's coordinator) and the manifest
_warned = set()  # checkpoints without a manifest already warned about


def file_crc32c(path):
    """-> (size in bytes, CRC-32C) of the file at `path`, read in chunks."""
    buf = bytearray(_CHUNK_BYTES)
    view = memoryview(buf)
    crc = size = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = crc32c(view[:n], crc)
            size += n
    return size, crc


def records(ckpt, names, rank):
    """{name: record} for the files `names` of `ckpt` that `rank` wrote."""
    out = {}
    for name in names:
        size, crc = file_crc32c(os.path.join(ckpt, name))
        out[name] = {"size": size, "crc32c": f"{crc:08x}", "rank": rank}
    return out


def _seal(files):
    return f"{crc32c(json.dumps(files, sort_keys=True).encode()):08x}"


def write(ckpt, files, world_size):
    """Write ckpt/manifest.json for `files` ({name: record}) atomically."""
    files = dict(sorted(files.items()))
    body = {"format": FORMAT, "version": VERSION, "world_size": world_size, "files": files,
            "files_crc32c": _seal(files)}
    path = os.path.join(ckpt, MANIFEST)
    with open(path + ".tmp", "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _problem(name, record, what):
    return {"file": name, "rank": None if record is None else record["rank"], "what": what}


def _read(ckpt):
    """-> (files, None), (None, None) without a manifest, or (None, problem)."""
    path = os.path.join(ckpt, MANIFEST)
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, _problem(MANIFEST, _RANK0, f"it cannot be read as JSON ({e})")
    files = body.get("files") if isinstance(body, dict) else None
    if not isinstance(body, dict) or body.get("format") != FORMAT or \
            body.get("version") != VERSION or not isinstance(files, dict):
        return None, _problem(MANIFEST, _RANK0, f"it is not a {FORMAT} of version {VERSION}")
    if body.get("files_crc32c") != _seal(files):
        return None, _problem(MANIFEST, _RANK0, f"its CRC-32C is {_seal(files)}, it records "
                              f"{body.get('files_crc32c')!r} (its bytes changed)")
    for name, rec in files.items():  # a sealed manifest saved by another writer
        if not isinstance(rec, dict) or not isinstance(rec.get("size"), int) or \
                not isinstance(rec.get("rank"), int) or not isinstance(rec.get("crc32c"), str):
            return None, _problem(MANIFEST, _RANK0, f"its entry for {name!r} is not a record")
        safe_load.inside(ckpt, name, repr(path))
    return files, None


def _check(ckpt, name, rec):
    """The problem with file `name` against its record, or None."""
    try:
        size = os.stat(os.path.join(ckpt, name)).st_size
    except FileNotFoundError:
        return _problem(name, rec, f"it is missing (expected {rec['size']} bytes)")
    if size != rec["size"]:
        how = "truncated" if size < rec["size"] else "grown"
        return _problem(name, rec, f"it is {how}: {size} bytes, expected {rec['size']}")
    size, crc = file_crc32c(os.path.join(ckpt, name))
    if size != rec["size"] or f"{crc:08x}" != rec["crc32c"]:
        return _problem(name, rec, f"its CRC-32C is {crc:08x}, expected {rec['crc32c']} "
                        "(its bytes changed)")
    return None


def share(files, rank, world_size):
    """The data files `rank` of `world_size` checks: the largest first to the
    least loaded rank, the same split on every rank."""
    load, mine = [0] * world_size, []
    for name in sorted((n for n in files if n != safe_load.METADATA),
                       key=lambda n: (-files[n]["size"], n)):
        r = min(range(world_size), key=lambda i: (load[i], i))
        load[r] += files[name]["size"]
        if r == rank:
            mine.append(name)
    return mine


def check(ckpt, rank=0, world_size=1):
    """This rank's part of the check of checkpoint directory `ckpt` (all of
    it with the defaults): -> (DCP Metadata or None, problems). Without a
    manifest the checkpoint is not verified: a warning, once per checkpoint."""
    files, problem = _read(ckpt)
    if problem is not None:
        return None, [problem]
    if files is None:
        metadata = safe_load.read_metadata(ckpt)
        if MARKER[0] + "." + MARKER[1] in metadata.state_dict_metadata:
            return None, [_problem(MANIFEST, _RANK0, "it is missing, and .metadata says this "
                                   "checkpoint was saved with one")]
        if os.path.realpath(ckpt) not in _warned:
            _warned.add(os.path.realpath(ckpt))
            warnings.warn(f"flatshard: checkpoint {os.fspath(ckpt)!r} has no {MANIFEST} (it was "
                          "written before flatshard checked checkpoints, or by plain "
                          "torch.distributed.checkpoint): its files cannot be verified; a "
                          "damaged file may load without a word", stacklevel=4)
        return metadata, []
    if safe_load.METADATA not in files:
        return None, [_problem(safe_load.METADATA, _RANK0, f"it is not in {MANIFEST}")]
    problems = [p for name in [safe_load.METADATA] + share(files, rank, world_size)
                if (p := _check(ckpt, name, files[name])) is not None]
    if problems and problems[0]["file"] == safe_load.METADATA:
        return None, problems
    metadata = safe_load.read_metadata(ckpt)
    for name in sorted({info.relative_path for info in (metadata.storage_data or {}).values()}):
        if name not in files:
            problems.append(_problem(name, None, f".metadata names it but {MANIFEST} does not"))
    return metadata, problems


def damaged(ckpt, problems):
    """The CheckpointDamaged naming every problem (a list from check())."""
    parts = []
    for p in sorted(problems, key=lambda p: p["file"]):
        part = f"rank {p['rank']}'s part" if p["rank"] is not None else "in no rank's part"
        parts.append(f"{os.path.join(ckpt, p['file'])} ({part}): {p['what']}")
    return CheckpointDamaged(
        f"flatshard: checkpoint {os.fspath(ckpt)!r} is damaged and nothing of it was loaded: "
        f"{'; '.join(parts)}. Load another checkpoint (an older copy of it, or one saved "
        "again from a healthy run): this one's files are not what was saved")


def verify(ckpt):
    """check() in one process: -> the DCP Metadata, or raises CheckpointDamaged
    (or UnsafeFileError, for a name that leads out of `ckpt`)."""
    metadata, problems = check(ckpt)
    if problems:
        raise damaged(ckpt, problems)
    return metadata

