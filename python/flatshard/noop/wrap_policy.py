"""Units that do not split the model. ZeRO-3 holds one unit's parameters
whole at a time, so a rank's peak is about the largest unit's unsharded
bytes (with the next one prefetched). An auto_wrap_policy that matches no
module (a layer class misnamed, or another model's) leaves one unit with
every parameter: each forward and backward then gathers the whole model on
every rank, as if nothing were sharded at the peak. A unit that holds almost
every parameter (at least LOPSIDED of the bytes, and LOPSIDED_MIN_BYTES) is
nearly as bad.

  fsdp1(plans, policy, world)   the FSDP1 wrapper's units, at wrap time
  fully_shard(root)             a fully_shard tree's groups, at lazy init

flatshard.plan.plan(model, auto_wrap_policy=..., world_size=...) shows the
whole per-rank peak of a policy before any wrapping.

Imports: torch; this package.
"""
from . import class_name, say

LOPSIDED = 0.9  # the share of the parameters' bytes one unit holds
LOPSIDED_MIN_BYTES = 1 << 20  # below this, that unit's gather is no memory peak to speak of


def _mib(n):
    """Bytes, in the largest unit that keeps a whole number before the point."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{int(n)} B"


def _lopsided(sizes, what):
    """sizes: {unit name: unsharded bytes} of two or more units -> warn when
    one holds at least LOPSIDED of the bytes."""
    total = sum(sizes.values())
    name, top = max(sizes.items(), key=lambda kv: kv[1])
    if top < max(LOPSIDED * total, LOPSIDED_MIN_BYTES):
        return
    even = total / len(sizes)
    say("wrap_lopsided", f"{what} {name!r} holds {100 * top / total:.0f}% of the parameters' "
        f"bytes ({_mib(top)} of {_mib(total)}): its all-gather puts that much on every rank "
        f"at once, against {_mib(even)} if the {len(sizes)} units were even, so sharding "
        "saves little at the peak. Wrap its submodules as units of their own (a policy "
        "matching them, or fully_shard on each)")


def _unit_bytes(up):
    return sum(p.numel() * p.element_size() for _, order in up.groups for p, _ in order)


def fsdp1(plans, policy, world):
    """`plans`: the wrapper's UnitPlans, the root last; `policy`: the
    auto_wrap_policy given (None: no warning about it)."""
    if world < 2 or all(up.cfg.strategy.name != "FULL_SHARD" for up in plans):
        return  # only FULL_SHARD reshards after forward: the others hold every unit then
    if policy is not None and len(plans) == 1:
        root = plans[0].module
        say("wrap_nothing", f"auto_wrap_policy={policy!r} wrapped no module of "
            f"{type(root).__name__}: every parameter ({_mib(_unit_bytes(plans[0]))}) is in the "
            "root unit, gathered whole on every rank at each forward and backward. Check what "
            "the policy matches against the model's modules (e.g. ModuleWrapPolicy's classes "
            f"against {sorted({type(m).__name__ for m in root.modules()})[:8]})")
        return
    if len(plans) > 1:
        _lopsided({up.label: _unit_bytes(up) for up in plans}, "unit")


def fully_shard(root):
    """A fully_shard tree of two or more groups resharded after forward,
    over more than one rank."""
    groups = [st for st in root.states if st.group is not None and
              st.reshard_after_forward is not False]
    if len(groups) < 2 or groups[0].group.comm.world_size < 2:
        return
    sizes = {}
    for st in groups:
        g = st.group
        numel = sum(s.numel() for s in g.shapes)
        sizes[st.label.strip(" ()") or class_name(st.modules[0])] = \
            numel * g.dtype.itemsize
    _lopsided(sizes, "fully_shard group")
