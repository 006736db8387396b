"""Fused CPU optimizers: AdamW, Adam and SGD as torch.optim.Optimizer subclasses.

Same arguments, state names and state_dict format as torch's, so a torch
script swaps the class and keeps its checkpoints. Each step is one pass of C
(csrc/optim/optim_cpu.c) per parameter, split over up to `threads` threads
with the GIL released; on flatshard's flat shards one call updates a whole
shard. Adam, AdamW and SGD hand a param group's host parameters to C in one
call (_C.adam_steps, which also counts their steps; _C.sgd_steps), so a model
of many small tensors pays a tuple of pointers per parameter, not a Python
call into C each. How the loop runs (SIMD width, unrolling, prefetch, copy
stores, thread split) is measured per size class (on slices of the class's
own first steps, or on scratch buffers before a small class's first one) and
kept in a cache file for later processes
(csrc/optim/optim_tune.c, tune_cache.py, tune_report()).
Parameters and gradients must be contiguous fp32 tensors, on the CPU or on a
CUDA device, where each step is one fused kernel per parameter
(csrc/cuda/optim.cu, through runtime/cuda.py) enqueued on the current stream;
anything else is refused with an error naming the parameter.

`adamw_step_` is the functional form, which can also write a bf16/fp16 copy
of the updated parameters in the same pass.

AdamW/Adam(offload=DiskOffload(path)) keep their moments on a local disk and
stream them through the update in chunks (disk_offload.py).

The package: adam.py (Adam, AdamW), sgd.py (SGD), functional.py (adamw_step_
and the tuning report), checks.py (what every step takes and checks),
tune_cache.py (where the chosen loops are kept) and disk_offload.py; this file only hands their names on.
Imports: the leaves, runtime/cuda.py and state/safe_load.py (the check of
state file names); nothing of fsdp/, fsdp2/, plan/ or memory.py: an
optimizer works on any parameters, sharded or not.
"""
from .adam import Adam, AdamW
from .disk_offload import DiskOffload
from .functional import adamw_step_, describe_tuning, tune_report
from .sgd import SGD

__all__ = ["AdamW", "Adam", "SGD", "DiskOffload", "tune_report"]
