"""torch's global optimizer step hooks, registered once, at the first wrap:
every torch.optim.Optimizer (flatshard.optim's included) runs them.

  before each step  at an optimizer's first: the parameters FSDP replaced
                    (stale_params.py), the units whose replicas it compares
                    (replicas.py); at every step, if a unit's last backward
                    ran unsynced: unsynced.py. Otherwise one set lookup and
                    one test of an empty dict.
  after each step   replicas.py counts the optimizer's steps (registered
                    only where a wrap asked for replica comparisons).
"""
import weakref

from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from . import replicas, stale_params, unsynced

_SEEN = weakref.WeakSet()  # optimizers past their first step
_HANDLES = {}


def install(after=False):
    """The pre-step hook; with `after`, the post-step one too."""
    if "pre" not in _HANDLES:
        _HANDLES["pre"] = register_optimizer_step_pre_hook(_before_step)
    if after and "post" not in _HANDLES:
        _HANDLES["post"] = register_optimizer_step_post_hook(_after_step)


def _before_step(optimizer, args, kwargs):
    if optimizer not in _SEEN:
        _SEEN.add(optimizer)
        stale_params.check(optimizer)
        replicas.plan(optimizer)
    if unsynced.pending():
        unsynced.check(optimizer)


def _after_step(optimizer, args, kwargs):
    replicas.after_step(optimizer)
