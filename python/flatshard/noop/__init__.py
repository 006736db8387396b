"""Settings that change nothing: a NoEffectWarning (errors.py) where one is
given, once per process for each kind, naming the setting, where it was
given and what would change something. Only warnings: torch trains through
each of these without a word, and a script may mean them.

  mixed_precision.py  a policy that casts nothing (FSDP1 and fully_shard),
                      fully_shard's output_dtype that changed no output
  wrap_policy.py      an auto_wrap_policy that wraps nothing, or units one
                      of which holds almost every parameter
  reshard_root.py     reshard_after_forward=False on the root's fully_shard
                      only

Imports: errors only (each checker: torch and this package).
"""
import warnings

from ..errors import NoEffectWarning

_SAID = set()  # the kinds said in this process


def say(kind, message):
    """Warn `message` unless this process said `kind` already."""
    if kind in _SAID:
        return
    _SAID.add(kind)
    warnings.warn(f"flatshard: {message}", NoEffectWarning, stacklevel=3)


def class_name(module):
    """A module's own class name: for a fully_shard module, the class
    fully_shard derived FSDP<name> from (its bases: FSDPModule, <name>)."""
    bases = type(module).__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule":
        return bases[1].__name__
    return type(module).__name__


def said(kind):
    """Whether `kind` was said in this process (tests)."""
    return kind in _SAID


def forget(kind):
    """Say `kind` again at its next occasion (tests)."""
    _SAID.discard(kind)
