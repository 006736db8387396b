"""torch.distributed.fsdp.wrap's names at `flatshard.wrap`: flatshard's
auto-wrap policies (fsdp/wrap.py), and torch's own always_wrap_policy,
enable_wrap and wrap, which flatshard has no counterpart of (the wrapper
accepts torch's policies, and `enable_wrap(wrapper_cls=flatshard.FSDP)`
builds flatshard's units). Names only; nothing is defined here."""
from torch.distributed.fsdp.wrap import always_wrap_policy, enable_wrap, wrap

from .fsdp.wrap import (CustomPolicy, ModuleWrapPolicy, lambda_auto_wrap_policy,
                        size_based_auto_wrap_policy, transformer_auto_wrap_policy)

__all__ = ["always_wrap_policy", "lambda_auto_wrap_policy", "transformer_auto_wrap_policy",
           "size_based_auto_wrap_policy", "enable_wrap", "wrap", "CustomPolicy",
           "ModuleWrapPolicy"]
