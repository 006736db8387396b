"""torch.distributed.fsdp.api's names, so a script whose imports read
`from flatshard.api import ...` where they read `torch.distributed.fsdp.api`
runs unchanged: flatshard's option enums and dataclasses (options.py) and
its StateDictSettings. Names only; nothing is defined here."""
from .options import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig, FullStateDictConfig,
                      LocalOptimStateDictConfig, LocalStateDictConfig, MixedPrecision,
                      OptimStateDictConfig, ShardedOptimStateDictConfig, ShardedStateDictConfig,
                      ShardingStrategy, StateDictConfig, StateDictType)
from .fsdp.state_dict import StateDictSettings

__all__ = ["ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload", "StateDictType",
           "StateDictConfig", "FullStateDictConfig", "LocalStateDictConfig",
           "ShardedStateDictConfig", "OptimStateDictConfig", "FullOptimStateDictConfig",
           "LocalOptimStateDictConfig", "ShardedOptimStateDictConfig", "StateDictSettings"]
