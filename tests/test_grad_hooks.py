"""Post-accumulate-grad hooks on sharded parameters (runtime/grad_hooks.py):
optimizer-in-backward, one SGD per parameter stepped from its hook.

fully_shard against torch's fully_shard in the same run (hook calls in order,
parameters bit for bit, also with gradient accumulation without sync and
with reductions in a bucket); the FSDP1 wrapper with use_orig_params=True
against the same training of the plain model in one process (torch's FSDP1
runs no such hook: checked too, it is why flatshard documents its choice)."""
import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flatshard.fsdp.groups as fsdp_groups
import flatshard.fsdp2.mesh as fsdp2_mesh  # where fully_shard makes its Comms
from flatshard import FullyShardedDataParallel, fully_shard
from flatshard.runtime.device import host_device_comm

TIMEOUT = 240
BUCKET_ENV = "FLATSHARD_REDUCE_BUCKET_BYTES"


@contextlib.contextmanager
def _device_comms(where):
    """Wrappers built inside use device Comms over the host ones (the host
    device table, runtime/device.py): reductions are deferred and landed
    later, as on a GPU. where: the module whose comm_for is replaced."""
    saved, made = where.comm_for, {}

    def comm_for(group, backend, device=None):
        host = saved(group, backend, device)
        if id(host) not in made:
            made[id(host)] = host_device_comm(host)
        return made[id(host)]
    where.comm_for = comm_for
    try:
        yield
    finally:
        where.comm_for = saved


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))


def _in_backward(model, names, lr=0.05):
    """One SGD with momentum per parameter, stepped and zeroed from its
    post-accumulate-grad hook; -> the list the hooks append their names to."""
    calls = []
    for name, p in zip(names, model.parameters()):
        opt = torch.optim.SGD([p], lr=lr, momentum=0.9, foreach=False)

        def hook(param, opt=opt, name=name):
            assert param.grad is not None
            calls.append(name)
            opt.step()
            opt.zero_grad()
        p.register_post_accumulate_grad_hook(hook)
    return calls


def _fully_shard_run(shard, steps, micro, bucket):
    if bucket:
        os.environ[BUCKET_ENV] = str(1 << 20)  # read at the first forward
    try:
        model = _net()
        names = [n for n, _ in model.named_parameters()]
        shard(model[0])
        shard(model)
        calls = _in_backward(model, names)
        rank = dist.get_rank()
        g = torch.Generator().manual_seed(5 + rank)
        per_step = []
        for _ in range(steps):
            for i in range(micro):
                model.set_requires_gradient_sync(i == micro - 1)
                model(torch.randn(3, 8, generator=g)).square().mean().backward()
            per_step.append(list(calls))
            calls.clear()
        leftover = [n for n, p in model.named_parameters() if p.grad is not None]
        return per_step, [p.detach()._local_tensor.clone() for p in model.parameters()], leftover
    finally:
        os.environ.pop(BUCKET_ENV, None)


def _against_torch(steps, micro, bucket):
    theirs = _fully_shard_run(torch_fully_shard, steps, micro, False)
    ours = _fully_shard_run(fully_shard, steps, micro, bucket)
    torch.manual_seed(0)
    start = [p.detach().clone() for p in _net().parameters()]
    return ours, theirs, start


@pytest.mark.parametrize("micro,bucket", [(1, False), (3, False), (1, True)])
def test_fully_shard_runs_hooks_as_torch(dist_pool, micro, bucket):
    steps = 3
    for ours, theirs, start in dist_pool(2).run(_against_torch, steps, micro, bucket,
                                                timeout=TIMEOUT):
        (o_calls, o_params, o_left), (t_calls, t_params, t_left) = ours, theirs
        # torch: each parameter's hooks once per synchronised backward, the
        # root's group (model[2]) first, each group in registration order
        assert t_calls == [["2.weight", "2.bias", "0.weight", "0.bias"]] * steps
        assert o_calls == t_calls
        assert o_left == t_left == []  # every hook zeroed its gradient
        for a, b in zip(o_params, t_params):
            assert torch.equal(a, b)
        changed = sum(not torch.equal(a, b) for a, b in zip(t_params, start))
        assert changed > 0


def _fsdp1_run(steps, bucket):
    """(hook calls per step, the full parameters) of the FSDP1 wrapper with
    use_orig_params=True and optimizer-in-backward; plus the same for
    torch's FSDP1 (its calls only) and the plain model on the whole batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [n for n, _ in _net().named_parameters()]
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(2 * world, 8, generator=g) for _ in range(steps)]

    def train(model, shard_of_batch):
        calls = _in_backward(model, names)
        per_step = []
        for x in xs:
            model(x[2 * rank:2 * rank + 2] if shard_of_batch else x).square().mean().backward()
            per_step.append(list(calls))
            calls.clear()
        return per_step

    if bucket:
        os.environ[BUCKET_ENV] = str(1 << 20)
    try:
        m = _net()
        m[0] = FullyShardedDataParallel(m[0], use_orig_params=True)
        ours = FullyShardedDataParallel(m, use_orig_params=True)
        ours_calls = train(ours, True)
    finally:
        os.environ.pop(BUCKET_ENV, None)
    with FullyShardedDataParallel.summon_full_params(ours):
        ours_params = [p.detach().clone() for p in ours.parameters()]
    m = _net()
    cpu = torch.device("cpu")
    m[0] = TorchFSDP(m[0], use_orig_params=True, device_id=cpu)
    torch_calls = train(TorchFSDP(m, use_orig_params=True, device_id=cpu), True)
    ref = _net()
    ref_calls = train(ref, False)
    return ours_calls, ours_params, torch_calls, ref_calls, [p.detach() for p in ref.parameters()]


@pytest.mark.parametrize("bucket", [False, True])
def test_fsdp1_use_orig_params_runs_hooks_as_the_plain_model(dist_pool, bucket):
    steps = 3
    for ours_calls, ours, torch_calls, ref_calls, ref in dist_pool(2).run(
            _fsdp1_run, steps, bucket, timeout=TIMEOUT):
        assert torch_calls == [[]] * steps  # torch's FSDP1 never runs them
        # every parameter's hook once a step, each unit's in registration
        # order once its reduction wrote the gradients (the units in the
        # order their gradients completed)
        units = (["0.weight", "0.bias"], ["2.weight", "2.bias"])
        for calls in ours_calls:
            assert calls in (units[0] + units[1], units[1] + units[0]), ours_calls
        assert [sorted(c) for c in ref_calls] == [sorted(c) for c in ours_calls]
        for a, b in zip(ours, ref):
            # two ranks' mean gradients against one batch's: summation order only
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (a - b).abs().max()
        assert any(not torch.equal(a, b) for a, b in zip(ref, _net().parameters()))


def _on_device_and_host(api, steps=3):
    """(hook calls, final local parameters) of one API with
    optimizer-in-backward on the device path and on the host path."""
    rank = dist.get_rank()
    out = []
    for device in (True, False):
        model = _net()
        names = [n for n, _ in model.named_parameters()]
        with _device_comms(fsdp2_mesh if api == "fully_shard" else fsdp_groups) if device \
                else contextlib.nullcontext():
            if api == "fully_shard":
                fully_shard(model[0])
                fully_shard(model)
            else:
                model[0] = FullyShardedDataParallel(model[0], use_orig_params=True)
                model = FullyShardedDataParallel(model, use_orig_params=True)
        calls = _in_backward(model, names)
        g = torch.Generator().manual_seed(5 + rank)
        per_step = []
        for _ in range(steps):
            model(torch.randn(3, 8, generator=g)).square().mean().backward()
            per_step.append(list(calls))
            calls.clear()
        local = [(p._local_tensor if api == "fully_shard" else p).detach().clone()
                 for p in model.parameters()]
        out.append((per_step, local))
    return out


@pytest.mark.parametrize("api", ["fully_shard", "FSDP"])
def test_hooks_run_once_deferred_reductions_land(dist_pool, api):
    for (d_calls, d_params), (h_calls, h_params) in dist_pool(2).run(
            _on_device_and_host, api, timeout=TIMEOUT):
        assert d_calls == h_calls and all(len(c) == 4 for c in d_calls)
        for a, b in zip(d_params, h_params):
            assert torch.equal(a, b)
