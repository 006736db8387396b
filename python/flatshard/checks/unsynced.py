"""Item: an optimizer step after backward passes that never reduced.

Inside FSDP1's no_sync() or after fully_shard's
set_requires_gradient_sync(False), backward keeps each rank's gradients
local (unreduced and, sharded, unsharded); the next backward with sync on
reduces their sum. Gradient accumulation that steps before that synced
backward steps on gradients no other rank saw (or none at all), silently
in torch. Here:
  sync_off(units)        the wrappers name the units whose sync a user
                         turned off: they are watched;
  backward_ended(units)  a root's end of backward: a watched unit whose sync
                         is still off is pending, one whose sync is on again
                         reduced and is no longer watched;
  check(optimizer)       optimizer.step() (hooks.py): a pending unit whose
                         parameters it holds -> UnsyncedStepWarning naming
                         them, and they are no longer pending.
With nothing watched (no no_sync anywhere, or the last backward synced)
each end of backward and step costs one test of an empty dict. A warning,
not an error: a script may step on local gradients on purpose (local SGD).
"""
import warnings
import weakref

from .. import envvars
from ..errors import UnsyncedStepWarning
from . import text

ENV = "FLATSHARD_CHECK_UNSYNCED"
ENTRY = "A step on gradients that were never reduced"
_WATCH = weakref.WeakKeyDictionary()    # unit -> Watch
_PENDING = weakref.WeakKeyDictionary()  # unit -> Watch: its last backward ran unsynced


class Watch:
    """How to read one wrapper's unit: synced(unit) -> bool, params(unit)
    -> the parameters an optimizer holds, label(unit) -> its name; `off`:
    how the user turned its sync off, for the message."""

    def __init__(self, synced, params, label, off):
        self.synced, self.params, self.label, self.off = synced, params, label, off


def sync_off(units, watch):
    for u in units:
        _WATCH[u] = watch


def backward_ended(units):
    if not _WATCH:
        return
    for u in units:
        w = _WATCH.get(u)
        if w is None:
            continue
        if w.synced(u):
            del _WATCH[u]
            _PENDING.pop(u, None)
        else:
            _PENDING[u] = w


def pending():
    return bool(_PENDING)


def check(optimizer):
    if not _PENDING or not envvars.read_flag(ENV, True):
        return
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    hit = [(u, w) for u, w in list(_PENDING.items())
           if any(id(p) in held for p in w.params(u))]
    if not hit:
        return
    for u, _ in hit:
        _PENDING.pop(u, None)
    offs = " or ".join(dict.fromkeys(w.off for _, w in hit))
    warnings.warn(
        f"flatshard: rank {text.this_rank()}: {type(optimizer).__name__}.step() with gradients "
        f"that were never reduced across ranks: the last backward of "
        f"{'units' if len(hit) > 1 else 'unit'} {text.names(repr(w.label(u)) for u, w in hit)} "
        f"ran with gradient sync off ({offs}), so their gradients stayed local to each rank, "
        "unreduced (and, where parameters are sharded, outside the shards this step "
        "updates). Gradient accumulation must end with one backward with sync on "
        "(outside no_sync(), or after set_requires_gradient_sync(True)) before "
        f"optimizer.step(). {text.guide(ENTRY, ENV, 'stepping on local gradients on purpose')}",
        UnsyncedStepWarning, stacklevel=4)
