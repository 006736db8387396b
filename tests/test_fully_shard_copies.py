"""The bytes fully_shard copies in a step (flatshard.copy_stats, the engine's
[Note: copy counts] in csrc/engine/shard_group.h), held against what each group's
layout needs, computed here from the parameters' shapes (torch.chunk's rows
per rank), and the training itself against torch's fully_shard in the same
run, bit for bit:

  2 ranks, groups of several parameters: every gather copies each shard in
  and every row out, every reduction each gradient in and each new sharded
  gradient out; a group of one evenly split Shard(0) parameter copies
  nothing (its own all-gather output and reduce-scatter input);
  1 rank, or HSDP over the replicas alone: the parameters are the shards,
  nothing is copied in fp32; under mixed precision only the casts.

With reshard_after_forward True, False and 2, gradient accumulation without
sync, and the sharded state dict round trip."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flatshard
from flatshard import MixedPrecisionPolicy, fully_shard
from flatshard.fsdp2.state import state_of
from test_fully_shard_torch_flows import Block

TIMEOUT = 240


class Net(nn.Module):
    """blocks: groups of four parameters with 7 rows (4 and 3 rows on 2
    ranks); head: one 16 x 7 weight (8 rows each, 16-byte multiples in fp32
    and bf16), a group of its own."""

    def __init__(self, d=7, block=Block):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(block(d) for _ in range(2))
        self.head = nn.Linear(d, 16, bias=False)
        self.out = nn.Linear(16, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(self.head(x))


def _build(fn, raf, mp, mesh):
    torch.manual_seed(0)
    model = Net()
    kw = {"reshard_after_forward": raf, "mesh": mesh}
    if mp:
        kw["mp_policy"] = (TorchMP if fn is torch_fully_shard else MixedPrecisionPolicy)(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in (*model.blocks, model.head):
        fn(m, **kw)
    kw["reshard_after_forward"] = True
    return fn(model, **kw)


def _groups(model):
    return [st.group for st in map(state_of, model.modules())
            if st is not None and st.group is not None]


ALIGN_BYTES = 16  # every parameter's rows start at a multiple of it in a rank's block


def _direct(group, shard_world, es):
    """Whether the group's layout lets its collectives run on the parameters
    and gradients themselves (csrc/engine/shard_group.h, [Note: direct layout]): one
    rank in the shard group, or one parameter whose rows split evenly into
    whole multiples of ALIGN_BYTES (no padding in a rank's block)."""
    if shard_world == 1:
        return True
    if len(group.sharded) != 1:
        return False
    shape = group.sharded[0].shape
    rows, rest = divmod(shape[0], shard_world)
    return rest == 0 and rows * (group.sharded[0].numel() // shape[0]) * es % ALIGN_BYTES == 0


def _needed(group, shard_world, rank, mp):
    """What one gather and one reduction of `group` must copy (bytes), from
    its parameters' shapes, as (copy_in, copy_out, reduce_in, reduce_out,
    cast) per gather and per reduction; fp32 shards, under mixed precision
    bf16 compute and fp32 reduction."""
    gather, reduce = [0] * 5, [0] * 5
    es = 2 if mp else 4
    direct = _direct(group, shard_world, es)
    for p in group.sharded:
        numel = p.numel()
        chunks = torch.empty(p.shape[0]).chunk(shard_world)
        local = (chunks[rank].numel() if rank < len(chunks) else 0) * (numel // p.shape[0])
        if direct and mp:  # the casts: the shard into the compute dtype, the gradient back
            gather[4] += local * es
            reduce[4] += numel * 4
        elif not direct:
            gather[4 if mp else 0] += local * es
            gather[1] += numel * es
            reduce[4 if mp else 2] += numel * 4
            reduce[3] += local * 4
    return gather, reduce


def _steps(fn, model, steps, accumulate):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(5 + dist.get_rank())
    losses = []
    for _ in range(steps):
        for micro in range(2 if accumulate else 1):
            if accumulate:
                model.set_requires_gradient_sync(micro == 1)
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            loss = ((model(x).float() - y) ** 2).mean()
            loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def _flow(raf, mp, accumulate, hsdp=False):
    world, rank = dist.get_world_size(), dist.get_rank()
    if hsdp:  # the replicas alone: a shard dim of one rank
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        shard_world, shard_rank = 1, 0
    else:
        mesh = init_device_mesh("cpu", (world,))
        shard_world, shard_rank = world, rank
    out = {}
    for name, fn in (("torch", torch_fully_shard), ("ours", fully_shard)):
        model = _build(fn, raf, mp, mesh)
        if fn is fully_shard:
            groups = _groups(model)
            before = flatshard.copy_stats(model)
            gathers0 = [g.n_all_gathers for g in groups]
            reduces0 = [g.n_reduce_scatters for g in groups]
        losses = _steps(fn, model, 3, accumulate)
        out[name] = (losses, {n: p.to_local().clone() for n, p in model.named_parameters()})
        if fn is fully_shard:
            after = flatshard.copy_stats(model)
            copied = {k: after[k] - before[k] for k in after}
            want = dict.fromkeys(copied, 0)
            for g, n0, r0 in zip(groups, gathers0, reduces0):
                gather, reduce = _needed(g, shard_world, shard_rank, mp)
                ng = g.n_all_gathers - n0  # (a post-forward gather copies in Python)
                nr = g.n_reduce_scatters - r0
                for k, a, b in zip(want, gather, reduce):
                    want[k] += ng * a + nr * b
            out["copied"], out["want"] = copied, want
            out["total"] = flatshard.memory_stats(model)["copied"] - sum(before.values())
            # the sharded state dict into a fresh model: the same next step
            sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
            out["reloaded"] = _steps(fn, model, 1, False) == _steps(
                fn, _reload(raf, mp, mesh, sd), 1, False)
    return out


def _reload(raf, mp, mesh, sd):
    model = _build(fully_shard, raf, mp, mesh)
    model.load_state_dict(sd)
    return model


def _check(outs):
    for out in outs:
        assert out["copied"] == out["want"]
        assert out["total"] == sum(out["want"].values())
        assert out["ours"][0] == out["torch"][0]
        theirs, ours = out["torch"][1], out["ours"][1]
        assert list(theirs) == list(ours)
        for k in theirs:
            assert torch.equal(theirs[k], ours[k]), k
        assert out["reloaded"]


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("raf", [True, False, 2])
def test_copies_fp32(dist_pool, world, raf):
    if raf == 2 and world == 1:
        raf = 1
    outs = dist_pool(world).run(_flow, raf, False, False, False, timeout=TIMEOUT)
    _check(outs)
    if world == 1:
        assert sum(outs[0]["copied"].values()) == 0


@pytest.mark.parametrize("world", [1, 2])
def test_copies_mixed_precision(dist_pool, world):
    _check(dist_pool(world).run(_flow, True, True, False, timeout=TIMEOUT))


@pytest.mark.parametrize("world", [1, 2])
def test_copies_with_accumulation(dist_pool, world):
    _check(dist_pool(world).run(_flow, True, False, True, timeout=TIMEOUT))


def test_copies_hsdp_replicas_alone(dist_pool):
    outs = dist_pool(2).run(_flow, True, False, False, True, timeout=TIMEOUT)
    _check(outs)
    assert all(sum(o["copied"].values()) == 0 for o in outs)


# ----------------------------------------------------------------------
# the parameters being the shards, through what reads or swaps them


class CheckpointedBlock(Block):
    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


def _checkpointed(fn):
    torch.manual_seed(0)
    model = Net(block=CheckpointedBlock)
    for m in (*model.blocks, model.head):
        fn(m)
    return fn(model)


def _swaps_and_checkpoints(tmp):
    """Activation checkpointing, a `.data` swap of a sharded parameter, then
    a DCP save, a load into a fresh model and more steps: both
    implementations the same bits, and the loaded model the saved one's."""
    import torch.distributed.checkpoint as dcp
    out = {}
    for name, fn in (("torch", torch_fully_shard), ("ours", fully_shard)):
        model = _checkpointed(fn)
        losses = _steps(fn, model, 2, False)
        w = model.head.weight
        w.data = w.data * 0.5  # the module keeps the parameter, its local tensor is new
        losses += _steps(fn, model, 1, False)
        path = f"{tmp}/{name}"
        dcp.save({"model": model.state_dict()}, checkpoint_id=path)
        fresh = _checkpointed(fn)
        sd = {"model": fresh.state_dict()}
        dcp.load(sd, checkpoint_id=path)
        fresh.load_state_dict(sd["model"])
        losses += _steps(fn, model, 1, False)
        out[name] = (losses, _steps(fn, fresh, 1, False),
                     {n: p.to_local().clone() for n, p in model.named_parameters()})
        if fn is fully_shard:
            out["copied"] = sum(flatshard.copy_stats(model).values())
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_shards_as_parameters_through_checkpointing_swaps_and_dcp(dist_pool, world, tmp_path):
    for out in dist_pool(world).run(_swaps_and_checkpoints, str(tmp_path), timeout=TIMEOUT):
        theirs, ours = out["torch"], out["ours"]
        assert ours[0] == theirs[0]
        assert ours[1] == theirs[1] == ours[0][-1:]  # the loaded model takes the same step
        for k in theirs[2]:
            assert torch.equal(theirs[2][k], ours[2][k]), k
        if world == 1:
            assert out["copied"] == 0
