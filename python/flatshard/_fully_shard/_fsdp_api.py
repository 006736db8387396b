"""torch.distributed.fsdp._fully_shard._fsdp_api's policies at
`flatshard._fully_shard._fsdp_api`: torch's own dataclasses, which
fully_shard takes as they are. Names only."""
from ..fsdp2 import CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims"]
