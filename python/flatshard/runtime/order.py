"""The order in which a model's members (FSDP1 units, fully_shard states)
ran in its last forward, kept by the root for prefetching: the next one in
forward, the previous one in backward. Used by the FSDP1 wrapper's units
(fsdp/api.py's RootState) and by fully_shard's states (fsdp2/state.py's
FSDPState)."""


class ForwardOrder:
    def __init__(self):
        self.order, self.position = [], {}
        self._current = None  # this forward's, while it runs
        self._ran = set()     # ids of what ran in it
        self.stable = False   # the last forward ran in the order of the one before

    @property
    def running(self):
        """Whether a forward is running (not a recomputation in backward)."""
        return self._current is not None

    def begin(self):
        self._current, self._ran = [], set()

    def end(self):
        """The forward is over: its order is the one to follow."""
        if self._current:
            self.stable = self._current == self.order
            self.order = self._current
            self.position = {id(m): i for i, m in enumerate(self.order)}
        self._current = None

    def record(self, item):
        """`item` runs now; return what ran after it last time (or None)."""
        if self._current is not None:
            self._ran.add(id(item))
            if not self._current or self._current[-1] is not item:
                self._current.append(item)
        i = self.position.get(id(item))
        return self.order[i + 1] if i is not None and i + 1 < len(self.order) else None

    def previous(self, item):
        """What ran before `item` last time (or None)."""
        i = self.position.get(id(item))
        return self.order[i - 1] if i else None

    def neighbours(self, item, step):
        """What ran after `item` last time, nearest first (step 1), or
        before it (step -1); nothing when `item` did not run."""
        i = self.position.get(id(item))
        if i is None:
            return
        i += step
        while 0 <= i < len(self.order):
            yield self.order[i]
            i += step

    def ran(self, item):
        """Whether `item` ran in the forward now running (or just ended)."""
        return id(item) in self._ran
