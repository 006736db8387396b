"""Mistakes that train wrong without an error under torch's FSDP, made
loud: what the wrappers call, one concern per file.

  stale_params.py  an optimizer built before wrapping (its first step
                   raises StaleOptimizerError)
  init_values.py   ranks that wrap different initial values (a warning at
                   wrap time)
  unsynced.py      a step after backwards that all ran with gradient sync
                   off (a warning at the step)
  replicas.py      replicas that drift apart (every k steps, a warning)
  hooks.py         torch's global optimizer step hooks that run them
  fingerprint.py   a tensor's CRC-32C; text.py: the messages' shared parts

Each is off with its own environment variable (envvars.py). Imports: the
leaves, runtime's comm and consistency; nothing of fsdp/ or fsdp2/, which
call in with what their units hold.
"""
from . import hooks, init_values, replicas, stale_params, unsynced
from .replicas import Replicas
from .unsynced import Watch

__all__ = ["replaced", "compare_init", "sync_off", "backward_ended", "watch_replicas",
           "replicas_every", "Replicas", "Watch"]


def replaced(params, names, wrapper, owner=None):
    """A wrap took `params` out of their modules (stale_params.record)."""
    stale_params.record(params, names, wrapper, owner)
    hooks.install()


def compare_init(groups, named, wrapper, synced=False):
    """At each wrap: the ranks' initial values compared (init_values.compare)."""
    hooks.install()
    init_values.compare(groups, named, wrapper, synced)


def sync_off(units, watch):
    """The user turned gradient sync off for `units` (unsynced.sync_off)."""
    hooks.install()
    unsynced.sync_off(units, watch)


backward_ended = unsynced.backward_ended
replicas_every = replicas.every


def watch_replicas(target):
    """Compare `target`'s replicas every k steps (replicas.watch)."""
    if target.k:
        replicas.watch(target)
        hooks.install(after=True)
