"""Gradient reductions of small groups in one reduce-scatter, on a host Comm.

Each reduce-scatter is a meeting point of all ranks, with a fixed cost per
call (microseconds through shared memory, a millisecond through gloo over
TCP) however few bytes it moves. When every group is small, backward spends
more in those calls than in its compute. The engine can record the
reduce-scatters of several groups in a bucket and issue them as one
([Note: reduction buckets] in csrc/engine/engine.h); this file decides when:

- a reduction joins the root's bucket when the Comm is on the host and the
  reduction is a plain one (no all-reduce hook, no replicas: those run
  Python or a second collective between the reduce-scatter and the write);
- the bucket is flushed once it holds FLATSHARD_REDUCE_BUCKET_BYTES of
  gradients (default: 1 MiB on the torch backend, none on shm) (the unsharded gradients in the reduce dtype), before a
  reduction that cannot join it (another Comm or dtype, a group already in
  it, one too large), and at the end of backward, so the sharded gradients
  are all in place when backward returns, as without buckets;
- a backward that did not finish (reset_iter_state) gives its bucket up
  without a collective.

Every rank sees the same reductions in the same order (the collectives
already require it), so every rank flushes at the same points. A bucket
holds each joined group's reduce-scatter input and output until it flushes:
at most the budget, plus one group's shard per group.

Imports: _C and envvars only.
"""
from .. import _C, envvars

ENV_BYTES = "FLATSHARD_REDUCE_BUCKET_BYTES"
# By Comm backend; others 0. On shm a reduce-scatter costs microseconds, and
# a bucket's bookkeeping cost more than the calls it saved: measured on the
# per-group model (bench_overhead.py; benchmarks/results/overhead.md, "Per-unit
# cost, the impls taking turns step by step"), both APIs' steps were 6-17%
# faster without it.
DEFAULT_BYTES = {"torch": 1 << 20}


def bucket_bytes(comm):
    """The budget for reductions on `comm` (0: no buckets): the
    environment's, else the backend's default."""
    backend = comm.backend if comm is not None else None
    return envvars.read_bytes(ENV_BYTES, DEFAULT_BYTES.get(backend, 0),
                              "every reduction on its own")


class ReduceBucket:
    """The root's bucket. A member is an engine group owner with `c` (its
    _C object, whose reduction joined the bucket's `c`),
    `comm`, `reduce_bytes`, `finish_reduce()` (the Python half of a
    reduction: the new sharded gradients set on the parameters) and
    `drop_reduce()` (forget a reduction that was given up)."""

    __slots__ = ("budget", "c", "members", "nbytes", "comm", "dtype")

    def __init__(self, budget):
        self.budget = budget
        self.c = _C.ReduceBucket()  # this model's own: Comms are shared between models
        self.members = []
        self.nbytes = 0
        self.comm = self.dtype = None

    def admits(self, member, dtype):
        """Whether `member`'s next reduction (in `dtype`) can join; flushes
        first what must go before it. False: reduce it on its own."""
        size = member.reduce_bytes
        if not self.budget or size > self.budget or member.comm.device is not None:
            self.flush()
            return False
        if self.members and (member.comm is not self.comm or dtype != self.dtype or
                             member in self.members or self.nbytes + size > self.budget):
            self.flush()
        return True

    def joined(self, member, dtype):
        """`member`'s reduction joined the Comm's bucket; flush when full."""
        self.members.append(member)
        self.comm, self.dtype = member.comm, dtype
        self.nbytes += member.reduce_bytes
        if self.nbytes >= self.budget:
            self.flush()

    def flush(self):
        """One reduce-scatter for every member, then each member's
        gradients set."""
        if not self.members:
            return
        members = self._take()
        members[0].c.flush_bucket(self.c, tuple(m.c for m in members))
        for m in members:
            m.finish_reduce()

    def cancel(self):
        """Give the bucket up without a collective: nothing is written."""
        if self.members:
            members = self._take()
            members[0].c.cancel_bucket(self.c, tuple(m.c for m in members))
            for m in members:
                m.drop_reduce()

    def _take(self):
        members, self.members, self.nbytes = self.members, [], 0
        self.comm = self.dtype = None
        return members
