"""A sharded checkpoint -> one file of the plain model, in one process with no
process group and no GPU (`python -m flatshard consolidate in_dir out_path`).

What is read: what flatshard.save_checkpoint writes (the directory holding
LATEST, or one checkpoint in it), or any torch.distributed.checkpoint (DCP)
directory of a state dict, saved as {"model": state_dict, ...} or as the
state dict itself; every file is checked against its manifest first
([Note: checkpoint manifest] in manifest.py), and nothing in it is trusted
([Note: untrusted files] in safe_load.py). What is written: the model's tensors only, under the plain
model's keys, as torch.save writes them (.pt) or as safetensors.

Streaming: DCP's metadata gives every entry's shape and dtype, so the output's
header (the pickle of a .pt, the JSON of a .safetensors) is written first;
then each tensor in turn is read whole from its shards by DCP, written, and
freed. Peak memory is at most one tensor plus twice the largest piece of it
one rank saved (DCP reads a piece's bytes, unpickles them, copies them in),
never the model.
"""
import io
import json
import os
import pickle
import struct
import sys
import warnings

import torch

from ..errors import bad_value
from . import manifest, safe_load
from .checkpoint_dir import latest_checkpoint

FORMATS = {".pt": "pt", ".pth": "pt", ".safetensors": "safetensors"}
_SAFETENSORS_DTYPES = {  # every dtype safetensors has
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint64: "U64", torch.uint32: "U32", torch.uint16: "U16", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2: "F8_E5M2", torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
}
_ALIGN = 64  # where .pt storages start: torch.save's default storage alignment


def consolidate(in_dir, out_path, fmt=None, overwrite=False):
    """Write the model in the checkpoint `in_dir` to `out_path` as one file
    that `model.load_state_dict(...)` of the plain model accepts: fmt "pt"
    (torch.load) or "safetensors", by default from out_path's suffix. Only the
    model's entries are written (optimizer state and extra are left out). An
    existing out_path is replaced only with overwrite=True; the file appears
    complete or not at all. Returns out_path."""
    in_dir, out_path = os.fspath(in_dir), os.fspath(out_path)
    ckpt = _checkpoint(in_dir)
    fmt = _format(out_path, fmt)
    if os.path.exists(out_path) and not overwrite:
        raise FileExistsError(f"flatshard: out_path={out_path!r} exists; pass overwrite=True "
                              "(--force) to replace it")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out_path))):
        raise FileNotFoundError(f"flatshard: out_path={out_path!r}: its directory does not "
                                "exist")
    # every file checked against the manifest first; .metadata read once, not once per tensor
    reader = safe_load.reader(ckpt, manifest.verify(ckpt))
    entries = _model_entries(in_dir, reader.read_metadata())
    write = _write_safetensors if fmt == "safetensors" else _write_pt
    _write_atomically(out_path, lambda f: write(f, entries, reader))
    return out_path


def _format(out_path, fmt):
    if fmt is None:
        fmt = FORMATS.get(os.path.splitext(out_path)[1])
        if fmt is None:
            raise bad_value("out_path", out_path, f"its suffix picks the format, one of "
                            f"{', '.join(FORMATS)}", "Or name the format: fmt='pt' or "
                            "'safetensors' (--format)")
    elif fmt not in FORMATS.values():
        raise bad_value("fmt", fmt, "'pt' (torch.save) or 'safetensors'")
    return fmt


def _checkpoint(in_dir):
    if not os.path.exists(in_dir):
        raise FileNotFoundError(f"flatshard: in_dir={in_dir!r} does not exist")
    if not os.path.isdir(in_dir):
        raise NotADirectoryError(f"flatshard: in_dir={in_dir!r} is not a directory")
    try:
        return latest_checkpoint(in_dir)
    except FileNotFoundError:
        raise bad_value("in_dir", in_dir, "it is not a checkpoint: it has neither a LATEST "
                        "file (flatshard.save_checkpoint) nor .metadata (torch.distributed."
                        "checkpoint)") from None


def _model_entries(in_dir, metadata):
    """{plain key: (DCP key, its TensorStorageMetadata)}, in the checkpoint's
    order: the entries under the top-level "model" key if there is one, else
    every entry. planner_data maps each flattened DCP key to its path in the
    saved dict, so that a bare state dict whose module is called "model"
    keeps its keys."""
    paths = {k: (metadata.planner_data or {}).get(k, (k,)) for k in metadata.state_dict_metadata}
    nested = any(p[0] == "model" and len(p) > 1 for p in paths.values())
    entries = {}
    for key, md in metadata.state_dict_metadata.items():
        path = paths[key]
        if nested and (path[0] != "model" or len(path) == 1):
            continue
        if not hasattr(md, "size"):  # BytesStorageMetadata: a pickled object, not a tensor
            raise bad_value("in_dir", in_dir, f"its model entry {key!r} is not a tensor",
                            "Only tensors can be consolidated")
        entries[".".join(map(str, path[1:] if nested else path))] = (key, md)
    return entries


def _load(reader, key, md):
    """One whole tensor, assembled by DCP from every shard that holds a part."""
    tensor = torch.empty(md.size, dtype=md.properties.dtype)
    with warnings.catch_warnings():  # no_dist is the point: no process group here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        # The key is already flat: unflattening would compare it with every key of the
        # checkpoint, once per tensor.
        safe_load.dcp_load({key: tensor}, reader, flatten_state_dict=False, no_dist=True)
    return tensor


def _write_atomically(out_path, write):
    """write(file) into a temporary file next to out_path, fsync, rename: a
    crash leaves the previous out_path (or none), never a partial one."""
    directory, name = os.path.split(os.path.abspath(out_path))
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)  # make the rename durable
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------
# safetensors: 8-byte little-endian header length, JSON header, raw bytes


def _write_safetensors(f, entries, reader):
    header, offset = {}, 0
    for name, (_, md) in entries.items():
        if md.properties.dtype not in _SAFETENSORS_DTYPES:
            raise bad_value("fmt", "safetensors", f"entry {name!r} is {md.properties.dtype}, "
                            "which safetensors cannot hold", "Write a .pt (fmt='pt') instead")
        nbytes = md.size.numel() * md.properties.dtype.itemsize
        header[name] = {"dtype": _SAFETENSORS_DTYPES[md.properties.dtype],
                        "shape": list(md.size), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}  # what transformers checks for
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # tensors start 8-byte aligned, as safetensors writes them
    f.write(struct.pack("<Q", len(blob)) + blob)
    for key, md in entries.values():  # in header order: the offsets above
        f.write(_load(reader, key, md).reshape(-1).view(torch.uint8).numpy())


# ---------------------------------------------------------------------------
# torch.save's format: a zip of data.pkl (the dict, with each storage pickled
# as a reference to a data/<n> record) and one record per storage


class _Pickler(pickle.Pickler):
    """torch.save's pickler: a storage is pickled as ("storage", its type,
    key, location, size), the key naming its data/<key> record. Keys count
    from 0 in pickling order, which for a dict of tensors is the dict's order."""

    def __init__(self, file):
        super().__init__(file, protocol=torch.serialization.DEFAULT_PROTOCOL)
        self.count = 0

    def persistent_id(self, obj):
        if isinstance(obj, torch.storage.TypedStorage):  # dtypes with a legacy storage class
            kind, numel = getattr(torch, obj._pickle_storage_type()), obj._size()
        elif isinstance(obj, torch.UntypedStorage):  # newer dtypes (float8, uint16, ...)
            kind, numel = torch.UntypedStorage, obj.nbytes()
        else:
            return None
        self.count += 1
        return ("storage", kind, str(self.count - 1), "cpu", numel)


def _pickled(entries):
    """data.pkl for {name: tensor}, made from fake tensors (shape and dtype,
    no data) so that torch's own Tensor pickling decides the layout."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        fakes = {name: torch.empty(md.size, dtype=md.properties.dtype)
                 for name, (_, md) in entries.items()}
    buf = io.BytesIO()
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        _Pickler(buf).dump(fakes)
    return buf.getvalue()


def _write_pt(f, entries, reader):
    # torch's own zip writer (alignment, CRCs, the records torch.save adds at the end),
    # given the records torch.save writes, in its order.
    writer = torch._C.PyTorchFileWriter(f, True, _ALIGN)
    try:
        for record, data in [("data.pkl", _pickled(entries)), (".format_version", "1"),
                             (".storage_alignment", str(_ALIGN)), ("byteorder", sys.byteorder)]:
            writer.write_record(record, data, len(data))
        for n, (key, md) in enumerate(entries.values()):
            storage = _load(reader, key, md).untyped_storage()
            writer.write_record(f"data/{n}", storage, storage.nbytes())
            del storage  # before the next tensor is read, or two would be alive
    finally:
        # Also on failure (as torch.save does): else the writer finishes the file when it
        # is collected, after `f` is closed, and that aborts the process.
        writer.write_end_of_file()
