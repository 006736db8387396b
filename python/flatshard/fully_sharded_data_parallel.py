"""torch.distributed.fsdp.fully_sharded_data_parallel's public names at
`flatshard.fully_sharded_data_parallel`: the FSDP1 wrapper class and
OptimStateKeyType (its __all__), and what scripts also import from there:
the option types of api.py, the two policy classes, FlatParameter and
FLAT_PARAM. torch's internal bookkeeping types there (TrainingState,
HandleTrainingState, FlatParamHandle) describe torch's implementation and
have no meaning for flatshard's units: they are not here. Names only."""
from .api import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig,  # noqa: F401
                  FullStateDictConfig, LocalOptimStateDictConfig, LocalStateDictConfig,
                  MixedPrecision, OptimStateDictConfig, ShardedOptimStateDictConfig,
                  ShardedStateDictConfig, ShardingStrategy, StateDictConfig, StateDictSettings,
                  StateDictType)
from .fsdp import (FLAT_PARAM, FSDP_WRAPPED_MODULE, FlatParameter,  # noqa: F401
                   FullyShardedDataParallel)
from .fsdp.wrap import CustomPolicy, ModuleWrapPolicy  # noqa: F401
from .options import OptimStateKeyType

__all__ = ["FullyShardedDataParallel", "OptimStateKeyType"]
