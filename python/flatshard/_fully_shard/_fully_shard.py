"""torch.distributed.fsdp._fully_shard._fully_shard's public API at
`flatshard._fully_shard._fully_shard`: flatshard's fully_shard, FSDPModule,
UnshardHandle, register_fsdp_forward_method and share_comm_ctx (fsdp2/), and
the policy dataclasses torch imports there (torch's own).
torch's class registry there (get_cls_to_fsdp_cls,
disable_fsdp_module_new_init) serves torch's own classes only. Names only."""
from ..fsdp2 import (DataParallelMeshDims, FSDPModule, MixedPrecisionPolicy,  # noqa: F401
                     OffloadPolicy, UnshardHandle, fully_shard, register_fsdp_forward_method,
                     share_comm_ctx)

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
           "share_comm_ctx"]

from .. import fsdp2 as _fsdp2  # noqa: E402

if hasattr(_fsdp2, "GradientReductionHandle"):  # where torch has it (torch_facts.VERSIONED)
    GradientReductionHandle = _fsdp2.GradientReductionHandle
    __all__ += ["GradientReductionHandle"]
