"""What the FSDP1 wrapper hands flatshard's mistake checks (checks/): its
units' parameters, values and gradient sync, read through their fields.

  meta_names     before the plan: the parameters still on the meta device
                 (materialized by the plan: left out of the comparison)
  compare_init   after sync_module_states: the ranks' initial values
  built          the units built: the originals they replaced, and the
                 replicas each must keep equal (NO_SHARD, hybrid
                 sharding)
  no_sync        no_sync() entered for these units
"""
import torch.distributed as dist

from .. import checks
from .groups import hybrid_groups, unit_comms

WRAPPER = "FullyShardedDataParallel"
replicas_every = checks.replicas_every
_NO_SYNC = checks.Watch(lambda u: u.sync_grads, lambda u: _params(u), lambda u: u.name,
                        "no_sync()")


def meta_names(module):
    return {n for n, p in module.named_parameters() if p.is_meta}


def compare_init(cfg, plan, skip, synced):
    """plan: the agreed UnitPlans; skip: names left out (meta_names)."""
    named = [(aliases[0].fqn, p) for up in plan for _, order in up.groups
             for p, aliases in order if aliases[0].fqn not in skip]
    replicate = hybrid_groups(cfg.hybrid)[1] if cfg.hybrid is not None else None
    checks.compare_init([cfg.group, replicate], named, WRAPPER, synced)


def _params(u):
    """What an optimizer of this unit holds: the flat shards, or the
    originals with use_orig_params."""
    return [g.shard for g in u.groups] + [p for g in u.groups for p in g.params]


def built(wrappers, every):
    """wrappers: the FSDP modules one constructor built; every: the steps
    between replica comparisons (0: never)."""
    for w in wrappers:
        u, cfg = w._unit, w._cfg
        if not cfg.use_orig_params:
            checks.replaced([p for g in u.groups for p in g.params],
                            [al[0].fqn for g in u.groups for al in g.aliases], WRAPPER)
        group, comm, replicate, _ = unit_comms(cfg)
        if replicate is not None:
            target = (replicate, hybrid_groups(cfg.hybrid)[1],
                      "hybrid sharding: the ranks of a replicate group hold the same shard")
        elif u.no_shard:
            target = (comm, group, "NO_SHARD: every rank holds each parameter whole")
        else:  # sharded; SHARD_OPTIM's whole parameters are all-gathered from the
            continue  # shards after every step (zero1.py): they cannot drift
        comm, group, what = target
        if comm.world_size > 1:
            checks.watch_replicas(checks.Replicas(
                u, _params, lambda u: checks.replicas.flat_pieces(u.groups),
                comm, dist.get_process_group_ranks(group), lambda u: u.name, what, every,
                cfg.device))


def no_sync(units):
    checks.sync_off(units, _NO_SYNC)
