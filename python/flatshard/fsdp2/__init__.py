"""fully_shard (torch FSDP2's API) on flatshard's core: the public call
(api.py), the FSDPModule class it mixes in (module.py), the mesh a group
shards over and the Comms made from it (mesh.py), one group's sharded
parameters and collectives (param.py), the per-module hooks and state
(state.py), torch's all-gather extension protocol for tensor subclasses
(extension.py), torch's private names for the state (torch_state.py),
torch's contract for the classes fully_shard makes (torch_class.py),
fully_shard's dp_mesh_dims (dp_mesh.py) and share_comm_ctx (comm_ctx.py);
torch 2.15's manual backward finalization (finalize.py), whose
GradientReductionHandle is exported here where the installed torch has it
(torch_facts.VERSIONED).

Imports: the leaves (errors, tensors) and runtime/; nothing of fsdp/,
state/, plan/, optim/ or memory.py (the two wrappers share only runtime/).
"""
from .. import torch_facts
from .api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from .comm_ctx import share_comm_ctx
from .dp_mesh import DataParallelMeshDims
from .module import FSDPModule, UnshardHandle, register_fsdp_forward_method

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
           "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims",
           "share_comm_ctx"]

if torch_facts.torch_has("torch.distributed.fsdp", "GradientReductionHandle"):  # torch 2.15
    from .finalize import GradientReductionHandle  # noqa: E402
    __all__ += ["GradientReductionHandle"]
