"""fully_shard(shard_placement_fn=...) sharding parameters on a dim other
than 0, against torch's own fully_shard in the same run (2 ranks; torch on
gloo, flatshard on its default backend) and, for the uneven splits torch
refuses, against single-process training on the whole batch.

A rank's piece of a Shard(d) parameter is torch.chunk's piece of dim d: in
the unsharded parameter its rows are prod(shape[:d]) runs apart, so the
engine's copy-out and gradient copy-in are strided (csrc/engine/shard_group.c);
both frameworks do the same arithmetic, so losses and shards are compared
bit for bit."""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from flatshard import MixedPrecisionPolicy, fully_shard

TIMEOUT = 240


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    """An embedding and 3-D weight beside the linears: dims 1 and 2 sharded."""

    def __init__(self, d=6, h=10, vocab=11):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.mix = nn.Parameter(torch.randn(3, d, 4) * 0.3)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(2))
        self.out = nn.Linear(d, 5)

    def forward(self, idx):
        x = self.emb(idx)
        x = x + torch.einsum("bd,kdj->bj", x, self.mix).repeat(1, 2)[:, :x.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _last_dim(p):
    return Shard(p.dim() - 1) if p.dim() > 1 else Shard(0)


def _minus_one(p):
    return Shard(-1)


def _net(**kw):
    torch.manual_seed(0)
    return Net(**kw)


def _shard(fn, model, placement, **kw):
    for b in model.blocks:
        fn(b, shard_placement_fn=placement, **kw)
    return fn(model, shard_placement_fn=placement, **kw)


def _batches(steps, vocab, per_rank=4, rank=None, world=None):
    """Every rank's batches (the same generator everywhere); this rank's
    slice when rank is given."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        idx = torch.randint(0, vocab, (per_rank * world,), generator=g)
        y = torch.randn(per_rank * world, 5, generator=g)
        if rank is not None:
            idx, y = idx[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        out.append((idx, y))
    return out


def _train(model, batches):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for idx, y in batches:
        loss = ((model(idx).float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run_both(placement, mp, raf):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, fn, policy in (("torch", torch_fully_shard, TorchMP),
                             ("ours", fully_shard, MixedPrecisionPolicy)):
        model = _net()
        kw = {"reshard_after_forward": raf}
        if mp:
            kw["mp_policy"] = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        _shard(fn, model, placement, **kw)
        placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
        losses = _train(model, _batches(3, 11, rank=rank, world=world))
        shards = {n: p.to_local().clone() for n, p in model.named_parameters()}
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
        out[name] = (losses, placements, shards, {k: v.clone() for k, v in full.items()})
    return out


def _check_same(results):
    for out in results:
        t, o = out["torch"], out["ours"]
        assert o[0] == t[0], (o[0], t[0])                       # losses, bit for bit
        assert o[1] == t[1]                                     # placements
        assert o[1]["mix"] == (Shard(2),) and o[1]["emb.weight"] == (Shard(1),)
        for n in t[2]:
            assert o[2][n].shape == t[2][n].shape and torch.equal(o[2][n], t[2][n]), n
        for k in t[3]:
            assert torch.equal(o[3][k], t[3][k]), k


def test_last_dim_matches_torch(dist_pool):
    _check_same(dist_pool(2).run(_run_both, _last_dim, False, None, timeout=TIMEOUT))


def test_negative_dim_kept_unsharded_after_forward_matches_torch(dist_pool):
    _check_same(dist_pool(2).run(_run_both, _minus_one, False, False, timeout=TIMEOUT))


def test_last_dim_bf16_params_matches_torch(dist_pool):
    _check_same(dist_pool(2).run(_run_both, _last_dim, True, None, timeout=TIMEOUT))


def _uneven():
    """Dims of 5, 7 and 3 split over 2 ranks (torch refuses these for dims
    other than 0): the same SGD on the whole batch in one process is the
    reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    kw = dict(d=5, h=7, vocab=9)
    model = _net(**kw)
    _shard(fully_shard, model, _last_dim)
    local = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    losses = _train(model, _batches(3, 9, rank=rank, world=world))
    ref = _net(**kw)
    ref_losses = _train(ref, _batches(3, 9, per_rank=4 * world, world=1))
    diff = max((p.full_tensor() - r).abs().max().item()
               for p, r in zip(model.parameters(), ref.parameters()))
    assert all(isinstance(p, DTensor) for p in model.parameters())
    return local, losses, ref_losses, diff


def test_uneven_split_of_a_later_dim_matches_single_process(dist_pool):
    out = dist_pool(2).run(_uneven, timeout=TIMEOUT)
    for rank, (local, losses, ref_losses, diff) in enumerate(out):
        # torch.chunk's pieces: 7 columns as 4 + 3, 5 as 3 + 2
        assert local["blocks.0.down.weight"] == (5, (4, 3)[rank])
        assert local["blocks.0.up.weight"] == (7, (3, 2)[rank])
        assert local["mix"] == (3, 5, 2)
        assert diff < 1e-6, diff
    # each rank's loss is its half of the batch; their mean is the whole batch's
    mean = [(a + b) / 2 for a, b in zip(out[0][1], out[1][1])]
    for got, want in zip(mean, out[0][2]):
        assert abs(got - want) < 1e-6, (mean, out[0][2])
