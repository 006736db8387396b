"""The FSDP1 wrapper: `FullyShardedDataParallel` (alias `FSDP`), torch
FSDP1's class on flatshard's core.

Owns the wrapper class (api.py), what its constructor plans before it
builds anything (unit_plan.py), its argument checks and wrap policies
(config.py, wrap.py), the flat groups and per-unit hooks (flat_param.py,
unit.py, zero1.py), the process groups a unit runs over (groups.py), and
what works on a wrapped model's units: summon_full_params (summon.py),
clip_grad_norm_ (clip.py), the out-of-memory report (oom.py), state dicts
with torch's three types (state_dict.py), optimizer state keyed by parameter
name (optim_state.py) and atomic sharded checkpoints (checkpoint.py, also
of fully_shard models; the ranks' check of one before a load:
checkpoint_check.py).

Imports: the leaves (errors, options, tensors, envvars), runtime/ and state/
(the checkpoint directory and the rules for reading files). Nothing here
imports fsdp2/, plan/, optim/ or memory.py. The modules below api.py find a
model's units with unit.fsdp_units (unit_plan.py: unit.unit_of), never by the
wrapper class, so the planner and the state-dict modules sit below api.py,
which calls the one and delegates its state-dict methods to the others.
"""
from .api import FSDP, FSDP_WRAPPED_MODULE, FullyShardedDataParallel
from .flat_param import FLAT_PARAM, FlatParameter

__all__ = ["FullyShardedDataParallel", "FSDP", "FSDP_WRAPPED_MODULE", "FLAT_PARAM",
           "FlatParameter"]
