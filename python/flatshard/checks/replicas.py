"""Item: replicas that drift apart.

Some ranks must hold equal values: under NO_SHARD every rank holds each
parameter whole, under hybrid sharding (FSDP1's HYBRID_SHARD, fully_shard
on a 2-D mesh or dp_mesh_dims' replicate dim) the ranks of a replicate
group the same shard. (SHARD_OPTIM's whole parameters are all-gathered
from the shards after every step, fsdp/zero1.py: they cannot drift, and
are not compared.) A step or a write
that runs on some of them only, or a kernel that rounds differently, lets
them drift apart, and nothing in torch notices. Each wrap registers here,
per unit, the comm over those ranks and how to read the values
(`Replicas`); an optimizer's first step picks the units whose parameters it
holds, and every k-th of its steps (after the update: hooks.py) the ranks
all-gather a CRC-32C of each value over that comm (one collective per comm,
a few integers per parameter) and warn, naming the first parameter that
differs and the ranks. k: the FSDP1 wrapper's check_replicas_every, else
FLATSHARD_CHECK_REPLICAS_EVERY, else DEFAULT (0: never); the same on
every rank, as every rank steps alike.
"""
import warnings
import weakref

import torch

from .. import envvars
from ..errors import ReplicaDriftWarning, bad_value
from ..runtime.comm import all_gather_into
from . import text
from .fingerprint import crcs

ENV = "FLATSHARD_CHECK_REPLICAS_EVERY"
ENTRY = "Replicas that drift apart"
DEFAULT = 1000
_TARGETS = []                             # Replicas, in registration order
_PLANS = weakref.WeakKeyDictionary()      # optimizer -> [steps, [weakref to Replicas]]

_OFF = "or the FSDP1 wrapper's check_replicas_every=0"


def every(value, arg="check_replicas_every"):
    """The number of steps between two comparisons: `value`, else the
    environment, else DEFAULT; 0: never."""
    allowed = (f"a whole number of optimizer steps (0: never), or None ({ENV}, default "
               f"{DEFAULT})")
    if value is None:
        raw = envvars.read(ENV)
        if raw is None:
            return DEFAULT
        if not raw.isdigit():
            raise bad_value(ENV, raw, "expected a whole number of optimizer steps (0: never)")
        return int(raw)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_value(arg, value, allowed)
    return value


class Replicas:
    """One unit's values that must be equal on every rank of `comm`.
    owner: the unit (held weakly); params(owner): the parameters an
    optimizer holds; pieces(owner): [(name, tensor)], the same names and
    sizes on every rank; ranks: comm's ranks in the world; label(owner):
    the unit's name; what: why they must be equal, for the message;
    device: where comm's tensors live."""

    def __init__(self, owner, params, pieces, comm, ranks, label, what, k, device):
        self.owner = weakref.ref(owner)
        self.params, self.pieces = params, pieces
        self.comm, self.ranks, self.label, self.what, self.k = comm, ranks, label, what, k
        self.device = device


def watch(target):
    """Register `target` (a Replicas) if its k is not 0."""
    if target.k:
        _TARGETS.append(target)


def plan(optimizer):
    """At `optimizer`'s first step: the registered units it updates."""
    if not _TARGETS:
        return
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    mine, alive = [], []
    for t in _TARGETS:
        owner = t.owner()
        if owner is None:
            continue
        alive.append(t)
        if any(id(p) in held for p in t.params(owner)):
            mine.append(weakref.ref(t))
    _TARGETS[:] = alive
    if mine:
        _PLANS[optimizer] = [0, mine]


def after_step(optimizer):
    entry = _PLANS.get(optimizer)
    if entry is None:
        return
    entry[0] += 1
    due = [t for t in (r() for r in entry[1]) if t is not None and entry[0] % t.k == 0]
    if due:
        compare(due, f"step {entry[0]} of {type(optimizer).__name__}")


def compare(targets, when):
    """All-gather each target's fingerprints over its comm (one collective
    per comm, in the targets' order: the same on every rank) and warn on
    the first difference."""
    by_comm = {}
    for t in targets:
        owner = t.owner()
        if owner is not None:
            by_comm.setdefault(id(t.comm), []).append((t, t.pieces(owner)))
    for members in by_comm.values():
        comm, device = members[0][0].comm, members[0][0].device
        names, local = [], []
        for t, pieces in members:
            names += [(t, n) for n, _ in pieces]
            local += crcs(pieces)
        if not local:
            continue
        mine = torch.tensor(local, dtype=torch.int64, device=device)
        out = torch.empty(comm.world_size * len(local), dtype=torch.int64, device=device)
        all_gather_into(comm, out, mine, tag="check_replicas")
        rows = out.view(comm.world_size, len(local)).cpu()
        differs = (rows != rows[0]).any(dim=0).nonzero().flatten().tolist()
        if differs:
            _warn(names, rows, differs, when)


def _warn(names, rows, differs, when):
    j = differs[0]
    t, name = names[j]
    ranks, what, owner = t.ranks, t.what, t.owner()
    label = t.label(owner) if owner is not None else "?"
    odd = [ranks[r] for r in range(rows.shape[0]) if rows[r, j] != rows[0, j]]
    more = f" ({len(differs)} values in all differ)" if len(differs) > 1 else ""
    warnings.warn(
        f"flatshard: rank {text.this_rank()}: after {when}, parameter {name} of unit "
        f"{label!r} differs between rank {ranks[0]} and {text.ranks(odd)}, which must hold "
        f"equal values ({what}){more}: the replicas have drifted apart, and each now trains "
        "its own model. Look for code that runs on some ranks only (a step, a clip or a "
        "write to the parameters under `if rank == ...`, a skipped step on one rank) and for "
        "nondeterministic kernels; to start again from equal values, load a checkpoint into "
        f"every rank. {text.guide(ENTRY, ENV, _OFF)}",
        ReplicaDriftWarning, stacklevel=2)


# ----------------------------------------------------------------------
# what each wrapper's units hold, read through their fields (no import)


def flat_pieces(groups):
    """An FSDP1 unit's FlatGroups -> [(name, this rank's piece of each
    parameter in its shard)]: the whole parameter under NO_SHARD."""
    out = []
    for g in groups:
        shard = g.shard.detach()
        for e, aliases in zip(g.entries, g.aliases):
            if e.piece_numel:
                out.append((aliases[0].fqn, shard.narrow(0, e.shard_offset, e.piece_numel)))
    return out


def sharded_pieces(state):
    """A fully_shard state -> [(name, this rank's shard of each of its
    group's parameters)], named in the whole model once lazy init named
    them."""
    g = state.group
    names = state.param_fqns or g.names
    return [(names[i], g.local(i).detach()) for i in range(len(g.sharded))]
