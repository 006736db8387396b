"""limit_all_gathers, as torch means it: at most two all-gathers in flight
on a device. torch's FSDP1 needs a limiter for it because its all-gather
stream does not wait for the compute stream, so a CPU that runs ahead issues
the gathers of every unit ahead of the compute. flatshard's device Comms order
every collective after the caller's stream's work so far (fs_device.h,
set_caller_stream), a plain gather is waited for by the caller's stream
before the unit computes, and only a prefetch is left pending: so whatever
limit_all_gathers says, the gathers in flight at any moment are the pending
prefetches plus the one being issued. This file shows that bound on the
device path (the host device table, which runs the engine's device code on
CPU: tests/test_device_path.py) with forward and backward prefetch on, and
that limit_all_gathers=False changes no bit."""
import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard import FSDP
from test_device_path import _DeviceComms
from toy_models import Block, build

TIMEOUT = 180


def _train(limit, prefetch):
    torch.manual_seed(0)
    model = build(depth=4)
    with _DeviceComms():
        fs = FSDP(model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                  device_id=torch.device("cpu"), forward_prefetch=True,
                  backward_prefetch=prefetch, limit_all_gathers=limit)
    units = [m._unit for m in fs.modules() if isinstance(m, FSDP)]
    assert {u.c.comm.device for u in units} == {"host"}  # the engine's device path
    pending = []  # gathers left pending (prefetches), at every leaf module's hooks

    def look(*_):
        pending.append(sum(bool(u.c.gather_pending) for u in units))
    for m in fs.modules():
        if isinstance(m, torch.nn.Linear):
            m.register_forward_pre_hook(look)
            m.register_forward_hook(look)
            m.register_full_backward_pre_hook(look)
            m.register_full_backward_hook(look)
    opt = torch.optim.SGD(fs.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        loss = ((fs(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    with FSDP.summon_full_params(fs):
        full = [p.detach().clone() for p in fs.parameters()]
    return losses, full, max(pending), pending.count(1)


def _both(prefetch):
    return _train(True, prefetch), _train(False, prefetch)


@pytest.mark.parametrize("prefetch", ["BACKWARD_PRE", "BACKWARD_POST"])
def test_at_most_two_gathers_in_flight_with_or_without_the_limit(dist_pool, prefetch):
    bp = getattr(flatshard.BackwardPrefetch, prefetch)
    for on, off in dist_pool(2).run(_both, bp, timeout=TIMEOUT):
        # a prefetch was pending while other units computed, never two: with
        # the one being issued, at most two gathers in flight
        assert on[2] == 1 and on[3] > 0, on[2:]
        assert off[2:] == on[2:]  # limit_all_gathers=False: the same bound
        assert on[0] == off[0] and all(torch.equal(a, b) for a, b in zip(on[1], off[1]))
        assert on[0][-1] < on[0][0]
