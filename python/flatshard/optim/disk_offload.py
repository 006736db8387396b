"""Adam/AdamW state on a local disk: `flatshard.optim.AdamW(..., offload=
DiskOffload(path))`.

exp_avg and exp_avg_sq live in one file per generation under `path`; each
step streams the current generation through the C update (csrc/optim/optim_disk.c:
a reader thread, the fused update, a writer thread, `buffers` chunks in
flight) into a new file, so host memory holds a few chunks, not the state.

[Note: generations] A generation file is written once and never modified.
A step writes `gen-<seq>-<token>.bin.tmp`, makes it durable (fdatasync),
renames it to `.bin` (atomic) and syncs the directory; only then is the
previous generation deleted, unless a checkpoint refers to it.
optimizer.state_dict() refers to the current generation by name and pins it
(the pin moves to the newest state dict taken; older ones are released), so
a process killed at any point leaves the checkpoint's file intact, and
load_state_dict() in a new process adopts it. Names carry a random token:
a resumed run never reuses the name of a file an older checkpoint refers to.
The name a state dict gives is adopted only if it is a generation file inside
DiskOffload.path ([Note: untrusted files] in state/safe_load.py): an adopted file is
read as the moments and deleted once released.
An I/O error in the middle of a step raises OSError and leaves the
parameters partly updated: resume from the checkpoint.

One directory per optimizer (per rank): a lock file refuses a second user.
"""
import fcntl
import os
import re
import uuid
from dataclasses import dataclass

import torch

from .. import _C
from ..errors import bad_type, bad_value, not_built
from ..state.safe_load import inside

_F32 = 4
_GENERATION = re.compile(r"gen-(\d+)-[0-9a-f]+\.bin")  # what step() names a generation


@dataclass(frozen=True)
class DiskOffload:
    """Keep Adam's moments in files under `path` (a local directory, one per
    rank; created if missing).

    chunk_bytes  optimizer state moved per read/write (both moments of
                 chunk_bytes / 8 elements); larger chunks, longer requests.
    buffers      chunks in flight (>= 2): host memory is buffers*chunk_bytes.
    durable      fdatasync each generation before it replaces the last one
                 (what makes a kill or power loss safe); False for scratch
                 runs that will never resume.
    """
    path: str
    chunk_bytes: int = 8 << 20
    buffers: int = 4
    durable: bool = True

    def __post_init__(self):
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise bad_type("DiskOffload(path=...)", self.path, "a directory path (str)")
        for name, lo in (("chunk_bytes", 8), ("buffers", 2)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise bad_value(f"DiskOffload({name}=...)", v, f"expected an int >= {lo}")
        if self.chunk_bytes % 8:
            raise bad_value("DiskOffload(chunk_bytes=...)", self.chunk_bytes,
                            "expected a multiple of 8 (two fp32 moments per element)")
        if not isinstance(self.durable, bool):
            raise bad_type("DiskOffload(durable=...)", self.durable, "True or False")

    @property
    def chunk_numel(self):
        return self.chunk_bytes // (2 * _F32)


def check(owner, offload, amsgrad):
    """The optimizer's `offload` argument -> DiskOffload or None."""
    if offload is None:
        return None
    if not isinstance(offload, DiskOffload):
        raise bad_type(f"{owner}(offload=...)", offload, "flatshard.optim.DiskOffload or None")
    if amsgrad:
        raise not_built(f"{owner}(amsgrad=True, offload=...)", True, "amsgrad's third moment "
                        "is not streamed from disk; pass amsgrad=False or drop offload")
    return offload


class DiskState:
    """The files of one optimizer: layout, current generation, pin, lock."""

    def __init__(self, offload, numels):
        self._lock = None
        self.cfg = offload
        self.dir = os.fspath(offload.path)
        os.makedirs(self.dir, exist_ok=True)
        self._lock = os.open(os.path.join(self.dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            self._lock = None
            raise bad_value("DiskOffload(path=...)", self.dir, "another optimizer (in this or "
                            "another process) uses this directory", "give each optimizer, "
                            "and each rank, its own directory, e.g. f'{path}/rank{rank}'") from None
        for left in os.listdir(self.dir):  # a killed step's partial file: never referenced
            if left.startswith("gen-") and left.endswith(".bin.tmp"):
                os.unlink(self._path(left))
        self.numels = list(numels)
        self.offsets, pos = [], 0
        for n in self.numels:
            self.offsets.append(pos)
            pos += n * 2 * _F32
        self.total_bytes = pos
        self.current = None   # file name of the current generation; None: all zeros
        self.pinned = None    # the generation the newest state dict refers to
        self.seq = 0
        self.bytes_read = self.bytes_written = 0  # of the last step

    def close(self):
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def __del__(self):
        self.close()

    def _path(self, name):
        return os.path.join(self.dir, name)

    def step(self, calls):
        """calls: [(segments, hparams), ...], one per parameter group; runs
        them from the current generation into a new one and commits it."""
        self.seq += 1
        name = f"gen-{self.seq:09d}-{uuid.uuid4().hex[:12]}.bin"
        tmp = self._path(name + ".tmp")
        fd_in = os.open(self._path(self.current), os.O_RDONLY) if self.current else -1
        try:
            if fd_in >= 0 and os.fstat(fd_in).st_size != self.total_bytes:
                raise bad_value("DiskOffload", self._path(self.current), "the state file has "
                                f"{os.fstat(fd_in).st_size} bytes, the layout "
                                f"{self.total_bytes}", "it does not belong to these parameters")
            fd_out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                r = w = 0
                for segments, hp in calls:
                    rb, wb = _C.disk_adam_step(fd_in, fd_out, segments, self.cfg.chunk_numel,
                                               self.cfg.buffers, **hp)
                    r, w = r + rb, w + wb
                if self.cfg.durable:
                    os.fdatasync(fd_out)
                _drop_cache(fd_out)
            finally:
                os.close(fd_out)
            if fd_in >= 0:
                _drop_cache(fd_in)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        finally:
            if fd_in >= 0:
                os.close(fd_in)
        os.rename(tmp, self._path(name))
        if self.cfg.durable:
            _sync_dir(self.dir)
        old, self.current = self.current, name
        if old is not None and old != self.pinned:
            os.unlink(self._path(old))
        self.bytes_read, self.bytes_written = r, w

    def pin(self):
        """The state dict's reference to the current generation (pinned)."""
        if self.pinned is not None and self.pinned != self.current:
            os.unlink(self._path(self.pinned))
        self.pinned = self.current
        return {"dir": self.dir, "file": self.current, "numels": list(self.numels),
                "chunk_numel": self.cfg.chunk_numel}

    def adopt(self, ref):
        """load_state_dict: make the generation `ref` names the current one."""
        if not isinstance(ref, dict) or not {"file", "numels", "chunk_numel"} <= set(ref):
            raise bad_value("load_state_dict", type(ref).__name__, "the state dict has no "
                            "'disk_offload' entry of flatshard's DiskOffload",
                            "load a state dict saved by an optimizer with offload=DiskOffload")
        if list(ref["numels"]) != self.numels:
            raise bad_value("load_state_dict", "disk_offload.numels", "the saved parameters' "
                            "sizes differ from this optimizer's")
        if ref["chunk_numel"] != self.cfg.chunk_numel:
            raise bad_value("load_state_dict", f"chunk_numel={ref['chunk_numel']}", "the files "
                            f"were written with chunk_bytes={ref['chunk_numel'] * 8}",
                            f"use DiskOffload(chunk_bytes={ref['chunk_numel'] * 8})")
        name = ref["file"]
        if name is not None:
            path = inside(self.dir, name, "the state dict's disk_offload.file")
            if _GENERATION.fullmatch(name) is None:
                raise bad_value("load_state_dict", f"disk_offload.file={name!r}", "it is not "
                                "the name of a generation file (gen-<seq>-<token>.bin)")
            if not os.path.exists(path):
                raise bad_value("load_state_dict", path, "the state file the checkpoint refers "
                                "to is not in DiskOffload.path", "point DiskOffload(path=...) "
                                "at the directory the checkpoint was saved from")
            if os.path.getsize(path) != self.total_bytes:
                raise bad_value("load_state_dict", path, f"it has {os.path.getsize(path)} "
                                f"bytes, the layout needs {self.total_bytes}")
            self.seq = max(self.seq, int(_GENERATION.fullmatch(name).group(1)))
        for old in {self.current, self.pinned} - {None, name}:
            os.unlink(self._path(old))
        self.current = self.pinned = name

    def read(self, index):
        """(exp_avg, exp_avg_sq) of parameter `index` from the current file."""
        n = self.numels[index]
        m, v = torch.zeros(n), torch.zeros(n)
        if self.current is None or n == 0:
            return m, v
        raw = torch.empty(2 * n)
        with open(self._path(self.current), "rb") as f:
            f.seek(self.offsets[index])
            f.readinto(raw.numpy().view("uint8"))
        c = self.cfg.chunk_numel
        for e in range(0, n, c):
            k = min(c, n - e)
            m[e:e + k] = raw[2 * e:2 * e + k]
            v[e:e + k] = raw[2 * e + k:2 * e + 2 * k]
        return m, v


def _drop_cache(fd):
    """The state's pages need not stay in the page cache: that would be host
    memory the state was moved out of."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _sync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
