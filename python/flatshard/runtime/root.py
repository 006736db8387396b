"""The root's state, one for both wrappers: what the root of a wrapped model
keeps for every member under it (an FSDP1 unit, or a fully_shard state).

  order       the order members ran in the last forward (ForwardOrder): the
              gather-ahead runs and the implicit prefetch read it
  ahead       the gather-ahead budget in bytes on this Comm (runtime/ahead.py)
  bucket      host reductions issued as one collective (runtime/bucket.py)
  inflight    the one deferred device reduction in flight (runtime/inflight.py)
  reduced     whether a member was reduced in this backward
  final       the end-of-backward callback, queued once per backward on the
              autograd engine; whether it is (final_queued) is a flatshard._C.Latch
              (`latch`) that fully_shard's plain pre-backward reads in C
              ([Note: event sequences] in csrc/hooks/shard_events.c)

What the end of backward then does (which members finalize, in what order,
whether the reduction in flight is landed or each member waits for its own)
is the wrapper's: fsdp/api.py's RootState and fsdp2/state.py's FSDPState
pass it in as `final`.

Imports: _C and runtime's ahead, bucket, inflight and order; nothing of
fsdp/ or fsdp2/.
"""
from torch.autograd import Variable

from .. import _C

from .ahead import ahead_bytes, gather_ahead
from .bucket import ReduceBucket, bucket_bytes
from .inflight import InFlight
from .order import ForwardOrder


class Root:
    def __init__(self, comm, final):
        self.order = ForwardOrder()
        self.ahead = ahead_bytes(comm)
        self.bucket = ReduceBucket(bucket_bytes(comm))
        self.inflight = InFlight()
        self.reduced = False
        # set once the end-of-backward callback is queued in this backward
        self.latch = _C.Latch(Variable._execution_engine.queue_callback, final)

    @property
    def final_queued(self):
        return self.latch.set

    @final_queued.setter
    def final_queued(self, value):
        self.latch.set = value

    def gather_ahead(self, member, step, cost):
        """The members gathered in `member`'s all-gather: those that ran after
        it in the last forward (step 1) or before it (-1, backward), while
        their cost(other) bytes fit the budget (runtime/ahead.py)."""
        if not self.ahead:
            return []
        return gather_ahead(self.order, member, step, self.ahead, cost)

    def reduce_issued(self, member, land):
        """`member` defers a reduction now, landed by land(): the one in flight
        from another member is landed first (its buffers go back), so
        backward holds at most one member's reduction buffers beyond its own."""
        self.inflight.land(unless=member)
        self.inflight.issued(member, land)

    def queue_final(self):
        """The end-of-backward callback, queued once per backward."""
        self.latch.fire()

    def abandon_backward(self):
        """A backward that never reached its end (an exception, a dropped
        graph): its bucket's reduce-scatter never ran, so nothing is waited
        for; its callback will not come."""
        self.bucket.cancel()
        self.final_queued = False
