"""Where the CPU optimizer keeps the loop variants it chose, so that a
second process reuses them (csrc/optim/optim_cache.c reads and writes the
file: plain text, written atomically, ignored when unreadable or malformed;
[Note: tuning] in csrc/optim/optim_tune.c says what is chosen and how).

The file is FLATSHARD_OPTIM_TUNE_CACHE when that is set (empty: no file),
else optim_tune.txt in flatshard's folder of the user's cache directory
($XDG_CACHE_HOME, or ~/.cache). Read at each step call, so a variable set
after import still counts; the C side is told only when the path changes.
"""
import os

from .. import _C
from ..envvars import read

_set = [None]  # the path last handed to the C side ("" for none)


def path():
    """The cache file's path, or "" for none."""
    raw = read("FLATSHARD_OPTIM_TUNE_CACHE")
    if raw is not None:
        return raw
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "flatshard", "optim_tune.txt")


def use():
    """Points the C side at the current path (once per change); a folder
    that cannot be made means no cache, not an error: the loop is then
    measured in each process, as it would be the first time."""
    p = path()
    if p == _set[0]:
        return
    from .. import __version__  # here: flatshard/__init__.py imports optim/ before setting it
    folder = os.path.dirname(p)
    if p and folder:
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError:
            p = ""
    _C.optim_tune_cache(p or None, __version__)
    _set[0] = path()
