"""share_comm_ctx: torch's call to let several fully_shard roots (pipeline
stages) share their communication streams.

On CUDA torch gives each root its own all-gather, reduce-scatter and
all-reduce streams, and this call makes them one set, against memory
fragmentation between streams. flatshard's collectives run on the stream of
the Comm of their process group (runtime/comm.py), which every module sharded
over the same group shares already, and on CPU there are no streams: the
modules are checked and nothing else changes.
"""
from ..errors import bad_type, bad_value
from .module import FSDPModule


def share_comm_ctx(modules):
    """Let the fully_shard `modules` (a list of FSDPModules, typically each
    pipeline stage's root) share communication streams. Already so in
    flatshard (one stream per process group's Comm; none on CPU): checks
    the list and returns None. A module that is not an FSDPModule is a
    ValueError, as in torch."""
    if not isinstance(modules, (list, tuple)):
        raise bad_type("modules", modules, "a list of modules that fully_shard was applied to")
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise bad_value("modules", type(m).__name__, "expects a list of FSDPModules "
                            "(modules fully_shard was applied to)")
