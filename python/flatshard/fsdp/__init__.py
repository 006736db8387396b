"""The FSDP1 wrapper: `FullyShardedDataParallel` (alias `FSDP`), torch
FSDP1's class on flatshard's core.

Owns the wrapper class and its argument checks (api.py, config.py, wrap.py),
the flat groups and per-unit hooks (flat_param.py, unit.py, zero1.py), the
process groups a unit runs over (groups.py), and what works on a wrapped
model's units: summon_full_params (summon.py), clip_grad_norm_ (clip.py) and
the out-of-memory report (oom.py).

Imports: the leaves (errors, options, tensors, envvars) and runtime/. Only
api.py imports state/ (the wrapper's state-dict methods delegate there), and
state/ builds on this package's lower modules, never on api.py. Nothing here
imports fsdp2/, plan/, optim/ or memory.py. The modules below api.py find a
model's units with unit.fsdp_units, never by the wrapper class.

Import order: importing any module of state/ runs this file (state/ imports
fsdp.unit, fsdp.summon, ...), which imports api.py, which imports state/.
So this package is imported first (flatshard/__init__.py does), and api.py
then finds state/ whole.
"""
from .api import FSDP, FSDP_WRAPPED_MODULE, FullyShardedDataParallel
from .flat_param import FLAT_PARAM, FlatParameter

__all__ = ["FullyShardedDataParallel", "FSDP", "FSDP_WRAPPED_MODULE", "FLAT_PARAM",
           "FlatParameter"]
