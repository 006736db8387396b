"""The FSDP1 wrapper's events ([Note: unit events] in fsdp/unit.py: the
backward's plain path in C, else its Python methods): flatshard's wrapper and torch's own FSDP1 trained
in one run on 2 ranks, for both use_orig_params settings and the three
backward prefetch choices: losses and full parameters bit for bit; and each
inner unit's engine calls counted, so the test sees every event reach the
engine once per step (a prefetch's gather counts for the unit it gathers)."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import BackwardPrefetch as TorchBP
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

from flatshard import BackwardPrefetch, FullyShardedDataParallel, ModuleWrapPolicy
from flatshard.fsdp.unit import fsdp_units
from test_fully_shard_torch_flows import Block
from test_event_paths import _net

TIMEOUT = 240


def _train(wrap, steps, orig, prefetch):
    model = wrap(_net(), orig, prefetch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(3 + dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 12, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    counts = None
    if isinstance(model, FullyShardedDataParallel):
        # the engine's own counts of each inner unit's collectives
        counts = [dict(m._unit.c.counts) for m in fsdp_units(model)[1:]]
    with type(model).summon_full_params(model):
        params = [p.detach().clone() for p in model.parameters()]
    return losses, params, counts


def _ours(model, orig, prefetch):
    bp = None if prefetch is None else getattr(BackwardPrefetch, prefetch)
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                    use_orig_params=orig, backward_prefetch=bp)


def _torchs(model, orig, prefetch):
    bp = None if prefetch is None else getattr(TorchBP, prefetch)
    return TorchFSDP(model, auto_wrap_policy=TorchPolicy({Block}), use_orig_params=orig,
                     backward_prefetch=bp, device_id=torch.device("cpu"))


def _both(steps, orig, prefetch):
    return {"flatshard": _train(_ours, steps, orig, prefetch),
            "torch": _train(_torchs, steps, orig, prefetch)}


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("prefetch", ["BACKWARD_PRE", "BACKWARD_POST", None])
def test_units_train_as_torch(dist_pool, orig, prefetch):
    steps = 3
    for runs in dist_pool(2).run(_both, steps, orig, prefetch, timeout=TIMEOUT):
        assert runs["flatshard"][0] == runs["torch"][0], runs
        for a, b in zip(runs["flatshard"][1], runs["torch"][1]):
            assert torch.equal(a, b)
        # FULL_SHARD: each inner unit gathered for forward and again for
        # backward, and reduced once, every step (summon_full_params' own
        # gather comes after these counts)
        for c in runs["flatshard"][2]:
            assert c["all_gather"] == 2 * steps, c
            assert c["reduce"] == steps, c
