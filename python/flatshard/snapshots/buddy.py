"""The buddy copy: each rank's snapshot also held by a rank on another host
(its buddy), in a second segment on the buddy's host, so that the loss of a
host loses no step ([Note: buddy copy]).

[Note: buddy copy] Hosts are what the shm segment sees (runtime/comm.py's
_host_identity). Rank r, the j-th rank of host i (hosts in order of their
first rank), is held by the (j mod n)-th rank of host i+1 (mod the number of
hosts, n that host's ranks); on one host there is no buddy. After commit(k)
starts the rank's own copy, a thread of the snapshot packs the same parts
(tensors, then the record) into one buffer (the optimizer step waits only
for that), sends it to the buddy over a gloo group of its own and receives
the ranks it holds, writing each into `flatshard-snap-JOB-rHOLDER-buddyOWNER`
(engine/snapshot.h, the same slots, CRCs and complete mark). It overlaps the
next step's forward and backward; the commit of step k waits for it before
announcing k, so a step counts only when every own and buddy copy holds it.
"""
import threading

import torch
import torch.distributed as dist

from .. import _C, envvars
from ..errors import ConfigError, bad_value
from ..runtime.comm import _host_identity
from . import names
from .parts import as_bytes


def host_of(rank):
    """This rank's host as the snapshots see it; FLATSHARD_SNAPSHOT_HOST_RANKS=N
    (tests) makes each N consecutive ranks a host of their own."""
    raw = envvars.read("FLATSHARD_SNAPSHOT_HOST_RANKS")
    if not raw:
        return _host_identity()
    if not raw.isdigit() or int(raw) < 1:
        raise bad_value("FLATSHARD_SNAPSHOT_HOST_RANKS", raw, "a whole number of ranks >= 1")
    return f"{_host_identity()}#{rank // int(raw)}"


def holders(hosts):
    """hosts[r]: rank r's host -> holder[r], the rank that holds r's buddy
    copy (None on one host)."""
    order = list(dict.fromkeys(hosts))
    ranks = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    if len(order) < 2:
        return [None] * len(hosts)
    out = []
    for r, h in enumerate(hosts):
        nxt = ranks[order[(order.index(h) + 1) % len(order)]]
        out.append(nxt[ranks[h].index(r) % len(nxt)])
    return out


class BuddyCopy:
    """One rank's side of the buddy copies: the copy it sends, the copies it
    holds."""

    def __init__(self, job, rank, hosts, budget):
        self.job, self.rank, self.budget = job, rank, budget
        self.holder = holders(hosts)
        self.owners = [r for r, h in enumerate(self.holder) if h == rank]
        # made by every rank (a collective) when there is a buddy: every rank knows hosts
        self.group = dist.new_group(backend="gloo") if self.holder[rank] is not None else None
        self.segs = {}
        self._thread = self._error = None
        self._packed = threading.Event()

    @property
    def active(self):
        return self.holder[self.rank] is not None

    def name(self, owner):
        return names.buddy_name(self.job, self.rank, owner)

    def start(self, step, parts):
        """Send `parts` (this rank's tensors and record) of step `step` to the
        buddy and take the owners' copies, on a thread; the caller keeps the
        parts unchanged until sources_done()."""
        self.wait()
        self._packed.clear()
        self._thread = threading.Thread(target=self._run, args=(step, parts), daemon=True,
                                        name="flatshard-snapshot-buddy")
        self._thread.start()

    def sources_done(self):
        if self._thread is not None:
            self._packed.wait()

    def wait(self):
        """Until the copies of the step in flight are sent and written."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def _run(self, step, parts):
        try:
            self._exchange(step, parts)
        except BaseException as e:  # raised by wait(), on the caller's thread
            self._error = e
        finally:
            self._packed.set()

    def _exchange(self, step, parts):
        sizes = torch.tensor([p.numel() * p.element_size() for p in parts], dtype=torch.int64)
        buf = torch.cat([as_bytes(p) for p in parts])
        self._packed.set()
        holder, g = self.holder[self.rank], self.group
        heads = {o: torch.empty(3, dtype=torch.int64) for o in self.owners}
        head = torch.tensor([step, len(parts), buf.numel()], dtype=torch.int64)
        works = [dist.isend(head, holder, group=g)]
        works += [dist.irecv(heads[o], o, group=g) for o in self.owners]
        for w in works:
            w.wait()
        got = {o: (torch.empty(int(heads[o][1]), dtype=torch.int64),
                   torch.empty(int(heads[o][2]), dtype=torch.uint8)) for o in self.owners}
        works = [dist.isend(sizes, holder, group=g), dist.isend(buf, holder, group=g)]
        for o in self.owners:
            works += [dist.irecv(got[o][0], o, group=g), dist.irecv(got[o][1], o, group=g)]
        for w in works:
            w.wait()
        for o in self.owners:
            if int(heads[o][0]) != step:
                raise RuntimeError(f"flatshard.Snapshots: rank {o} sent step "
                                   f"{int(heads[o][0])} for its buddy copy, expected {step}")
            osizes, obuf = got[o]
            at, ps = obuf.data_ptr(), []
            for n in osizes.tolist():
                ps.append((at, n))
                at += n
            seg = self.segs.get(o)
            if seg is None:
                seg = self.segs[o] = _C.Snapshot(self.name(o), create=True)
            try:
                seg.write(step, ps, budget=self.budget)
            except ValueError as e:
                raise ConfigError(f"flatshard.Snapshots: budget={self.budget} (or "
                                  f"FLATSHARD_SNAPSHOT_BUDGET) is too small for the buddy copy "
                                  f"of rank {o}: {e}") from None
            seg.wait()

    def drop_after(self, step):
        """Steps newer than `step` in the copies held: not committed."""
        for seg in self.segs.values():
            for i, s in enumerate(seg.slots()):
                if s[0] and s[1] > step:
                    seg.drop(i)

    def open_held(self):
        for o in self.owners:
            if o not in self.segs:
                self.segs[o] = _C.Snapshot(self.name(o), create=True)

    def segment_bytes(self):
        return sum(s.segment_bytes() for s in self.segs.values())

    def close(self, remove):
        try:
            self.wait()
        finally:
            for o, seg in self.segs.items():
                seg.close()
                if remove:
                    try:
                        _C.snapshot_unlink(self.name(o))
                    except FileNotFoundError:
                        pass
            self.segs = {}
