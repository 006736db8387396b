"""The root of an FSDP1 wrapped model: RootState, what the root unit keeps
for every unit under it (runtime/root.Root's order, bucket and reduction in
flight) and what the end of backward does for them. Each unit's own events
are unit.py's; fully_shard's root is fsdp2/root.py's.

Imports: runtime's root and eager, checks (the end of backward's
unsynced-step check); nothing else of flatshard.
"""
from .. import checks
from ..runtime import eager
from ..runtime.root import Root


class RootState(Root):
    """The root unit's runtime/root.Root: every unit of the model, the root
    module (`owner`), and what the end of backward does for them."""

    def __init__(self, owner, units):
        eager.install(RootState)
        super().__init__(owner._unit.c.comm, self._finish_backward)
        self.owner = owner
        self.units = units

    def hand_order(self):
        """Each engine unit's `prev`, the unit that ran before it in the last
        forward (the backward prefetch's), whenever that order changes."""
        for u in self.units:
            p = self.order.previous(u)
            u.c.prev = p.c if p is not None else None

    def end_forward(self):
        self.order.end()
        if not self.order.stable:
            self.hand_order()

    def reduce_issued(self, unit):
        """`unit` is about to defer a reduction (Root.reduce_issued)."""
        super().reduce_issued(unit, unit.land_reduced)

    def begin_forward(self):
        if self.final_queued:  # the last backward never finished: clean up
            self.abandon_backward()
            self._finish_backward()
        self.order.begin()

    def unit_gather_ahead(self, unit, step):
        """The engine units gathered in `unit`'s all-gather (Root.gather_ahead),
        None for none: those on its Comm not gathered yet."""
        comm = unit.c.comm
        run = self.gather_ahead(unit, step, lambda u: u.gathered_bytes if u.c.comm is comm and
                                not u.c.is_unsharded else None)
        return tuple(u.c for u in run) or None

    @eager.hook
    def _finish_backward(self):
        """The end-of-backward callback (Root's `final`): the bucket flushed,
        then every unit finalized."""
        self.final_queued = False
        self.bucket.flush()  # every gradient is in place when backward returns
        self.inflight.forget()  # each unit's finalize waits for its own
        for u in self.units:
            u.finalize()
        checks.backward_ended(self.units)  # gradient sync left off (checks/unsynced.py)
