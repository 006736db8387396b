"""Reading files that someone other than the user may have written: a
checkpoint directory, a LATEST file, the files an optimizer state dict names.

[Note: untrusted files] Whoever can write into a checkpoint directory must not
be able to run code in the process that loads it, nor make it read, adopt or
delete a file elsewhere. So:
  - DCP's .metadata is unpickled admitting only the types DCP writes there
    (its metadata dataclasses, torch.Size, dtypes, layouts, plain containers);
  - a pickled entry of a checkpoint (a non-tensor value, e.g. an extra) is
    loaded with torch.load(weights_only=True): plain data and tensors only;
  - every file name read from a file or a state dict goes through inside():
    a relative name, without "..", that stays inside its directory once
    symbolic links are followed.
What is refused raises UnsafeFileError naming the file (or key) and why,
before anything in it runs or is read.

torch.distributed.checkpoint is imported only by the functions that use it
(importing it is slow), so that disk offload can use inside() without it.
"""
import functools
import io
import os
import pickle

import torch

from ..errors import CheckpointDamaged, UnsafeFileError

METADATA = ".metadata"

# (module, name) of every type DCP pickles into .metadata, and nothing that can
# be called to do anything but build a value.
_METADATA_TYPES = {
    ("torch.distributed.checkpoint.metadata", n) for n in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    # where older torch's DCP took TensorProperties from
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a lookup of torch's layouts by name
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"),
} | {  # StorageMeta.checkpoint_id: where it was saved (pathlib's module moved in 3.13)
    (m, n) for m in ("pathlib", "pathlib._local")
    for n in ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")
}


@functools.cache
def _torch_constants():
    """Names of torch's dtypes, layouts and memory formats (torch.float32 is
    pickled as the global torch.float32)."""
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return frozenset(n for n, v in vars(torch).items() if isinstance(v, kinds))


def inside(directory, name, source):
    """directory/name, for a `name` read from `source` (a file, or a state
    dict's key, as the error should call it); raises UnsafeFileError unless
    it is a relative name without ".." that stays inside `directory`,
    symbolic links followed. See [Note: untrusted files]."""
    why = None
    if not isinstance(name, str) or not name or "\0" in name:
        why = "it is not a file name"
    elif os.path.isabs(name):
        why = "it is an absolute path"
    elif ".." in name.split(os.sep):
        why = "it goes up with '..'"
    else:
        base = os.path.realpath(directory)
        real = os.path.realpath(os.path.join(base, name))
        if real == base:
            why = "it is the directory itself"
        elif os.path.commonpath([base, real]) != base:
            why = f"it leads through a symbolic link to {real!r}"
    if why is not None:
        raise UnsafeFileError(f"flatshard: {source} names {name!r}: {why}. A name read "
                              "from a file is followed only inside its own directory, here "
                              f"{os.fspath(directory)!r}")
    return os.path.join(directory, name)


class MetadataUnpickler(pickle.Unpickler):
    """pickle.load for DCP's .metadata: builds DCP's metadata types and plain
    data, and refuses any other global (what a payload would call)."""

    def find_class(self, module, name):
        if (module, name) in _METADATA_TYPES or \
                (module == "torch" and name in _torch_constants()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which is not one of the "
                                     "types torch.distributed.checkpoint writes there")


def read_metadata(ckpt):
    """The DCP Metadata of checkpoint directory `ckpt`, read with
    MetadataUnpickler; every data file it names is checked with inside()."""
    from torch.distributed.checkpoint.metadata import Metadata
    path = inside(ckpt, METADATA, f"checkpoint {os.fspath(ckpt)!r}")
    with open(path, "rb") as f:
        try:
            metadata = MetadataUnpickler(f).load()
        except pickle.UnpicklingError as e:
            raise UnsafeFileError(f"flatshard: {path} is not loaded: {e}. Only "
                                  "torch.distributed.checkpoint's metadata is unpickled from "
                                  "a checkpoint") from None
    if not isinstance(metadata, Metadata):
        raise UnsafeFileError(f"flatshard: {path} is not loaded: it holds a "
                              f"{type(metadata).__name__}, not torch.distributed.checkpoint's "
                              "Metadata")
    for index, info in (metadata.storage_data or {}).items():
        inside(ckpt, getattr(info, "relative_path", None),
               f"{path} (entry {getattr(index, 'fqn', index)!r})")
    return metadata


def load_plain(stream, source):
    """torch.load(stream) of plain data and tensors only; anything else
    raises UnsafeFileError naming `source`."""
    try:
        return torch.load(stream, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = next((line.split("WeightsUnpickler error: ", 1)[1].split(". Please")[0]
                    for line in str(e).splitlines() if "WeightsUnpickler error: " in line),
                   str(e))
        raise UnsafeFileError(f"flatshard: {source} is not loaded: it holds a pickled object "
                              f"that is not plain data ({why}). Only tensors, numbers, strings "
                              "and lists, tuples and dicts of them are unpickled from a "
                              "checkpoint") from None


def is_plain(obj):
    """Whether load_plain loads `obj` back (save_checkpoint checks with it)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    try:
        torch.load(buf, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return False
    return True


def reader(ckpt, metadata=None):
    """A DCP FileSystemReader of `ckpt` whose metadata is read_metadata's,
    read once (here, or by the caller who passes it), not once per dcp.load."""
    from torch.distributed.checkpoint import FileSystemReader  # importing costs a second
    from torch.distributed.checkpoint.metadata import StorageMeta
    if metadata is None:
        metadata = read_metadata(ckpt)
    out = FileSystemReader(ckpt)
    if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = out.load_id
    out.read_metadata = lambda *args, **kwargs: metadata
    return out


def dcp_load(state, storage_reader, flatten_state_dict=True, **kwargs):
    """dcp.load(state, storage_reader, **kwargs), but a pickled entry is
    loaded with load_plain (DCP's planner unpickles it with weights_only=False),
    and a refused one raises its UnsafeFileError rather than DCP's
    CheckpointException around it; any other failure DCP reports raises
    CheckpointDamaged naming the ranks and files (CheckpointException is a
    BaseException, which `except Exception` would miss)."""
    import torch.distributed.checkpoint as dcp  # importing costs a second
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.api import CheckpointException
    planner = dcp.DefaultLoadPlanner(flatten_state_dict=flatten_state_dict)

    def load_bytes(read_item, value):
        fqn = read_item.dest_index.fqn
        info = planner.metadata.storage_data[read_item.storage_index]
        obj = load_plain(value, f"{os.path.join(storage_reader.path, info.relative_path)} "
                                f"(entry {fqn!r})")
        if planner.flatten_state_dict:  # what DefaultLoadPlanner.load_bytes does with it
            set_element(planner.original_state_dict, planner.mappings[fqn], obj)
        else:
            planner.state_dict[fqn] = obj
    planner.load_bytes = load_bytes
    try:
        dcp.load(state, storage_reader=storage_reader, planner=planner, **kwargs)
    except CheckpointException as e:
        refused = [exc for exc, _ in e.failures.values() if isinstance(exc, UnsafeFileError)]
        if refused:
            raise refused[0] from e
        raise _read_failed(storage_reader.path, e) from e
    finally:
        # load_bytes refers to the planner, which holds `state`: left in place, the
        # cycle would keep each loaded tensor alive until a garbage collection.
        del planner.load_bytes


def _read_failed(ckpt, e):
    """DCP's CheckpointException `e` of a load from `ckpt` as CheckpointDamaged:
    each failed rank, its exception and the file it names."""
    parts = []
    for rank, (exc, _) in sorted(e.failures.items()):
        name = getattr(exc, "filename", None)
        where = f" reading {name}" if name else ""
        parts.append(f"rank {rank}{where}: {type(exc).__name__}: {exc}")
    return CheckpointDamaged(
        f"flatshard: torch.distributed.checkpoint failed to read checkpoint "
        f"{os.fspath(ckpt)!r}: {'; '.join(parts)}. Its files changed after they were checked, "
        "or it has no manifest.json to check them by; the model may hold part of it: load "
        "another checkpoint (an older copy of it, or one saved again from a healthy run)")
