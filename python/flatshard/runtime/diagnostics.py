"""Where every rank was when a collective failed.

Each Comm records its collectives in a ledger (csrc/backends/ledger.h). When one
fails (a timeout, a dead rank, ranks in different collectives), the C core
adds this rank's last entries to the error and calls `Comm.on_failure`, set
here: the rank posts its ledger to the process group's store, reads the
other ranks' (waiting at most GRACE_S for ranks that fail a little later:
ranks stuck in the same collective fail together, and a rank that fails
much later finds the earlier ones' ledgers already posted), and adds a
note saying where each rank is and the first collective at which they
differ, e.g. that rank 1 is in all_gather #41 for 'blocks.3' while rank 0
is in all_gather #41 for 'blocks.2'. The store is separate from the
collectives, so it still works when they do not, unless the rank that
hosts it died (a TCP store lives in global rank 0's process): the note
then says so. Either way it names each rank on this host that died, and
its pid, as the shm backend does in its own message.
"""
import json
import os
import time

GRACE_S = 0.5  # how long a failing rank waits for the other ranks' ledgers, at most
SHOWN = 3      # entries shown per rank


def install(comm, group, label, timeout_s, peers=None):
    """Report through `group`'s store under `label` (the same on every rank);
    timeout_s: the collectives' own timeout, which bounds the grace too;
    peers: each rank's (host, pid), by rank in the group, or None."""
    reporter = _Reporter(group, label, min(GRACE_S, timeout_s), peers)
    comm.on_failure = reporter
    comm.on_stop = reporter.stopped


def _alive(pid):
    """A process that exists and is not a zombie (ranks are often siblings,
    so a dead one lingers as a zombie until their parent reaps it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def _store_host(group):
    """-> (rank in `group`, "address:port") of the process hosting the
    group's TCP store, or None (another kind of store, hosted by no rank, or
    by a rank outside the group). torch's tcp:// and env:// rendezvous start
    the store in global rank 0; under torchrun the agent hosts it instead."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    store = c10d._get_process_group_store(group)
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore) or \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    if 0 not in dist.get_process_group_ranks(group):
        return None
    return dist.get_group_rank(group, 0), f"{store.host}:{store.port}"


class _Reporter:
    def __init__(self, group, label, grace, peers):
        self.group, self.label, self.grace = group, label, grace
        self.peers = peers
        self.note = None  # the comparison is made once: later failures are its echoes

    def __call__(self, comm, exc):
        if self.note is None:
            try:
                self.note, found = self._note(comm)
            except Exception as e:  # keep the real error whatever happens here
                self.note = f"flatshard: could not compare ledgers across ranks: {e}"
                found = set()
            fix = _fix({comm.failure} | found)
            if fix:
                self.note += "\n" + fix
        exc.add_note(self.note)

    def stopped(self, comm, why):
        """This rank stops outside any collective (e.g. out of memory): leave
        the cause where the other ranks' failure notes will read it."""
        from torch.distributed import distributed_c10d as c10d
        store = c10d._get_process_group_store(self.group)
        store.set(f"flatshard/stopped/{self.label}/{comm.rank}", why)

    def _dead(self, comm, wait_s, watch=None):
        """{rank: pid} of the ranks on this host whose process has ended.
        Waits up to wait_s for a death (of rank `watch`, if given) to show:
        a peer's sockets close, which is what failed the collective, a
        moment before its process is gone."""
        if not self.peers:
            return {}
        here = self.peers[comm.rank][0]
        ours = {r: pid for r, (host, pid) in enumerate(self.peers)
                if host == here and r != comm.rank}
        deadline = time.monotonic() + wait_s
        while True:
            dead = {r: pid for r, pid in ours.items() if not _alive(pid)}
            if (watch in dead if watch is not None else dead) or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)

    def _note(self, comm):
        """-> (the note's text, what it found: {"dead"} where it names a
        rank that died, {"absent"} where a rank issued nothing after the
        others' last collective, or neither)."""
        host = _store_host(self.group)
        holder = host[0] if host is not None and host[0] != comm.rank else None
        dead = self._dead(comm, 0.0)
        if holder not in dead:  # (a dead store fails slowly or noisily: not asked then)
            try:
                text, found = self._compare(comm)
                return _with_deaths([text], self._dead(comm, 0.0), found)
            except Exception as e:
                failed = f"flatshard: could not compare ledgers across ranks: {e}"
                if holder is None:
                    return _with_deaths([failed], self._dead(comm, self.grace))
                dead = self._dead(comm, self.grace, watch=holder)
                if holder not in dead:  # on another host: its death cannot be seen from here
                    return _with_deaths([failed, f"  rank {holder} hosts the process group's TCP "
                                         f"store ({host[1]}), so that rank, or its host, most "
                                         "likely died"], dead)
        pid = dead.pop(holder)
        return _with_deaths([f"flatshard: rank {holder} (pid {pid}) died; it also hosted the "
                             f"process group's TCP store ({host[1]}), so the ranks' ledgers "
                             "cannot be compared"], dead, {"dead"})

    def _compare(self, comm):
        from torch.distributed import distributed_c10d as c10d
        store = c10d._get_process_group_store(self.group)
        stopped = [f"flatshard/stopped/{self.label}/{r}" for r in range(comm.world_size)]
        keys = [f"flatshard/ledger/{self.label}/{r}" for r in range(comm.world_size)]
        store.set(keys[comm.rank], json.dumps(comm.ledger()))
        # Polled: some stores' own wait() rounds its timeout up to whole seconds.
        deadline = time.monotonic() + self.grace
        while not all(store.check([k]) for k in keys) and time.monotonic() < deadline:
            time.sleep(0.02)
        ledgers = {r: json.loads(store.get(k)) for r, k in enumerate(keys) if store.check([k])}
        causes = [f"  rank {r} stopped: {store.get(k).decode()}" for r, k in enumerate(stopped)
                  if r != comm.rank and store.check([k])]
        text, behind = report(ledgers, comm.world_size, self.grace)
        return "\n".join([text] + causes), {"absent"} if behind else set()


def _fix(found):
    """The fix line for a rank that died ("dead" in found: the backend's
    Comm.failure, or the note's own finding) or stopped issuing collectives
    ("absent"); None for the other failures, whose text says what went
    apart."""
    if "dead" in found:
        return ("flatshard: fix: the dead rank's own output says why it died (a traceback, "
                "or the kernel's OOM killer: `dmesg`); see 'A rank died' in "
                "docs/troubleshooting.md")
    if "absent" in found:
        return ("flatshard: fix: every rank must run every forward and backward of the "
                "wrapped model, in the same order (a forward on some ranks only, such as an "
                "evaluation on rank 0?); see 'A rank has not arrived' in "
                "docs/troubleshooting.md")
    return None


def _with_deaths(lines, dead, found=frozenset()):
    """-> (lines and a line per rank in `dead` ({rank: pid}), found with
    "dead" added when there is one)."""
    deaths = [f"  rank {r} (pid {pid}) died" for r, pid in sorted(dead.items())]
    return "\n".join(lines + deaths), set(found) | ({"dead"} if dead else set())


def _fmt(e):
    size = e["bytes"]
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            break
        size /= 1024
    size = f"{size} B" if unit == "B" else f"{size:.1f} {unit}"
    return f"{e['op']} #{e['seq']} for '{e['unit'] or '-'}' ({size} {e['dtype']}, {e['state']})"


def _key(e):
    return e["op"], e["unit"], e["bytes"], e["dtype"]


# Reductions of different groups at one number: a group whose gradients did
# not all arrive on some rank (parameters that rank's forward did not use)
# reduces there only at the end of backward, after the others.
UNUSED_HINT = ("  reductions of different groups there: if some ranks did not use all of a "
               "fully_shard group's parameters in this step (conditional compute, an expert "
               "no token reached), call set_reduce_scatter_unused_params(True) on that "
               "module: every rank then reduces it, with zeros for what it did not use")


def report(ledgers, world, grace):
    """ledgers: rank -> its ledger (Comm.ledger()) -> (the note's text,
    whether a rank issued nothing after the others' last collective)."""
    lines = ["flatshard: the ranks' last collectives on this Comm (from the process group's "
             "store):"]
    for r in range(world):
        if r not in ledgers:
            lines.append(f"  rank {r}: did not report within {grace:g} s (it died, or is not in "
                         "a failing collective)")
        else:
            shown = "; ".join(_fmt(e) for e in ledgers[r][-SHOWN:]) or "none yet"
            lines.append(f"  rank {r}: {shown}")
    by_seq = [{e["seq"]: e for e in led} for led in ledgers.values()]
    ranks = list(ledgers)
    common = set.intersection(*(set(m) for m in by_seq)) if by_seq else set()
    for seq in sorted(common):
        if len({_key(m[seq]) for m in by_seq}) > 1:
            sides = [f"rank {r}: {_fmt(m[seq])}" for r, m in zip(ranks, by_seq)]
            lines.append(f"  first difference at #{seq}: {'; '.join(sides)}. The ranks went "
                         "apart there: one skipped or added a collective (a data-dependent "
                         "branch around a wrapped module?)")
            if all(m[seq]["op"] == "reduce_scatter" for m in by_seq):
                lines.append(UNUSED_HINT)
            break
    else:
        newest = {r: max(m, default=0) for r, m in zip(ranks, by_seq)}
        if len(set(newest.values())) > 1:
            behind = min(newest, key=newest.get)
            lines.append(f"  the ranks agree up to #{newest[behind]}; rank {behind} issued "
                         f"nothing after it while rank {max(newest, key=newest.get)} is at "
                         f"#{max(newest.values())}")
            return "\n".join(lines), True
    return "\n".join(lines), False
