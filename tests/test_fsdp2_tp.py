"""fully_shard on tensor-parallel parameters: parallelize_module(block,
mesh["tp"], {Colwise, Rowwise}) then fully_shard(block, mesh=mesh["dp"]) on
a 2-D (dp, tp) mesh of 4 ranks, and HSDP + TP on a 3-D mesh, against torch's
own fully_shard + TP in the same run (torch's collectives on gloo; flatshard's
on its shm backend, or on the torch one); then distributed checkpoints saved
on one mesh shape and loaded on another.

Both frameworks do the same arithmetic (the tensor-parallel collectives are
DTensor's in both; the data-parallel sums are of two float32 values), so
losses, placements and checkpoints are compared bit for bit."""
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     set_model_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from flatshard import MixedPrecisionPolicy, fully_shard
from test_fsdp2_shard_dim import Block
from test_fsdp2_shard_dim import _train as train_sgd

TIMEOUT = 300
BOTH = (("torch", torch_fully_shard, TorchMP), ("ours", fully_shard, MixedPrecisionPolicy))


class Net(nn.Module):
    def __init__(self, d=8, h=12, vocab=10):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(2))
        self.out = nn.Linear(d, 5)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _build(fn, mesh, dp_dims=("dp",), tp=True, **kw):
    torch.manual_seed(0)
    model = Net()
    dp = mesh[dp_dims] if len(dp_dims) > 1 else mesh[dp_dims[0]]
    for b in model.blocks:
        if tp:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(),
                                               "down": RowwiseParallel()})
        fn(b, mesh=dp, **kw)
    fn(model, mesh=dp, **kw)
    return model


def _train(model, dp_rank, steps=3):
    """SGD on the data-parallel rank's batches (the tp ranks of one dp rank
    see the same batch)."""
    g = torch.Generator().manual_seed(5 + dp_rank)
    batches = [(torch.randint(0, 10, (4,), generator=g), torch.randn(4, 5, generator=g))
               for _ in range(steps)]
    return train_sgd(model, batches)


def _full(model):
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items()}


def _compare(shape, names, dp_dims, backend, mp, raf):
    """Each framework: build, check what the modules hold after a forward,
    train; -> {name: (losses, placements, full state dict, after-forward)}."""
    saved = os.environ.get("FLATSHARD_COMM_BACKEND")
    os.environ["FLATSHARD_COMM_BACKEND"] = backend
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        dp_rank = mesh["dp"].get_local_rank() + (
            mesh["rep"].get_local_rank() * mesh["dp"].size() if "rep" in names else 0)
        out = {}
        for name, fn, policy in BOTH:
            kw = {"reshard_after_forward": raf}
            if mp:
                kw["mp_policy"] = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            model = _build(fn, mesh, dp_dims, **kw)
            placements = {n: (tuple(p.placements), tuple(p.to_local().shape))
                          for n, p in model.named_parameters()}
            model(torch.zeros(2, dtype=torch.long))  # the modules' parameters after forward
            w = model.blocks[0].up.weight
            held = (type(w).__name__, tuple(w.placements), tuple(w.to_local().shape))
            for b in list(model.blocks) + [model]:
                b.reshard()
            losses = _train(model, dp_rank)
            out[name] = (losses, placements, _full(model), held)
        return out
    finally:
        if saved is None:
            os.environ.pop("FLATSHARD_COMM_BACKEND")
        else:
            os.environ["FLATSHARD_COMM_BACKEND"] = saved


def _check(results, raf):
    for out in results:
        t, o = out["torch"], out["ours"]
        assert o[0] == t[0], (o[0], t[0])
        assert o[1] == t[1], (o[1], t[1])
        assert all(torch.equal(o[2][k], t[2][k]) for k in t[2])
        assert o[3] == t[3], (o[3], t[3])
        if raf is False:  # kept unsharded: a DTensor on the tp mesh, the tp rank's piece
            assert o[3] == ("DTensor", (Shard(0),), (6, 8)), o[3]
    # the tp ranks of a dp rank saw the same batch: their losses agree
    assert results[0]["ours"][0] == results[1]["ours"][0]


def test_tp_then_fully_shard_on_a_2d_mesh_matches_torch(dist_pool):
    _check(dist_pool(4).run(_compare, (2, 2), ("dp", "tp"), ("dp",), "shm", False, None,
                            timeout=TIMEOUT), None)


def test_tp_kept_unsharded_bf16_on_the_torch_backend_matches_torch(dist_pool):
    _check(dist_pool(4).run(_compare, (2, 2), ("dp", "tp"), ("dp",), "torch", True, False,
                            timeout=TIMEOUT), False)


def test_hsdp_and_tp_on_a_3d_mesh_match_torch(dist_pool):
    _check(dist_pool(4).run(_compare, (2, 1, 2), ("rep", "dp", "tp"), ("rep", "dp"), "shm",
                            False, None, timeout=TIMEOUT), None)


def _checkpoint_across_shapes(path):
    """Trained with TP + fully_shard on (dp 2, tp 2), saved with DCP; loaded
    into fully_shard over all 4 ranks without TP (flatshard's and torch's),
    and into torch's TP + fully_shard on (dp 2, tp 2): every tensor equal."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _build(fully_shard, mesh)
    _train(model, mesh["dp"].get_local_rank(), steps=2)
    want = _full(model)
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    loaded = []
    for fn, m in ((fully_shard, flat), (torch_fully_shard, flat), (torch_fully_shard, mesh)):
        other = _build(fn, m, tp=m is mesh)
        sd = get_model_state_dict(other)
        dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(other, sd, options=StateDictOptions(strict=True))
        loaded.append(_full(other))
    # and flatshard's TP model loads what a flat one saved
    dcp.save(get_model_state_dict(_build(fully_shard, flat, tp=False)),
             checkpoint_id=path + "_flat")
    back = _build(fully_shard, mesh)
    sd = get_model_state_dict(back)
    dcp.load(sd, checkpoint_id=path + "_flat")
    set_model_state_dict(back, sd)
    first = _full(_build(fully_shard, flat, tp=False))
    return ([all(torch.equal(got[k], want[k]) for k in want) for got in loaded],
            all(torch.equal(_full(back)[k], first[k]) for k in first),
            all(isinstance(p, DTensor) for p in back.parameters()))


def test_dcp_checkpoint_across_mesh_shapes(dist_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    for same, back, dtensors in dist_pool(4).run(_checkpoint_across_shapes, path,
                                                 timeout=TIMEOUT):
        assert same == [True, True, True] and back and dtensors


# ----------------------------------------------------------------------
# a full SPMD mesh: fully_shard(mesh=mesh, dp_mesh_dims=...)

def _distribute(model, mesh, dp_dims):
    """Every parameter a DTensor on the full mesh: replicated on the
    data-parallel dims; on "tp", the blocks' linears split as Colwise (up)
    and Rowwise (down) would, the rest replicated."""
    tp_place = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)}
    for mod_name, mod in model.named_modules():
        for n, p in list(mod.named_parameters(recurse=False)):
            key = f"{mod_name.split('.')[-1]}.{n}"
            placements = [Replicate() if d in dp_dims else tp_place.get(key, Replicate())
                          for d in mesh.mesh_dim_names]
            local = p.detach()  # this rank's piece of the same full tensor everywhere
            for i, pl in enumerate(placements):
                if isinstance(pl, Shard):
                    size = mesh.size(i)
                    local = local.chunk(size, dim=pl.dim)[mesh.get_local_rank(i)]
            setattr(mod, n, nn.Parameter(DTensor.from_local(
                local.contiguous(), mesh, placements, run_check=False, shape=p.shape,
                stride=p.stride())))


def _spmd_train(shape, names, dp_dims, mp, ddp=False):
    """ddp: flatshard replicates over "dp" (replicate names alone); torch,
    whose replicate-only mode refuses these DTensors, shards over it: the
    same mean gradient, so the same losses and weights."""
    from flatshard import DataParallelMeshDims
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp = dp_dims[-1]  # the shard dim's name (the replicate one first, if any)
    dims = DataParallelMeshDims(shard=dp, replicate="rep" if "rep" in names else None)
    batch = [Shard(0) if d in dp_dims else Replicate() for d in names]
    world = dist.get_world_size() // mesh["tp"].size()
    out = {}
    for name, fn, policy in BOTH:
        torch.manual_seed(0)
        model = Net()
        _distribute(model, mesh, dp_dims)
        kw = {"mesh": mesh, "dp_mesh_dims": DataParallelMeshDims(replicate=dp)
              if ddp and name == "ours" else dims}
        if mp:
            kw["mp_policy"] = policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for b in model.blocks:
            fn(b, **kw)
        fn(model, **kw)
        placements = {n: tuple(p.placements) for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(3)
        losses = []
        for _ in range(3):  # the global batch, every rank the same; DTensors split it
            idx = torch.randint(0, 10, (4 * world,), generator=g)
            y = torch.randn(4 * world, 5, generator=g)
            idx, y = distribute_tensor(idx, mesh, batch), distribute_tensor(y, mesh, batch)
            loss = ((model(idx).float() - y) ** 2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.full_tensor().item())
        out[name] = (losses, placements, _full(model))
    return out


def _check_spmd(results, ddp=False):
    for out in results:
        t, o = out["torch"], out["ours"]
        assert o[0] == t[0], (o[0], t[0])
        assert all(torch.equal(o[2][k], t[2][k]) for k in t[2])
        if ddp:  # replicated on dp, the tp placement kept
            assert o[1]["blocks.0.up.weight"] == (Replicate(), Shard(0))
            continue
        assert o[1] == t[1], (o[1], t[1])
        assert o[1]["blocks.0.up.weight"][-2] == _StridedShard(0, split_factor=2)  # dp, tp


def test_dp_mesh_dims_on_a_full_spmd_mesh_matches_torch(dist_pool):
    _check_spmd(dist_pool(4).run(_spmd_train, (2, 2), ("dp", "tp"), ("dp",), False,
                                 timeout=TIMEOUT))


def test_dp_mesh_dims_replicate_alone_is_ddp_and_matches_torch(dist_pool):
    # other dim names than the test above: torch's fully_shard compares meshes by
    # identity, and an equal mesh of an earlier test can come back from its caches
    _check_spmd(dist_pool(4).run(_spmd_train, (2, 2), ("data", "tp"), ("data",), False, True,
                                 timeout=TIMEOUT), ddp=True)


def test_dp_mesh_dims_hsdp_bf16_matches_torch(dist_pool):
    _check_spmd(dist_pool(4).run(_spmd_train, (2, 1, 2), ("rep", "dp", "tp"), ("rep", "dp"),
                                 True, timeout=TIMEOUT))


def _meta_tp_resume():
    """The large-model flow with TP: built on the meta device, parallelized
    and sharded, then a full state dict loaded by set_model_state_dict (no
    to_empty, no reset_parameters); trained."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = Net().state_dict()
    out = {}
    for name, fn, _ in BOTH:
        with torch.device("meta"):
            model = Net()
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(),
                                               "down": RowwiseParallel()})
            fn(b, mesh=mesh["dp"])
        fn(model, mesh=mesh["dp"])
        # (broadcast_from_rank0 is not an option here: torch's own broadcast
        # has no sharding rule for the 2-D DTensors)
        sd = {k: v.clone() for k, v in full.items()}  # torch's load changes the dict
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True))
        assert not any(p.is_meta for p in model.parameters())
        out[name] = (_train(model, mesh["dp"].get_local_rank()), _full(model))
    return out


def test_meta_init_tp_then_full_state_dict_load_matches_torch(dist_pool):
    for out in dist_pool(4).run(_meta_tp_resume, timeout=TIMEOUT):
        assert out["ours"][0] == out["torch"][0]
        assert all(torch.equal(out["ours"][1][k], out["torch"][1][k]) for k in out["torch"][1])
