"""flatshard: FSDP/ZeRO sharding for PyTorch with a C core.

    from flatshard import FullyShardedDataParallel as FSDP, ShardingStrategy
"""
from . import _C
from .errors import (ConfigError, ConfigTypeError, CoreError, NotBuiltError, OutOfMemoryError,
                     StateError)
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
    "ConfigError", "ConfigTypeError", "NotBuiltError", "OutOfMemoryError", "CoreError",
    "StateError", "memory_stats",
]

# State dicts and checkpoints (summon.py, state_dict.py, optim_state.py, checkpoint.py).
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from .errors import StateDictError, UnsafeFileError  # noqa: E402
from .options import (FullOptimStateDictConfig, LocalOptimStateDictConfig,  # noqa: E402
                      OptimStateDictConfig, ShardedOptimStateDictConfig)
from .state_dict import StateDictSettings  # noqa: E402

__all__ += ["StateDictError", "UnsafeFileError", "StateDictSettings", "OptimStateDictConfig",
            "FullOptimStateDictConfig", "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig",
            "save_checkpoint", "load_checkpoint", "latest_checkpoint"]

# One consolidated file from a sharded checkpoint, without a process group (consolidate.py).
from .consolidate import consolidate  # noqa: E402

__all__ += ["consolidate"]

# FSDP2's API: fully_shard and FSDPModule (fsdp2.py, fsdp2_param.py, fsdp2_state.py).
from .fsdp2 import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,  # noqa: E402
                    OffloadPolicy, UnshardHandle, fully_shard, register_fsdp_forward_method)

__all__ += ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
            "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]
