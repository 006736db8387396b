"""Cross-rank consistency at wrap time.

Every rank of a group must wrap the same units, with the same parameters
(names, shapes, dtypes, requires_grad) and the same options, or the first
collective that differs hangs or silently mixes data. `agree()` checks this
once per FSDP construction, before its first collective, and raises the same
ConfigError on every rank, naming the ranks and the first difference.

The exchange goes through the process group's store, not a collective: a
wait on the store has a deadline, and a rank that failed validation can say
so. Round n of a group (its n-th FSDP construction, counted alike on every
rank that constructs alike), with O(1) store operations per rank when the
ranks agree, so that it stays cheap on thousands of ranks:
  1. each rank runs its local validation and planning, and posts a digest of
     its description, or its error if that raised;
  2. it compares its post with rank 0's, adds 1 to the round's "differ"
     counter if they differ and 1 to its "arrived" counter; the last rank to
     arrive marks the round done. A rank whose validation failed re-raises;
  3. the others wait for "done" (up to FLATSHARD_COMM_TIMEOUT or the group's
     own timeout, whichever is shorter, then the error names the ranks that
     never posted). Nobody differs: done;
  4. else every rank reads every post: an error posted by a rank is raised
     everywhere naming it; otherwise every rank posts its full description
     and all raise the same error, naming the ranks and the first line that
     differs.
Keys are never deleted: a few short keys per rank per construction.
"""
import datetime
import hashlib
import time
from itertools import zip_longest

import torch.distributed as dist

from ..errors import ConfigError
from .timeout import wait_timeout

_ROUNDS = {}  # group name -> constructions so far on this rank
_FIX = ("Every rank must wrap the same model with the same options: look for model code or "
        "arguments that depend on the rank, and for FLATSHARD_* environment variables that "
        "differ between ranks")


def _store(group):
    from torch.distributed import distributed_c10d as c10d
    return c10d._get_process_group_store(group)


def agree(group, plan, on_differ=None):
    """Run `plan() -> (result, description lines)` and check that every rank
    of `group` got the same description; returns the result. differ: for a
    comparison where a difference is not an error, on_differ(lines of each
    rank of the group) runs on every rank instead of the ConfigError (the
    same lines everywhere), and the result is returned."""
    world = dist.get_world_size(group)
    if world == 1 or "fake" in str(dist.get_backend(group)).lower():
        return plan()[0]  # one process plays every rank: nobody to compare with
    rank = dist.get_rank(group)
    n = _ROUNDS.get(group.group_name, 0)
    _ROUNDS[group.group_name] = n + 1
    store, prefix = _store(group), f"flatshard/wrap/{n}/"
    timeout = wait_timeout(group)
    failed = None
    try:
        result, lines = plan()
        post = "D" + hashlib.sha256("\n".join(lines).encode()).hexdigest()
    except Exception as e:
        failed, post = e, f"E{type(e).__name__}: {e}"
    store.set(f"{prefix}{rank}", post)
    if rank != 0:
        _wait(store, prefix, [0], world, rank, "reach the wrap of this model", timeout)
    differ = post.startswith("E") or post != store.get(f"{prefix}0").decode()
    store.add(f"{prefix}differ", int(differ))
    if store.add(f"{prefix}arrived", 1) == world:
        store.set(f"{prefix}done", "1")
    if failed is not None:
        _leave(store, prefix, world, timeout)
        raise failed
    _wait(store, prefix, ["done"], world, rank, "reach the wrap of this model", timeout)
    if store.add(f"{prefix}differ", 0) == 0:
        return result
    posts = [store.get(f"{prefix}{r}").decode() for r in range(world)]
    for r, p in enumerate(posts):
        if p.startswith("E"):
            _leave(store, prefix, world, timeout)
            raise ConfigError(f"flatshard: rank {r} failed to wrap this model, so no rank can: "
                              f"{p[1:]}")
    store.set(f"{prefix}desc/{rank}", "\n".join(lines))
    _wait(store, f"{prefix}desc/", range(world), world, rank, "describe its model", timeout)
    texts = [store.get(f"{prefix}desc/{r}").decode().split("\n") for r in range(world)]
    _leave(store, prefix, world, timeout)
    if on_differ is not None:
        on_differ(texts)
        return result
    raise ConfigError(_difference(posts, texts))


# A rank about to raise waits this long at most for the others to have read
# what they need from the store: the store lives in one rank's process (rank
# 0's, under torchrun's default and torch.multiprocessing launches), and a
# script that ends on the error takes it down with it; a rank still reading
# would then fail with a connection reset instead of the error.
_LEAVE_S = 10.0


def _leave(store, prefix, world, timeout):
    """On a failed agreement only: count this rank out, then wait (bounded)
    until every rank has."""
    try:
        store.add(f"{prefix}left", 1)
        deadline = time.monotonic() + min(_LEAVE_S, timeout[0])
        while store.add(f"{prefix}left", 0) < world and time.monotonic() < deadline:
            time.sleep(0.005)
    except Exception:  # the store is gone already: nothing left to protect
        pass


def _wait(store, prefix, keys, world, rank, what, timeout):
    """Wait for prefix+key for each key; on the timeout, name the ranks whose
    own post (prefix+rank) is missing. timeout: (seconds, what set them)."""
    seconds, source = timeout
    try:
        store.wait([f"{prefix}{k}" for k in keys], datetime.timedelta(seconds=seconds))
    except Exception as e:  # the store's timeout error type varies with the store
        missing = [r for r in range(world) if not store.check([f"{prefix}{r}"])]
        if not missing:  # every rank posted: the wait failed for a reason of its own
            raise ConfigError(
                f"flatshard: rank {rank} could not wait for the other ranks to {what}, "
                f"although every rank posted its description ({type(e).__name__}: {e}); "
                "a rank that failed or is stuck in this agreement shows this way (see its own "
                "error)") from e
        raise ConfigError(
            f"flatshard: {_ranks(missing)} did not {what} within {seconds:g} s "
            f"({source}) while rank {rank} did: every rank must construct the same FSDP "
            "models in the same order; a rank that failed or is stuck before this point "
            "shows this way too (see its own error)") from None


def _difference(posts, descriptions):
    """Name the ranks that differ from rank 0 and the first line where."""
    ref = descriptions[0]
    parts = []
    for digest in dict.fromkeys(posts):  # distinct, in rank order
        ranks = [r for r, p in enumerate(posts) if p == digest]
        if 0 in ranks:
            continue
        mine = descriptions[ranks[0]]
        unit = "the options"
        for a, b in zip_longest(ref, mine):
            line = a if a is not None else b
            if line.startswith("unit "):
                unit = line.split(":")[0]
            if a != b:
                break
        parts.append(f"rank 0 and {_ranks(ranks)} differ in {unit}: rank 0 has "
                     f"{_shown(a)}, rank {ranks[0]} has {_shown(b)}")
    return f"flatshard: the wrapped model differs between ranks: {'; '.join(parts)}. {_FIX}"


def _ranks(ranks):
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _shown(line):
    return repr(line.strip()) if line is not None else "nothing more"
