"""flatshard: FSDP/ZeRO sharding for PyTorch with a C core.

    from flatshard import FullyShardedDataParallel as FSDP, ShardingStrategy
"""
from . import _C
from .errors import ConfigError, ConfigTypeError, CoreError, NotBuiltError, StateError
from .fsdp import FSDP, FullyShardedDataParallel
from .memory import memory_stats
from .options import (BackwardPrefetch, CPUOffload, FullStateDictConfig, LocalStateDictConfig,
                      MixedPrecision, ShardedStateDictConfig, ShardingStrategy, StateDictConfig,
                      StateDictType)
from .wrap import (CustomPolicy, ModuleWrapPolicy, lambda_auto_wrap_policy,
                   size_based_auto_wrap_policy, transformer_auto_wrap_policy)

__version__ = "0.1.0"

__all__ = [
    "FSDP", "FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision",
    "CPUOffload", "StateDictType", "StateDictConfig", "FullStateDictConfig",
    "LocalStateDictConfig", "ShardedStateDictConfig", "ModuleWrapPolicy", "CustomPolicy",
    "transformer_auto_wrap_policy", "size_based_auto_wrap_policy", "lambda_auto_wrap_policy",
    "ConfigError", "ConfigTypeError", "NotBuiltError", "CoreError", "StateError", "memory_stats",
]
