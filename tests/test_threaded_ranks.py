"""Ranks run as threads of one process (torch's multi-threaded test process
group, world 4), as torch's own FSDP tests run them: flatshard's state kept
per process (caches of groups and Comms, the wrap-agreement rounds) is
per rank, so two models one after the other, the second nested with
reshard_after_forward=2 (post-forward groups of 2 ranks), train in every
thread with torch's fully_shard's losses in the same run.

The threads run in a child process (this file as a script) under a
deadline: a thread waiting in a collective forever cannot be stopped, its
process can."""
import json
import os
import subprocess
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn as nn

WORLD = 4
DEADLINE_S = 120


def _net(depth):
    """The same weights in every thread, without the global RNG (which the
    threads share): drawn from a generator of their own."""
    g = torch.Generator().manual_seed(0)
    m = nn.Sequential(*[nn.Linear(8, 8) for _ in range(depth)], nn.Linear(8, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _train(shard, depth, raf, rank, steps=2):
    m = _net(depth)
    for lin in m[:depth]:
        shard(lin, reshard_after_forward=raf)
    shard(m, reshard_after_forward=raf)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(10 + rank)
    losses = []
    for _ in range(steps):
        loss = m(torch.randn(3, 8, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _rank(rank, store, out):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from flatshard import fully_shard
    dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
    try:
        got = {}
        for name, shard in (("torch", torch_fully_shard), ("ours", fully_shard)):
            got[name] = [_train(shard, 1, True, rank), _train(shard, 2, 2, rank)]
        out[rank] = got
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out[rank] = f"{type(e).__name__}: {e}"
        raise
    finally:
        dist.destroy_process_group()


def main():
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg
    torch.set_num_threads(1)
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store, out = dist.HashStore(), {}
    threads = [threading.Thread(target=_rank, args=(r, store, out), daemon=True)
               for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(json.dumps(out))
    sys.stdout.flush()
    os._exit(0)  # the threaded group's daemon threads are not joined at exit


def test_two_models_in_threads_train_as_torch():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env,
                              capture_output=True, text=True, timeout=DEADLINE_S)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the threads did not finish within {DEADLINE_S} s:\n"
                             f"{(e.stderr or b'')[-4000:]!r}") from None
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(out) == [str(r) for r in range(WORLD)], out
    for rank, got in out.items():
        assert isinstance(got, dict), (rank, got)
        assert got["ours"] == got["torch"], (rank, got)


if __name__ == "__main__":
    main()
