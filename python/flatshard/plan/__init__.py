"""The memory planner: each rank's bytes by category before training, from a
model or a parameter count, with the formula behind every line.

    from flatshard.plan import plan, rank
    p = plan(params=7e9, world_size=8, strategy="FULL_SHARD",
             mixed_precision="bf16", optimizer="adamw")
    print(p.table())

Modules, lowest first: report.py (tables and the figure), units.py (a
model's units and flat buffer sizes), core.py (the arithmetic: plan, Plan),
ranking.py (rank: what fits, fastest first), measure.py (predict, watch,
check, SavedActivations, measure_runtime: the plan held against a wrapped
model in training),
cli.py (`python -m flatshard plan`). This file only gathers their public
names.

Imports: the leaves, runtime/comm.py (the shm slot size), fsdp/'s wrap
policies and units, memory.py and optim/ (measure.py reads a wrapped model
and its optimizer); nothing below the planner imports it.
"""
from ..runtime.comm import DEFAULT_SLOT_BYTES
from .core import (BACKENDS, DTYPE_BYTES, LAYOUTS, MODEL_STATES, OFFLOADS, OPTIMIZERS,
                   STRATEGIES, ZERO_NAMES, Line, Plan, plan)
from .measure import SavedActivations, check, measure_runtime, predict, watch, watch_from_env
from .ranking import rank
from .units import Group, Unit, flat_layout, units_from_count, units_from_model

__all__ = ["plan", "Plan", "Line", "rank", "predict", "check", "watch", "watch_from_env",
           "measure_runtime",
           "SavedActivations", "Group", "Unit", "flat_layout", "units_from_count",
           "units_from_model", "STRATEGIES", "ZERO_NAMES", "OPTIMIZERS", "DTYPE_BYTES",
           "OFFLOADS", "LAYOUTS", "BACKENDS", "MODEL_STATES", "DEFAULT_SLOT_BYTES"]
