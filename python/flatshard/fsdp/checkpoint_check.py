"""The ranks' agreement on a checkpoint's manifest check: each rank checks
its share of the files (state/manifest.py), posts what it found through the
process group's store, and reads every other rank's post, waiting at most
FLATSHARD_COMM_TIMEOUT (or the group's own timeout, where shorter). A
damage only one rank read, or an error only one rank met, is raised on
every rank, with the same words: no rank goes on into DCP's collectives
while another has stopped.
"""
import datetime
import json
import time

import torch.distributed as dist

from ..errors import CheckpointDamaged, UnsafeFileError
from ..runtime.timeout import wait_timeout
from ..state import manifest

# A rank about to raise waits this long at most for the others to have read the
# posts: the store may live in its process, which the error may end.
_LEAVE_S = 10.0

_NAMED = {c.__name__: c for c in (CheckpointDamaged, UnsafeFileError)}
_ROUNDS = {}  # group name -> checkpoint checks so far on this rank


def verified(ckpt, group):
    """This rank's share of the manifest check, and every other rank's
    findings through the group's store (a wait bounded by wait_timeout):
    -> the DCP Metadata, or the same error raised on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    error = None
    try:
        metadata, problems = manifest.check(ckpt, rank, world)
        post = {"problems": problems}
    except Exception as e:  # e.g. UnsafeFileError: the other ranks must learn it
        metadata, error, post = None, e, {"error": [type(e).__name__, str(e)]}
    posts = _exchange(group, ckpt, post) if world > 1 else [post]
    for r, p in enumerate(posts):
        if "error" in p:
            kind, text = p["error"]
            cause = error if r == rank else None
            if kind in _NAMED:  # flatshard's own: the same words on every rank
                raise _NAMED[kind](text) from cause
            raise CheckpointDamaged(f"flatshard: rank {r} could not check checkpoint {ckpt!r} "
                                    f"against its manifest: {kind}: {text}") from cause
    problems = [q for p in posts for q in p["problems"]]
    if problems:
        raise manifest.damaged(ckpt, list({json.dumps(q, sort_keys=True): q
                                           for q in problems}.values()))
    return metadata


def _exchange(group, ckpt, post):
    """Every rank's `post` (plain data), in rank order."""
    from torch.distributed import distributed_c10d as c10d
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = _ROUNDS[group.group_name] = _ROUNDS.get(group.group_name, 0) + 1
    store = c10d._get_process_group_store(group)
    keys = [f"flatshard/checkpoint-check/{n}/{r}" for r in range(world)]
    store.set(keys[rank], json.dumps(post))
    seconds, source = wait_timeout(group)
    try:
        store.wait(keys, datetime.timedelta(seconds=seconds))
    except Exception:  # the store's timeout error type varies with the store
        missing = [r for r in range(world) if not store.check([keys[r]])]
        raise TimeoutError(f"flatshard: rank(s) {missing} did not check checkpoint {ckpt!r} "
                           f"within {seconds:g} s ({source}) while rank {rank} did: every rank "
                           "calls load_checkpoint; a rank that failed before it shows this way "
                           "(see its own error)") from None
    posts = [json.loads(store.get(k)) for k in keys]
    store.add(f"flatshard/checkpoint-check/{n}/read", 1)
    if any(p != {"problems": []} for p in posts):  # every rank raises: let all read first
        deadline = time.monotonic() + min(_LEAVE_S, seconds)
        while store.add(f"flatshard/checkpoint-check/{n}/read", 0) < world and \
                time.monotonic() < deadline:
            time.sleep(0.005)
    return posts
