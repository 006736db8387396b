"""Where every rank was when a collective failed.

Each Comm records its collectives in a ledger (csrc/ledger.h). When one
fails (a timeout, a dead rank, ranks in different collectives), the C core
adds this rank's last entries to the error and calls `Comm.on_failure`, set
here: the rank posts its ledger to the process group's store, reads the
other ranks' (waiting at most GRACE_S for ranks that fail a little later:
ranks stuck in the same collective fail together, and a rank that fails
much later finds the earlier ones' ledgers already posted), and adds a
note saying where each rank is and the first collective at which they
differ, e.g. that rank 1 is in all_gather #41 for 'blocks.3' while rank 0
is in all_gather #41 for 'blocks.2'. The store is separate from the
collectives, so it still works when they do not.
"""
import json
import time

GRACE_S = 0.5  # how long a failing rank waits for the other ranks' ledgers, at most
SHOWN = 3      # entries shown per rank


def install(comm, group, label, timeout_s):
    """Report through `group`'s store under `label` (the same on every rank);
    timeout_s: the collectives' own timeout, which bounds the grace too."""
    comm.on_failure = _Reporter(group, label, min(GRACE_S, timeout_s))


class _Reporter:
    def __init__(self, group, label, grace):
        self.group, self.label, self.grace = group, label, grace
        self.note = None  # the comparison is made once: later failures are its echoes

    def __call__(self, comm, exc):
        if self.note is None:
            try:
                self.note = self._compare(comm)
            except Exception as e:  # the store is gone too: say so, keep the real error
                self.note = f"flatshard: could not compare ledgers across ranks: {e}"
        exc.add_note(self.note)

    def stopped(self, comm, why):
        """This rank stops outside any collective (e.g. out of memory): leave
        the cause where the other ranks' failure notes will read it."""
        from torch.distributed import distributed_c10d as c10d
        store = c10d._get_process_group_store(self.group)
        store.set(f"flatshard/stopped/{self.label}/{comm.rank}", why)

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
        return "\n".join([report(ledgers, comm.world_size, self.grace)] + causes)


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


def report(ledgers, world, grace):
    """ledgers: rank -> its ledger (Comm.ledger()) -> the note's text."""
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
            break
    else:
        newest = {r: max(m, default=0) for r, m in zip(ranks, by_seq)}
        if len(set(newest.values())) > 1:
            behind = min(newest, key=newest.get)
            lines.append(f"  the ranks agree up to #{newest[behind]}; rank {behind} issued "
                         f"nothing after it while rank {max(newest, key=newest.get)} is at "
                         f"#{max(newest.values())}")
    return "\n".join(lines)
