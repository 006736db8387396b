"""Item: ranks that start from different weights.

A per-rank seed (torch.manual_seed(seed + rank) before the model is built)
gives every rank its own initial values; each rank then shards its own, and
the model trained is a patchwork of them, silently in torch. At wrap time
each rank fingerprints every parameter it wraps (fingerprint.py: a CRC-32C
of its bytes) and the ranks compare them through the wrap agreement
(runtime/consistency.py: O(1) store operations per rank when they agree);
where they differ every rank warns, naming the first parameter and the
ranks. Left out by the wrappers: parameters materialized from the meta
device (param_init_fn, reset_parameters()), and ignored ones. Under
sync_module_states=True the comparison runs after the broadcast, which must
have made them equal. A warning, not an error: a script that loads a
checkpoint into every rank after wrapping starts from equal weights all
the same.
"""
import warnings

import torch.distributed as dist

from .. import envvars
from ..errors import InitDiffersWarning
from ..runtime import consistency
from . import text
from .fingerprint import crcs

ENV = "FLATSHARD_CHECK_INIT"
ENTRY = "Ranks that start from different weights"


def compare(groups, named, wrapper, synced=False):
    """groups: process groups (None skipped) whose ranks must hold equal
    values; named: [(name, tensor)] in the same order on every rank;
    wrapper: "FSDP" or "fully_shard"; synced: after sync_module_states'
    broadcast."""
    # ranks as threads of one process (torch's threaded test group) share
    # this process' agreement rounds: their values are not compared
    groups = [g for g in groups
              if g is not None and "threaded" not in str(dist.get_backend(g)).lower()]
    if not groups or not envvars.read_flag(ENV, True):
        return
    lines = [f"{n} {c:08x}" for (n, _), c in zip(named, crcs(named))]
    for group in groups:
        consistency.agree(group, lambda: (None, lines),
                          on_differ=lambda texts, g=group: _warn(g, texts, wrapper, synced))


def _warn(group, texts, wrapper, synced):
    global_ranks = dist.get_process_group_ranks(group)
    width = max(len(t) for t in texts)
    rows = [t + [""] * (width - len(t)) for t in texts]
    differing = [i for i in range(width) if any(r[i] != rows[0][i] for r in rows)]
    if not differing:
        return
    first = differing[0]
    name = next(r[first] for r in rows if r[first]).rsplit(" ", 1)[0]
    odd = [global_ranks[k] for k, r in enumerate(rows) if r[first] != rows[0][first]]
    values = ", ".join(f"0x{r[first].rsplit(' ', 1)[-1]} on rank {global_ranks[k]}"
                       for k, r in enumerate(rows)
                       if k == 0 or global_ranks[k] == odd[0])
    more = f", and {len(differing)} parameters in all differ" if len(differing) > 1 else ""
    how = ("even after sync_module_states=True broadcast rank 0's values, which should have "
           "made them equal (a parameter replaced while it was broadcast?)" if synced else
           f"each rank shards its own values, so the model {wrapper} trains is a patchwork of "
           "every rank's initialization")
    warnings.warn(
        f"flatshard: rank {text.this_rank()}: the ranks wrap different initial values: "
        f"parameter {name} differs between rank {global_ranks[0]} and {text.ranks(odd)} "
        f"(CRC-32C {values}){more}; {how}. Give every rank the same seed before building "
        "the model (torch.manual_seed(seed), not seed + rank), or wrap with "
        "FSDP(..., sync_module_states=True) to broadcast rank 0's values, or load the same "
        "checkpoint into every rank after wrapping. "
        f"{text.guide(ENTRY, ENV, 'when a checkpoint is loaded after wrapping')}",
        InitDiffersWarning, stacklevel=4)
