"""What both wrappers run on: the collectives facade and its backends
(comm.py: shm and torch; cuda_nccl.py: NCCL), the devices and their kernels
(device.py, cuda.py), how long a wait may last (timeout.py), failure reports
(diagnostics.py: where every rank was; consistency.py: ranks that wrap
different models), the forward order kept for prefetching (order.py) and
what torch's debugging tools see of flatshard's collectives (observe.py:
profiler ranges, CommDebugMode counts), the hooks torch.compile runs
eagerly (eager.py), the one gradient reduction a model keeps in flight
(inflight.py), the post-accumulate-grad hooks of sharded parameters
(grad_hooks.py) and the tensors inside a module's inputs and outputs
(trees.py).

Lowest first: trees, grad_hooks, eager, inflight, observe, order, diagnostics, timeout, cuda < cuda_nccl < device < comm;
consistency needs only timeout. Imports: the leaves (errors, envvars,
tensors) and _C/_C_cuda; nothing of fsdp/, fsdp2/, state/, plan/, optim/ or
memory.py.
"""
