"""torch.distributed.fsdp._fully_shard's names at `flatshard._fully_shard`
(torch.distributed._composable.fsdp holds the same ones): flatshard's
fully_shard, FSDPModule and friends (fsdp2/), torch's policy dataclasses,
which flatshard takes as they are. Names only; nothing is defined here."""
from ..fsdp2 import (CPUOffloadPolicy, DataParallelMeshDims, FSDPModule, MixedPrecisionPolicy,
                     OffloadPolicy, UnshardHandle, fully_shard, register_fsdp_forward_method,
                     share_comm_ctx)

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "fully_shard",
           "MixedPrecisionPolicy", "OffloadPolicy", "register_fsdp_forward_method",
           "UnshardHandle", "share_comm_ctx"]

from .. import fsdp2 as _fsdp2  # noqa: E402

if hasattr(_fsdp2, "GradientReductionHandle"):  # where torch has it (torch_facts.VERSIONED)
    GradientReductionHandle = _fsdp2.GradientReductionHandle
    __all__ += ["GradientReductionHandle"]
