"""A fully_shard model cast back and forth (model.to) in ranks run as
threads of one process (torch's multi-threaded test process group, world 2)
while another thread runs the cyclic garbage collector without pause.

With mixed precision the casts keep the engine group (its compute and reduce
dtypes stay), so every cast hands the group new shards and parameters
(ParamGroup._shards_to_engine) and the old local tensors die inside the
call. torch's tensor deallocation lets other threads run, and the collector
there visits the group: at every such point the group must hold only valid,
owned references (csrc/glue/shard_group_object.h, [Note: handed fields]). A
half-replaced registration crashed the process (a segmentation fault in the
collector) within a few hundred casts.

The threads run in a child process (this file as a script) under a
deadline, as in test_threaded_ranks.py."""
import gc
import json
import os
import subprocess
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn as nn

WORLD = 2
CASTS = 15  # pairs of casts per rank, before and after a training step
DEADLINE_S = 600  # a deadline, not a time: Python 3.13 takes minutes at load


def _net():
    """Initialised in bfloat16 (torch's test_clamp_reduce_dtype does the
    same), so a round trip through float32 is exact; the weights drawn from
    a generator of its own (the threads share the global one)."""
    g = torch.Generator().manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 16), nn.Linear(16, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m.to(torch.bfloat16)


def _casts(m):
    for _ in range(CASTS):
        m.to(torch.float32)
        m.to(torch.bfloat16)


def _rank(rank, store, out):
    from flatshard import MixedPrecisionPolicy, fully_shard
    dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
    try:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        m = _net()
        for lin in m:
            fully_shard(lin, mp_policy=mp)
        fully_shard(m, mp_policy=mp)
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        with torch.no_grad():
            before = m(x).float().tolist()
        _casts(m)  # before lazy init: no unsharded parameters yet
        m(x).float().square().mean().backward()
        _casts(m)  # after: the unsharded parameters are replaced too
        with torch.no_grad():
            after = m(x).float().tolist()
        out[rank] = {"before": before, "after": after}
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out[rank] = f"{type(e).__name__}: {e}"
        raise
    finally:
        dist.destroy_process_group()


def _collect(stop, counts):
    n = 0
    while not stop.is_set():
        gc.collect()
        n += 1
    counts.append(n)


def main():
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg

    import flatshard  # noqa: F401 - imported before the freeze below
    torch.set_num_threads(1)
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    # What the imports made is never garbage: frozen, a full collection
    # visits only what the ranks make, and the collector runs thousands of
    # times within the casts.
    gc.collect()
    gc.freeze()
    store, out, stop, counts = dist.HashStore(), {}, threading.Event(), []
    collector = threading.Thread(target=_collect, args=(stop, counts), daemon=True)
    collector.start()
    threads = [threading.Thread(target=_rank, args=(r, store, out), daemon=True)
               for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    collector.join()
    out["collections"] = counts[0]
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # the threaded group's daemon threads are not joined at exit


def test_casts_in_threads_survive_the_collector():
    # a crash prints every thread's stack (the collector's among them)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                              capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the threads did not finish within {DEADLINE_S} s:\n"
                             f"{(e.stderr or b'')[-4000:]!r}") from None
    assert done.returncode == 0, f"exit status {done.returncode}:\n{done.stderr[-4000:]}"
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out.pop("collections") > 0
    assert sorted(out) == [str(r) for r in range(WORLD)], out
    for rank, got in out.items():
        assert isinstance(got, dict), (rank, got)
    # the casts are exact (bfloat16 -> float32 -> bfloat16) and change nothing,
    # and every rank computes the same function of the same input
    ref = out["0"]["before"]
    for rank, got in out.items():
        assert got["before"] == ref and got["after"] == ref, rank


if __name__ == "__main__":
    main()
