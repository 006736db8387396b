"""The process groups and Comms a unit's collectives run over.

Without hybrid sharding a unit runs over its process group's Comm. Under
HYBRID_SHARD (and _HYBRID_SHARD_ZERO2) it shards inside a shard group and
all-reduces its gradient shards across a replicate group: the pair the user
gave (process_group=(shard, replicate), or a 2-D device_mesh), or groups made
here from LOCAL_WORLD_SIZE. Making groups is collective, so it happens after
the ranks agreed on the wrap (runtime/consistency.py), never in config.py.
"""
import torch.distributed as dist

from ..runtime.comm import comm_for

_HYBRID_GROUPS = {}


def hybrid_groups(spec):
    """UnitConfig.hybrid -> (shard group, replicate group). From
    LOCAL_WORLD_SIZE, the groups are made once: each host's ranks shard, the
    ranks with one local rank across hosts replicate (every rank makes every
    group, in one order, as torch.distributed requires)."""
    if isinstance(spec, tuple):
        return spec[:2]
    world, rank = dist.get_world_size(), dist.get_rank()
    key = (spec, world)
    if key not in _HYBRID_GROUPS:
        hosts = world // spec
        mine = [None, None]
        for h in range(hosts):
            ranks = list(range(h * spec, (h + 1) * spec))
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[0] = g
        for j in range(spec):
            ranks = [j + h * spec for h in range(hosts)]
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[1] = g
        _HYBRID_GROUPS[key] = tuple(mine)
    return _HYBRID_GROUPS[key]


def unit_comms(cfg):
    """A unit's (group, comm, replicate comm or None, replicas_only): group is
    the one comm runs over. Under HYBRID_SHARD a shard group of one rank has
    nothing to shard: the unit runs NO_SHARD over the replicas."""
    if cfg.hybrid is None:
        return cfg.group, comm_for(cfg.group, cfg.comm_backend, cfg.device), None, False
    shard, replicate = hybrid_groups(cfg.hybrid)
    if dist.get_world_size(shard) == 1:
        return replicate, comm_for(replicate, cfg.comm_backend, cfg.device), None, True
    rcomm = None
    if dist.get_world_size(replicate) > 1:
        rcomm = comm_for(replicate, cfg.comm_backend, cfg.device)
    return shard, comm_for(shard, cfg.comm_backend, cfg.device), rcomm, False
