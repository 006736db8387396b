"""State dicts and checkpoints of a model wrapped with the FSDP1 wrapper:
model state dicts with torch's three types (state_dict.py), optimizer state
keyed by parameter name (optim_state.py), atomic sharded checkpoints
(checkpoint.py), one consolidated file from a checkpoint (consolidate.py),
and the rules for reading files someone else may have written
(safe_load.py).

Imports: the leaves (errors, options) and fsdp/'s lower modules (unit,
summon, flat_param, groups), to reach each wrapped unit; never fsdp/api.py
(which delegates its state-dict methods here), fsdp2/, plan/ or optim/.
safe_load.py imports nothing but errors, so optim/ can use it.
"""
