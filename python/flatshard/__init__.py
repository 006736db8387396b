"""flatshard: FSDP/ZeRO sharding for PyTorch with a C core.

    from flatshard import FullyShardedDataParallel as FSDP, ShardingStrategy

The public API, gathered from the subpackages (their own __init__.py says
what each owns and may import). From the bottom: the leaves (errors,
options, envvars, tensors), runtime/ (collectives, devices, failure reports),
state/ (reading checkpoint files), fsdp2/ (fully_shard) beside fsdp/ (the
FSDP1 wrapper, its state dicts and checkpoints), then memory.py, optim/ and
plan/ (the planner; imported as flatshard.plan, flatshard.optim).

torch.distributed.fsdp's module paths are here too, holding the names torch
has there (flatshard's objects, torch's where flatshard has none), so that
replacing `torch.distributed.fsdp` by `flatshard` in a script's imports
works: flatshard.api, .wrap, .fully_sharded_data_parallel,
.sharded_grad_scaler and ._fully_shard (with ._fully_shard._fully_shard and
._fsdp_api). Above them all, torch_switch.py (use_for_torch_fsdp) puts
flatshard's objects at torch's own paths for a whole process.
"""
from . import _C
from .errors import (ConfigError, ConfigTypeError, CoreError, NotBuiltError, OutOfMemoryError,
                     StateError)
from .fsdp import FSDP, FullyShardedDataParallel
from .fsdp.wrap import (CustomPolicy, ModuleWrapPolicy, lambda_auto_wrap_policy,
                        size_based_auto_wrap_policy, transformer_auto_wrap_policy)
from .memory import copy_stats, memory_stats
from .options import (BackwardPrefetch, CommQuant, CPUOffload, FullStateDictConfig,
                      LocalStateDictConfig, MixedPrecision, ShardedStateDictConfig,
                      ShardingStrategy, StateDictConfig, StateDictType)

__version__ = "0.1.0"

__all__ = [
    "FSDP", "FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision",
    "CPUOffload", "StateDictType", "StateDictConfig", "FullStateDictConfig",
    "LocalStateDictConfig", "ShardedStateDictConfig", "ModuleWrapPolicy", "CustomPolicy",
    "transformer_auto_wrap_policy", "size_based_auto_wrap_policy", "lambda_auto_wrap_policy",
    "ConfigError", "ConfigTypeError", "NotBuiltError", "OutOfMemoryError", "CoreError",
    "StateError", "memory_stats", "copy_stats", "CommQuant",
]

# State dicts and checkpoints (fsdp/state_dict.py, fsdp/checkpoint.py).
from .fsdp.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from .errors import CheckpointDamaged, MetaDeviceError, StateDictError, UnsafeFileError  # noqa: E402
from .errors import (InitDiffersWarning, MistakeWarning, ReplicaDriftWarning,  # noqa: E402
                     StaleOptimizerError, UnsyncedStepWarning)
from .options import (FullOptimStateDictConfig, LocalOptimStateDictConfig,  # noqa: E402
                      OptimStateDictConfig, ShardedOptimStateDictConfig)
from .fsdp.state_dict import StateDictSettings  # noqa: E402

__all__ += ["MetaDeviceError", "StateDictError", "UnsafeFileError", "CheckpointDamaged",
            "StateDictSettings", "OptimStateDictConfig",
            "FullOptimStateDictConfig", "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig",
            "save_checkpoint", "load_checkpoint", "latest_checkpoint"]

# One consolidated file from a sharded checkpoint, without a process group
# (state/consolidate.py).
from .state.consolidate import consolidate  # noqa: E402

__all__ += ["consolidate"]

# Mistakes that train wrong without an error under torch's FSDP, made loud
# (checks/): the error and the warnings they raise.
__all__ += ["StaleOptimizerError", "MistakeWarning", "InitDiffersWarning", "UnsyncedStepWarning",
            "ReplicaDriftWarning"]

# FSDP2's API: fully_shard and FSDPModule (fsdp2/).
from .fsdp2 import (CPUOffloadPolicy, DataParallelMeshDims, FSDPModule,  # noqa: E402
                    MixedPrecisionPolicy, OffloadPolicy, UnshardHandle, fully_shard,
                    register_fsdp_forward_method, share_comm_ctx)

__all__ += ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method",
            "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy", "DataParallelMeshDims",
            "share_comm_ctx"]
from . import fsdp2 as _fsdp2  # noqa: E402

if hasattr(_fsdp2, "GradientReductionHandle"):  # where torch has it (torch_facts.VERSIONED)
    GradientReductionHandle = _fsdp2.GradientReductionHandle
    __all__ += ["GradientReductionHandle"]

# The rest of torch.distributed.fsdp's names: the optimizer state key type of
# FSDP.rekey_optim_state_dict, and torch's FlatParameter class, which
# flatshard's flat parameters are instances of (fsdp/flat_param.py).
from .fsdp import FlatParameter  # noqa: E402
from .options import OptimStateKeyType  # noqa: E402

__all__ += ["OptimStateKeyType", "FlatParameter"]

# torch's FSDP APIs run on flatshard in the whole process (torch_switch.py;
# `python -m flatshard run SCRIPT` for a script left as it is).
from .torch_switch import (TorchFSDPSwitch, restore_torch_fsdp, torch_fsdp_switch,  # noqa: E402
                           use_for_torch_fsdp)

__all__ += ["use_for_torch_fsdp", "restore_torch_fsdp", "torch_fsdp_switch", "TorchFSDPSwitch"]

# Parameter offload whose optimizer step overlaps backward and the next forward.
from .offload_pipeline import OffloadPipeline, OverlapOffload, overlap_offload  # noqa: E402

__all__ += ["overlap_offload", "OverlapOffload", "OffloadPipeline"]

from .snapshots import Snapshots, SnapshotError  # noqa: E402

__all__ += ["Snapshots", "SnapshotError"]
