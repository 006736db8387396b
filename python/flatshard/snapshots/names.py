"""Where snapshot segments live: their names on a host (/dev/shm), from the
job and the rank, so that a rank restarted on that host finds its own; and
the listing and removal of what a job left (`python -m flatshard
snapshots`)."""
import os
import re

from .. import _C
from ..errors import ConfigError

PREFIX = "flatshard-snap-"
SHM_DIR = "/dev/shm"
_JOB = re.compile(r"^[A-Za-z0-9_.]{1,120}$")


def job_name(job):
    """The job a snapshot belongs to: `job`, else torchrun's run id (the same
    across the restarts of one torchrun)."""
    if job is None:
        job = os.environ.get("TORCHELASTIC_RUN_ID")
        if job is None:
            raise ConfigError("flatshard.Snapshots: job=None and TORCHELASTIC_RUN_ID is unset; "
                              "run under torchrun or pass job='a name' (letters, digits, '_' "
                              "and '.'), the same in the restarted processes")
        job = re.sub(r"[^A-Za-z0-9_.]", "_", job)[:120]
    if not isinstance(job, str) or not _JOB.match(job):
        raise ConfigError(f"flatshard.Snapshots: job={job!r} is not allowed; 1 to 120 letters, "
                          "digits, '_' or '.'")
    return job


_SEGMENT = re.compile(r"^(.+)-r(\d+)(?:-buddy(\d+))?$")


def segment_name(job, rank):
    return f"/{PREFIX}{job}-r{rank}"


def buddy_name(job, holder, owner):
    """The copy of rank `owner`'s snapshot that rank `holder` keeps (snapshots/buddy.py)."""
    return f"/{PREFIX}{job}-r{holder}-buddy{owner}"


def list_segments(job=None):
    """Every snapshot segment on this host (of `job` only, when given): dicts
    of name, job, rank (its holder), owner (the rank whose snapshot it holds:
    rank itself, or another for a buddy copy), bytes, the complete steps it
    holds, owner uid and the time it was last written."""
    out = []
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return out
    for n in names:
        if not n.startswith(PREFIX):
            continue
        m = _SEGMENT.match(n[len(PREFIX):])
        if m is None or (job is not None and m.group(1) != job):
            continue
        j, r = m.group(1), int(m.group(2))
        owner = r if m.group(3) is None else int(m.group(3))
        try:
            st = os.stat(os.path.join(SHM_DIR, n))
        except FileNotFoundError:
            continue
        steps = None
        try:
            snap = _C.Snapshot("/" + n, create=False)
            steps = sorted(s[1] for s in snap.slots() if s[0])
            snap.close()
        except (OSError, RuntimeError):
            pass  # not ours to read, or not a snapshot store: listed without its steps
        out.append({"name": "/" + n, "job": j, "rank": r, "owner": owner, "bytes": st.st_size,
                    "steps": steps, "uid": st.st_uid, "mtime": st.st_mtime})
    return out


def remove_segments(job=None):
    """Remove the snapshot segments of `job` (None: every one) on this host
    that this user may remove; -> their names."""
    gone = []
    for seg in list_segments(job):
        try:
            _C.snapshot_unlink(seg["name"])
            gone.append(seg["name"])
        except FileNotFoundError:
            pass
    return gone
