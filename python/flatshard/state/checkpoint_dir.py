"""The layout of a checkpoint directory (fsdp/checkpoint.py writes it,
consolidate.py reads it): `LATEST` names the newest complete `ckpt-N`;
`.tmp-` marks a save in progress. Which checkpoint is the newest, read from
a directory someone else may have written."""
import os

from .safe_load import inside

LATEST = "LATEST"
PREFIX = "ckpt-"
TMP = ".tmp-"


def latest_checkpoint(path):
    """The checkpoint directory `path` stands for: itself if it is a DCP
    checkpoint, else the one its LATEST file names (inside `path`)."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path
    try:
        with open(os.path.join(path, LATEST)) as f:
            name = f.read().strip()
    except FileNotFoundError:
        raise FileNotFoundError(f"flatshard: no checkpoint at {path!r}: it has neither a "
                                f"{LATEST} file (written by flatshard.save_checkpoint) nor DCP "
                                ".metadata") from None
    return inside(path, name, repr(os.path.join(path, LATEST)))
