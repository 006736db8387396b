"""HYBRID_SHARD on the FSDP1 wrapper: shard inside a group of ranks, all-reduce
the gradient shards across the groups' replicas. 4 ranks as 2 "hosts" of 2,
against plain torch on the whole batch in one process (the reference) and
against torch's own FSDP with the same hybrid groups. Tolerance as in
parity.py: only the order of floating-point sums differs."""
import os

import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard import FSDP, MixedPrecision, ShardingStrategy
from toy_models import Block, build

RTOL, SCALE_ATOL = 2e-6, 2e-6
PER_RANK = 2


def _groups():
    """Hosts {0,1} and {2,3}: every rank makes every group, in one order."""
    rank = dist.get_rank()
    mine = [None, None]
    for ranks, slot in (([0, 1], 0), ([2, 3], 0), ([0, 2], 1), ([1, 3], 1)):
        g = dist.new_group(ranks)
        if rank in ranks:
            mine[slot] = g
    return tuple(mine)


def _batches(steps=3):
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(PER_RANK * 4, 5, generator=g), torch.randn(PER_RANK * 4, 3, generator=g))
            for _ in range(steps)]


def _train(model, opt, batches, mine):
    losses = []
    for x, y in batches:
        xs, ys = (x[mine], y[mine]) if mine is not None else (x, y)
        loss = ((model(xs).float() - ys) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _worst(sd, ref):
    worst = 0.0
    for k, want in ref.items():
        got = sd[k]
        scale = want.abs().max().item() if want.numel() else 0.0
        torch.testing.assert_close(got.float(), want.float(), rtol=RTOL,
                                   atol=max(1e-7, SCALE_ATOL * scale), msg=lambda m: f"{k}: {m}")
        if scale:
            worst = max(worst, ((got.float() - want.float()).abs().max() / scale).item())
    return worst


def _run(how, strategy="HYBRID_SHARD", opt="adamw"):
    rank = dist.get_rank()
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    kw = dict(auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
              sharding_strategy=ShardingStrategy[strategy])
    if how == "pair":
        kw["process_group"] = _groups()
    elif how == "mesh":
        from torch.distributed.device_mesh import init_device_mesh
        kw["device_mesh"] = init_device_mesh("cpu", (2, 2))
    else:  # None: the hosts come from LOCAL_WORLD_SIZE, as torchrun sets it
        os.environ["LOCAL_WORLD_SIZE"] = how
    try:
        model = FSDP(build(), **kw)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    make = (lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1)) if opt == "adamw" else \
        (lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    ref = build()
    batches = _batches()
    ours = _train(model, make(model.parameters()), batches, mine)
    # the reference: one process, whole batch; its loss on this rank's rows
    theirs = []
    ref_opt = make(ref.parameters())
    for x, y in batches:
        with torch.no_grad():
            theirs.append(((ref(x[mine]) - y[mine]) ** 2).mean().item())
        ((ref(x) - y) ** 2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    worst = _worst(model.state_dict(), ref.state_dict())
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    ops = sorted({e["op"] for m in model.modules() if isinstance(m, FSDP)
                  for e in m._unit.c.comm.ledger()})
    return worst, loss_diff, ops, model._unit.c.comm.world_size


@pytest.mark.parametrize("how,strategy", [
    ("pair", "HYBRID_SHARD"), ("mesh", "_HYBRID_SHARD_ZERO2"), ("2", "HYBRID_SHARD")])
def test_hybrid_matches_one_process(dist_pool, how, strategy):
    for worst, loss_diff, ops, shard_world in dist_pool(4).run(_run, how, strategy):
        assert worst <= SCALE_ATOL and loss_diff <= 1e-5, (worst, loss_diff)
        assert shard_world == 2 and "reduce_scatter" in ops and "all_gather" in ops


@pytest.mark.parametrize("hosts_of", ["1", "4"])
def test_hybrid_degenerate_groups(dist_pool, hosts_of):
    """One rank per host: replicas only (NO_SHARD across them); one host:
    plain sharding. Both still train like one process."""
    for worst, loss_diff, ops, shard_world in dist_pool(4).run(_run, hosts_of, "HYBRID_SHARD",
                                                               "sgd"):
        assert worst <= SCALE_ATOL and loss_diff <= 1e-5, (worst, loss_diff)
        assert shard_world == 4
        assert ("all_reduce" in ops) == (hosts_of == "1")


def _against_torch(mp):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMP
    from torch.distributed.fsdp import ShardingStrategy as TS
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    rank = dist.get_rank()
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    groups = _groups()
    mkw = dict(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16) if mp else None
    ours = FSDP(build(), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=groups,
                mixed_precision=MixedPrecision(**mkw) if mp else None)
    theirs = TorchFSDP(build(), auto_wrap_policy=ModuleWrapPolicy({Block}),
                       sharding_strategy=TS.HYBRID_SHARD, process_group=groups,
                       mixed_precision=TorchMP(**mkw) if mp else None,
                       device_id=torch.device("cpu"))
    batches = _batches()
    a = _train(ours, torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9), batches, mine)
    b = _train(theirs, torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9), batches,
               mine)
    sa, sb = ours.state_dict(), theirs.state_dict()
    pdiff = max(((sa[k].float() - sb[k].float()).abs().max() / sb[k].float().abs().max()).item()
                for k in sb if sb[k].numel() and sb[k].is_floating_point())
    return max(abs(x - y) / abs(y) for x, y in zip(a, b)), pdiff


@pytest.mark.parametrize("mp", [False, True])
def test_hybrid_matches_torch_fsdp(dist_pool, mp):
    for loss_diff, pdiff in dist_pool(4).run(_against_torch, mp):
        assert loss_diff <= 1e-6 and pdiff <= 1e-6, (loss_diff, pdiff)


def _sync_module_states():
    torch.manual_seed(dist.get_rank())  # a different initialization on every rank
    from toy_models import Net
    model = FSDP(Net(), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                 sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=_groups(),
                 sync_module_states=True)
    torch.manual_seed(0)
    want = Net().state_dict()  # rank 0's initialization
    return all(torch.equal(v, want[k]) for k, v in model.state_dict().items())


def test_hybrid_sync_module_states(dist_pool):
    assert all(dist_pool(4).run(_sync_module_states))  # every rank holds rank 0's weights


def _hybrid_model(how):
    kw = dict(auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
              sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    if how == "pair":
        kw["process_group"] = _groups()
    elif how == "mesh":
        from torch.distributed.device_mesh import init_device_mesh
        kw["device_mesh"] = init_device_mesh("cpu", (2, 2))
    else:
        os.environ["LOCAL_WORLD_SIZE"] = "2"
    try:
        return FSDP(build(), **kw)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)


def _checkpoint_round_trip(path, how):
    rank = dist.get_rank()
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    batches = _batches(4)
    model = _hybrid_model(how)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, batches[:2], mine)
    flatshard.save_checkpoint(path, model, opt)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    after = _train(model, opt, batches[2:], mine)
    # a fresh hybrid model resumes bit for bit
    again = _hybrid_model(how)
    opt2 = torch.optim.AdamW(again.parameters(), lr=0.01)
    flatshard.load_checkpoint(path, again, opt2)
    resumed = _train(again, opt2, batches[2:], mine)
    # and plain FULL_SHARD over all 4 ranks reads the same weights
    plain = FSDP(build(), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}))
    flatshard.load_checkpoint(path, plain)
    same = all(torch.equal(v, saved[k]) for k, v in plain.state_dict().items())
    # the sharded state dict: DTensors on the (replicate, shard) mesh
    with FSDP.state_dict_type(model, flatshard.StateDictType.SHARDED_STATE_DICT):
        placements = {str(v.placements) for v in model.state_dict().values()
                      if hasattr(v, "placements") and v.dim()}
    return after == resumed, same, sorted(placements)


@pytest.mark.parametrize("how", ["2", "pair", "mesh"])
def test_hybrid_checkpoints_resume_and_reshard(dist_pool, tmp_path, how):
    for resumed, plain_same, placements in dist_pool(4).run(_checkpoint_round_trip,
                                                            str(tmp_path / "ckpt"), how):
        assert resumed and plain_same
        assert placements == ["(Replicate(), Shard(dim=0))"]
