"""Gathering ahead: the next members' all-gathers joined to this one's, on a
Comm whose collectives have a fixed cost per call. A member is what gathers
and reshards as one: an FSDP1 unit, or a fully_shard state's shard group.

Through the process group (the torch backend: gloo over TCP) every
collective costs about a millisecond however few bytes it moves; a model of
small members spends its step in those calls. The engine can gather several
members in one all-gather ([Note: coalesced gathers] in
csrc/engine/engine.h). This file picks them: when a member gathers, the members
that ran right after it in the last forward (in backward: right before it)
join its gather, while together they hold at most
FLATSHARD_GATHER_AHEAD_BYTES of gathered parameters. They are then
gathered when their own hook runs, and reshard after their own use as
always. Until two forwards in a row ran in one order, each member gathers
on its own.

The default budget is 1 MiB on the torch backend and 0 (nothing gathered
ahead) on shared memory, where a collective costs microseconds and gathering
128 members' collectives into 3 was measured to change no step time
(benchmarks/results/overhead.md, "Gathering ahead"): there it would only
raise the memory peak. A member
larger than what is left of the budget is not gathered ahead, so models of
large members are unaffected. The bytes are the same and summed nowhere:
gathering ahead changes no bit.

Every rank follows the same order (the collectives already require it), so
every rank joins the same members. Used by the FSDP1 wrapper's units
(fsdp/unit.py) and fully_shard's states (fsdp2/state.py).

Imports: envvars only.
"""
from .. import envvars

ENV_BYTES = "FLATSHARD_GATHER_AHEAD_BYTES"
DEFAULT_BYTES = {"torch": 1 << 20}  # by Comm backend; others 0


def ahead_bytes(comm):
    """The budget for members on `comm`: the environment's, else the
    backend's default; 0 on a device (its prefetches overlap instead) and
    on one rank (nothing to meet for)."""
    if comm is None or comm.device is not None or comm.world_size == 1:
        return 0
    return envvars.read_bytes(ENV_BYTES, DEFAULT_BYTES.get(comm.backend, 0),
                              "every member gathers on its own")


def gather_ahead(order, item, step, budget, cost):
    """The items next to `item` in the last forward (step 1: those after
    it; -1: those before it, for backward) whose gathers join item's, in
    that order: while each one's cost(other) fits in what is left of
    `budget`. cost(other) is its gathered bytes, or None when it cannot join
    (already gathered, another Comm): the run stops there. Empty while the
    neighbour is gathered already (it came with an earlier run); going
    forward outside a forward (a checkpointed module's recomputation in
    backward would gather modules whose backward is over); and until two
    forwards in a row ran in one order. Each rank picks its runs from its own
    order, so ranks whose orders differ would issue all-gathers of different
    sizes, which gloo answers by ending the process: a rank that skips a
    module in the first step is reported at the collective's timeout instead,
    naming the module (docs/troubleshooting.md)."""
    if not budget or not order.stable or (step > 0 and not order.running):
        return []
    run = []
    for other in order.neighbours(item, step):
        size = cost(other)
        if size is None or size > budget:
            break
        budget -= size
        run.append(other)
    return run
