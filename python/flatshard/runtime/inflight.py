"""One deferred gradient reduction in flight per model, for both wrappers.

On a device a unit's (FSDP1) or group's (fully_shard) reduce-scatter is
deferred: backward goes on while it runs. The root lets at most one be in
flight: before the next one is issued, and when backward ends, the one in
flight is landed (the stream waits for it, its gradients are written, its
buffers go back), so backward holds one reduction's buffers beyond its own.
On the host nothing is deferred and nothing is ever in flight.

Imports: nothing of flatshard.
"""


class InFlight:
    """The reduction in flight: who issued it and how to land it."""

    __slots__ = ("owner", "_land")

    def __init__(self):
        self.owner = None
        self._land = None

    def issued(self, owner, land):
        """`owner`'s reduction is in flight now; land() finishes it."""
        self.owner, self._land = owner, land

    def land(self, unless=None):
        """Finish the reduction in flight, unless `unless` issued it (its
        next reduction waits for it in the engine)."""
        if self.owner is None or self.owner is unless:
            return
        land, self.owner, self._land = self._land, None, None
        land()

    def forget(self):
        """Drop it without landing (its owner finished it already)."""
        self.owner = self._land = None
