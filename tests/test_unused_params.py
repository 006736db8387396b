"""Parameters some ranks do not use in a step (conditional compute: an
expert no token reached on one rank). With both APIs nothing hangs, and the
gradients are as torch's FSDP gives them and as a one-process float64
reference computes them: each parameter's gradient is the average over the
ranks of what each produced, a rank that did not use it producing zero.

FSDP1's flat parameter gets its gradient whole, zeros where a parameter was
unused. fully_shard reduces a group once all its gradients arrived; a group
some rank used only in part needs set_reduce_scatter_unused_params(True), as
in torch. Without it torch's gloo ends the process at the mismatched
reduce-scatter; flatshard's shm backend names the two ranks' collectives and
the method."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp as tfsdp

import flatshard
from test_diagnostics import assert_documented

TIMEOUT = 180
STEPS = 3


class MoE(nn.Module):
    """Two experts; rank 0's tokens all go to expert 0."""

    def __init__(self, d):
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])

    def forward(self, x, rank):
        y = self.experts[0](x)
        return y if rank == 0 else y + self.experts[1](x)


class Net(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.inp, self.moe, self.out = nn.Linear(5, d), MoE(d), nn.Linear(d, 3)
        self.rank = 0

    def forward(self, x):
        return self.out(torch.relu(self.moe(self.inp(x), self.rank)))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 5, generator=g)


def _reference(world):
    """float64, one process: the mean of every rank's loss, its routing each."""
    torch.manual_seed(0)
    m = Net().double()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        total = 0
        for r in range(world):
            m.rank = r
            total = total + m(_batch(r, step).double()).square().mean() / world
        total.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in m.named_parameters()}


def _net():
    torch.manual_seed(0)
    m = Net()
    m.rank = dist.get_rank()  # before wrapping: the wrapper would keep it itself
    return m


def _train(m, full):
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        m(_batch(dist.get_rank(), step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return full(m)


def _fsdp1(which, use_orig):
    cls = flatshard.FSDP if which == "flatshard" else tfsdp.FullyShardedDataParallel
    policy = (flatshard.ModuleWrapPolicy if which == "flatshard" else
              __import__("torch.distributed.fsdp.wrap", fromlist=["x"]).ModuleWrapPolicy)({MoE})
    m = cls(_net(), auto_wrap_policy=policy, device_id=torch.device("cpu"),
            use_orig_params=use_orig)

    def full(m):
        with cls.summon_full_params(m):
            return {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for n, p in m.named_parameters()}
    return _train(m, full)


def _fully_shard(which):
    from torch.distributed.device_mesh import init_device_mesh
    shard = flatshard.fully_shard if which == "flatshard" else tfsdp.fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = _net()
    shard(m.moe, mesh=mesh)
    shard(m, mesh=mesh)
    m.set_reduce_scatter_unused_params(True)

    def full(m):
        return {n: p.full_tensor().detach().clone() for n, p in m.named_parameters()}
    return _train(m, full)


def _all(api):
    ref = _reference(dist.get_world_size())
    if api == "fsdp1":
        runs = {f"{w} use_orig_params={u}": _fsdp1(w, u) for w in ("torch", "flatshard")
                for u in (False, True)}
    else:
        runs = {w: _fully_shard(w) for w in ("torch", "flatshard")}
    worst = {}
    for name, got in runs.items():
        assert got.keys() == ref.keys(), (name, got.keys())
        worst[name] = max(((got[k].double() - ref[k]).abs().max() /
                           ref[k].abs().max()).item() for k in ref)
    unused = ref["moe.experts.1.weight"]
    init = Net().moe.experts[1].weight  # seed 0 again: the same init
    return worst, bool((unused - init.double()).abs().max() > 1e-3)


@pytest.mark.parametrize("api", ["fsdp1", "fully_shard"])
def test_an_expert_one_rank_never_used_trains_as_torch_and_the_reference(dist_pool, api):
    for worst, moved in dist_pool(2).run(_all, api, timeout=TIMEOUT):
        assert moved  # the expert rank 0 never used did train (rank 1's gradient / 2)
        for name, err in worst.items():
            assert err < 1e-5, (name, worst)


def _fully_shard_default():
    """fully_shard without set_reduce_scatter_unused_params: named, not hung."""
    from torch.distributed.device_mesh import DeviceMesh
    group = dist.new_group(backend="gloo")  # a Comm of its own, on shm: it fails, not WORLD's
    mesh = DeviceMesh.from_group(group, "cpu")
    m = _net()
    flatshard.fully_shard(m.moe, mesh=mesh)
    flatshard.fully_shard(m, mesh=mesh)
    try:
        m(_batch(dist.get_rank(), 0)).square().mean().backward()
    except flatshard.CoreError as e:  # the note on where each rank was comes with it
        return "\n".join([str(e)] + getattr(e, "__notes__", []))
    return None


def test_without_reduce_scatter_unused_params_the_fix_is_named(dist_pool):
    for msg in dist_pool(2).run(_fully_shard_default, timeout=TIMEOUT):
        assert msg is not None and "ranks are in different collectives" in msg
        assert "reduce_scatter" in msg and "'moe'" in msg
        assert "call set_reduce_scatter_unused_params(True) on that module" in msg
        assert_documented("unused-params", "CoreError: " + msg)
