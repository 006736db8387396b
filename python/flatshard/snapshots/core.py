"""flatshard.Snapshots: every rank's state after an optimizer step, kept in
shared memory on its host (engine/snapshot.h) so that a rank killed and
restarted by torchrun resumes from the last step every rank holds, with no
step lost and the same bits as a run that never failed.

    snaps = flatshard.Snapshots(model, optimizer, stateful=[sampler])
    for step in range(snaps.restore(), steps):
        ...  # forward, backward, optimizer.step()
        snaps.commit(step)
    snaps.close()

[Note: commit] commit(k) starts the copy of step k on the snapshot's thread
(it overlaps the next forward and backward; an optimizer step pre-hook waits
for it before the parameters change). Step k counts once every rank holds
it: at the next commit (or close) each rank announces k through the process
group's store and waits until all have. A rank writes k+1 only after that,
into the slot of k-1, so every rank always holds the last step that counted,
whole, whatever point a crash hits. restore() agrees across the ranks on the
newest step every rank holds with valid checksums (a step some rank held but
not all is dropped, to be computed again).
"""
import atexit
import os
import signal
import sys
import weakref

import torch
import torch.distributed as dist

from .. import _C, envvars
from ..errors import ConfigError, ConfigTypeError, bad_value
from . import names, record
from .buddy import BuddyCopy, host_of
from .parts import BufferPart, SlotPart


class SnapshotError(RuntimeError):
    """No step can be restored from the snapshots: what was lost, on which
    rank, and where to resume from instead."""


def _fault():
    """FLATSHARD_SNAPSHOT_FAULT (for tests): (point, step, rank) or None. It
    fires in the first run of a torchrun job only."""
    raw = envvars.read("FLATSHARD_SNAPSHOT_FAULT")
    if not raw or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    bits = raw.split(":")
    if len(bits) not in (2, 3) or bits[0] not in ("copy", "commit") or \
            not all(b.isdigit() for b in bits[1:]):
        raise bad_value("FLATSHARD_SNAPSHOT_FAULT", raw,
                        "expected copy:STEP[:RANK] or commit:STEP[:RANK]")
    return bits[0], int(bits[1]), int(bits[2]) if len(bits) == 3 else 0


def _die():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _at_exit(ref):
    """A normal end of the interpreter removes the segment; an uncaught
    exception keeps it (the job will be restarted and resume from it)."""
    snaps = ref()
    if snaps is not None and snaps._snap is not None and \
            getattr(sys, "last_value", None) is None:
        snaps._remove()


class Snapshots:
    """Snapshots(model, optimizer, stateful=(), *, every=1, job=None, budget=None,
    checkpoint_dir=None)

    model: the sharded model (the FSDP1 wrapper or a fully_shard module);
    optimizer: its optimizer (a torch.optim.Optimizer over its parameters);
    stateful: objects with state_dict()/load_state_dict() (a sampler, a data
    loader, a scheduler, a GradScaler), a list or a dict of names to objects;
    every: snapshot every `every`-th step (the others are computed again after
    a failure); job: the name the segments carry (default: torchrun's
    TORCHELASTIC_RUN_ID); budget: the most bytes of shared memory this rank's
    segment may hold (default FLATSHARD_SNAPSHOT_BUDGET, 0: no bound);
    checkpoint_dir: where flatshard.save_checkpoint writes, named in the
    errors that send the user there.
    """

    def __init__(self, model, optimizer, stateful=(), *, every=1, job=None, budget=None,
                 checkpoint_dir=None):
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f"flatshard.Snapshots: every={every!r} is not allowed; a whole "
                              "number of steps >= 1")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigTypeError(f"flatshard.Snapshots: optimizer is "
                                  f"{type(optimizer).__name__}; expected a torch.optim.Optimizer")
        if isinstance(stateful, dict):
            objs = dict(stateful)
        else:
            objs = {f"{i}:{type(o).__name__}": o for i, o in enumerate(stateful)}
        for n, o in objs.items():
            if not (callable(getattr(o, "state_dict", None)) and
                    callable(getattr(o, "load_state_dict", None))):
                raise ConfigTypeError(f"flatshard.Snapshots: stateful object {n!r} has no "
                                      "state_dict()/load_state_dict()")
        if budget is None:
            budget = envvars.read_bytes("FLATSHARD_SNAPSHOT_BUDGET", 0, "no bound")
        if not isinstance(budget, int) or budget < 0:
            raise ConfigError(f"flatshard.Snapshots: budget={budget!r} is not allowed; a whole "
                              "number of bytes >= 0 (0: no bound)")
        if not dist.is_initialized():
            raise ConfigError("flatshard.Snapshots: the default process group is not "
                              "initialized; call torch.distributed.init_process_group first")
        self.model, self.optimizer, self.stateful = model, optimizer, objs
        self.every, self.budget, self.checkpoint_dir = every, budget, checkpoint_dir
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.job = names.job_name(job)
        self.name = names.segment_name(self.job, self.rank)
        self.committed = None  # the newest step every rank holds
        self._fault = _fault()
        self._store = dist.distributed_c10d._get_default_store()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._keys = f"flatshard/snapshots/{self.job}/{restart}/"
        self._snap = None
        self._pending = None  # the step whose copy was started and that does not count yet
        self._keep = None     # its sources, alive until the copy is done
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, host_of(self.rank))
        self._hosts = hosts
        self._buddy = BuddyCopy(self.job, self.rank, hosts, budget)
        self._hook = optimizer.register_step_pre_hook(self._before_step)
        atexit.register(_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ restore

    def restore(self):
        """Put back this rank's state of the newest step whose every rank's
        part is held whole (checksums checked) by its own copy or its buddy
        copy; -> the step to start from (0 when there is none). Every rank
        calls it, before training."""
        self._open()
        mine = self._survey()
        everyone = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        saved_worlds = {w for r in everyone for h in r["held"].values() for w in h.values()}
        if saved_worlds - {self.world_size}:
            raise SnapshotError(
                f"flatshard.Snapshots: the snapshots of job {self.job!r} were taken at world "
                f"size {sorted(saved_worlds)}, this job has {self.world_size} ranks; restoring "
                f"on another world size is not built in this version. {self._resume_hint()}")
        ranks = range(self.world_size)
        held = [set().union(*(r["held"].get(o, {}) for r in everyone)) for o in ranks]
        damaged = [[d for r in everyone for d in r["damaged"].get(o, [])] for o in ranks]
        common = set.intersection(*held)
        if not common:
            if not any(held) and not any(damaged):
                return 0
            newest = max((max(h) for h in held if h), default=None)
            lines = [f"rank {o}: holds steps {sorted(h) or 'none'}"
                     + (f"; {'; '.join(damaged[o])}" if damaged[o] else "")
                     for o, h in enumerate(held)]
            lost = [o for o in ranks if newest not in held[o]]
            raise SnapshotError(
                f"flatshard.Snapshots: no step of job {self.job!r} is held whole by every rank "
                f"(the newest any rank holds: {newest}), so none can be restored; at step "
                f"{newest} both copies (own and buddy) of the parts of rank(s) {lost} are lost "
                f"or damaged:\n  " + "\n  ".join(lines) + f"\n{self._resume_hint()}")
        step = max(common)
        for seg in [self._snap] + list(self._buddy.segs.values()):
            for i, s in enumerate(seg.slots()):
                if s[0] and s[1] > step:
                    seg.drop(i)  # not held for every rank: computed again
        part = self._fetch(step, everyone)
        where = f"step {step} of rank {self.rank}"
        rec = record.load_record(part.read_all(part.nparts - 1).numpy().tobytes(), where)
        tensors = record.targets(self.model, self.optimizer, rec, where)
        if len(tensors) != part.nparts - 1:
            raise SnapshotError(f"flatshard.Snapshots: {where} has {part.nparts - 1} tensor "
                                f"parts, its record describes {len(tensors)}")
        with torch.no_grad():
            for i, t in enumerate(tensors):
                part.read_into(i, t)
        part.close()
        record.apply(self.optimizer, self.stateful, rec)
        self.committed = step
        return step + 1

    def _local_segments(self):
        """This job's segments on this host (own and buddy copies); under
        FLATSHARD_SNAPSHOT_HOST_RANKS (one machine as several hosts) those
        of ranks this rank's simulated host holds."""
        segs = names.list_segments(self.job)
        if envvars.read("FLATSHARD_SNAPSHOT_HOST_RANKS"):
            segs = [s for s in segs if s["rank"] < self.world_size and
                    self._hosts[s["rank"]] == self._hosts[self.rank]]
        return segs

    def _survey(self):
        """The steps this host's segments hold whole, by the rank whose part
        they are (with the world size each was taken at), the damaged ones
        named, and where each is (self._where)."""
        held, damaged, self._where = {}, {}, {}
        for seg in self._local_segments():
            owner, name = seg["owner"], seg["name"]
            try:
                snap = _C.Snapshot(name, create=False)
            except (OSError, RuntimeError):
                continue
            for i, (complete, step, nparts, _) in enumerate(snap.slots()):
                if not complete:
                    continue
                bad = snap.verify(i)
                if bad == -1:
                    data = SlotPart(snap, i, close=False).read_all(nparts - 1)
                    rec = record.load_record(data.numpy().tobytes(), f"step {step} in {name}")
                    held.setdefault(owner, {})[step] = rec["world_size"]
                    if (owner, step) not in self._where or owner == seg["rank"]:
                        self._where[(owner, step)] = name
                elif bad == -2:
                    damaged.setdefault(owner, []).append(
                        f"step {step} in {name}: its part table is damaged")
                else:
                    what = "the record (optimizer settings, RNG, stateful objects)" \
                        if bad == nparts - 1 else f"tensor part {bad}"
                    damaged.setdefault(owner, []).append(
                        f"step {step} in {name}: {what} fails its CRC-32C")
            snap.close()
        return {"held": held, "damaged": damaged}

    def _fetch(self, step, everyone):
        """This rank's part of `step`: from a segment on its host, else sent
        by the lowest rank whose host holds it (a buddy copy)."""
        for o in range(self.world_size):
            if step in everyone[o]["held"].get(o, {}):
                continue  # on its own rank's host
            p = min(r for r in range(self.world_size) if step in everyone[r]["held"].get(o, {}))
            if self.rank == p:
                SlotPart.open(self._where[(o, step)], step).send(o)
            elif self.rank == o:
                got = BufferPart.recv(p)
        if step in everyone[self.rank]["held"].get(self.rank, {}):
            return SlotPart.open(self._where[(self.rank, step)], step)
        return got

    def _resume_hint(self):
        if self.checkpoint_dir is None:
            return ("Resume from a checkpoint on disk (flatshard.load_checkpoint); pass "
                    "checkpoint_dir= to have it named here.")
        try:
            from ..state.checkpoint_dir import latest_checkpoint
            return f"The newest checkpoint on disk: {latest_checkpoint(self.checkpoint_dir)}."
        except (FileNotFoundError, OSError, ValueError) as e:
            return f"No checkpoint on disk to resume from either: {e}"

    # ------------------------------------------------------------------ commit

    def commit(self, step):
        """After optimizer.step() of step `step` (0, 1, ...): start its
        snapshot (every `every`-th step) and let the previous one count
        ([Note: commit])."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"flatshard.Snapshots.commit: step={step!r}; expected a whole "
                              "number >= 0")
        if step % self.every:
            return
        last = self._pending if self._pending is not None else self.committed
        if last is not None and step <= last:
            raise ConfigError(f"flatshard.Snapshots.commit: step={step} after step {last}; "
                              "steps must increase")
        self._open()
        if self._pending is not None:
            self._settle()
        tensors, rec = record.capture(self.model, self.optimizer, self.stateful, step,
                                      self.world_size)
        rec = torch.frombuffer(bytearray(rec), dtype=torch.uint8)
        parts = [(t.data_ptr(), record.nbytes(t)) for t in tensors] + \
            [(rec.data_ptr(), rec.numel())]
        stop = -1
        if self._fault == ("copy", step, self.rank):
            stop = sum(b for _, b in parts) // 2
        try:
            self._snap.write(step, parts, budget=self.budget, stop_after=stop)
        except ValueError as e:
            if "over the budget" not in str(e):
                raise
            raise ConfigError(f"flatshard.Snapshots: budget={self.budget} (or "
                              f"FLATSHARD_SNAPSHOT_BUDGET) is too small: {e}. Raise it (each of the "
                              "two slots holds one step's state)") from None
        self._keep, self._pending = (tensors, rec), step
        if self._buddy.active:
            self._buddy.start(step, tensors + [rec])
        if stop >= 0:
            self._snap.wait()
            _die()  # FLATSHARD_SNAPSHOT_FAULT: a crash in the middle of the copy

    def _settle(self):
        """The pending step counts once every rank holds it."""
        step = self._pending
        self._snap.wait()
        self._buddy.wait()
        self._keep = None
        key = f"{self._keys}{step}"
        n = self._store.add(key, 1)
        if self._fault == ("commit", step, self.rank):
            _die()  # FLATSHARD_SNAPSHOT_FAULT: a crash inside the commit
        if n == self.world_size:
            self._store.set(key + "/all", b"1")
            if self.committed is not None:
                for k in (f"{self._keys}{self.committed}", f"{self._keys}{self.committed}/all"):
                    self._store.delete_key(k)
        self._store.wait([key + "/all"])
        self.committed, self._pending = step, None

    def _before_step(self, optimizer, args, kwargs):
        if self._snap is not None and self._snap.busy():
            self._snap.wait()  # the copy reads the parameters the step writes
        self._buddy.sources_done()  # and so does the buddy copy's packing

    # ------------------------------------------------------------------ the end

    @property
    def segment_bytes(self):
        """Bytes of shared memory this rank's segments (its own, and the
        buddy copies it holds) take now."""
        return 0 if self._snap is None else \
            self._snap.segment_bytes() + self._buddy.segment_bytes()

    def close(self):
        """A finished run: the last step counts, and the segment is removed.
        Every rank calls it (it waits for the others' last commit)."""
        if self._snap is not None and self._pending is not None:
            self._settle()
        self._remove()

    def _remove(self):
        self._hook.remove()
        self._buddy.close(remove=True)
        if self._snap is not None:
            self._snap.close()
            self._snap = None
            try:
                _C.snapshot_unlink(self.name)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        elif self._snap is not None:  # kept for the restart
            self._buddy.close(remove=False)
            self._snap.close()
            self._snap = None
        return False

    def _open(self):
        if self._snap is None:
            self._snap = _C.Snapshot(self.name, create=True)
            self._buddy.open_held()
