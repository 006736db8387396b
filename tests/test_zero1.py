"""SHARD_OPTIM (ZeRO-1) against plain torch in one process (tolerance in
parity.py), and its memory: whole parameters and gradients, optimizer state
sharded."""
import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard import FSDP, ShardingStrategy
from parity import batches, optimizer, policy, run_case
from toy_models import build


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parity_with_plain_torch(dist_pool, world):
    # eval_every: a forward after each step matches the reference, so the
    # whole parameters were gathered back after optimizer.step().
    res = dist_pool(world).run(run_case, strategy="SHARD_OPTIM", opt="adamw", eval_every=True)
    assert all(r["n_params"] > 0 for r in res)


@pytest.mark.parametrize("opt,use_orig", [("sgd", True), ("fs_adamw", False), ("fs_sgd", True)])
def test_parity_other_optimizers_and_use_orig_params(dist_pool, opt, use_orig):
    dist_pool(2).run(run_case, strategy="SHARD_OPTIM", opt=opt, use_orig_params=use_orig,
                     eval_every=True, steps=3)


@pytest.mark.parametrize("no_sync", [True, False])
def test_gradient_accumulation(dist_pool, no_sync):
    dist_pool(4).run(run_case, strategy="SHARD_OPTIM", opt="sgd", microbatches=3,
                     no_sync=no_sync, model_kw={"nested": True}, wrap="nested", steps=2)


def test_clip_grad_norm(dist_pool):
    # run_case checks the returned norm against torch's and the clipped training.
    dist_pool(2).run(run_case, strategy="SHARD_OPTIM", opt="sgd", clip=0.05, steps=3)


def _train_and_state_dict(strategy):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = build()
    fs = FSDP(build(), sharding_strategy=ShardingStrategy[strategy],
              auto_wrap_policy=policy("blocks"))
    o_fs, o_ref = optimizer("adamw", fs.parameters()), optimizer("adamw", ref.parameters())
    for x, y in batches(3, 2, world):
        ((fs(x[2 * rank:2 * rank + 2]) - y[2 * rank:2 * rank + 2]) ** 2).mean().backward()
        ((ref(x) - y) ** 2).mean().backward()
        for o in (o_fs, o_ref):
            o.step()
            o.zero_grad()
    sd, want = fs.state_dict(), ref.state_dict()
    assert list(sd) == list(want)
    for k in want:
        scale = want[k].abs().max().item() if want[k].numel() else 0.0
        torch.testing.assert_close(sd[k], want[k], rtol=2e-6, atol=1e-7 + 2e-6 * scale)
    # and the whole parameters the modules use right now are the same values
    inner = fs.module.blocks[0].module.ff.lin.weight
    torch.testing.assert_close(inner, ref.blocks[0].ff.lin.weight, rtol=2e-6, atol=1e-6)
    # optimizer state dict: the full state of every parameter, as torch's
    osd = FSDP.optim_state_dict(fs, o_fs)
    ref_state = o_ref.state_dict()["state"]
    names = [n for n, _ in ref.named_parameters()]
    for i, n in enumerate(names):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(osd["state"][n][key], ref_state[i][key],
                                       rtol=1e-5, atol=1e-7)
    # loading a state dict refreshes the whole parameters the forward uses
    fresh = build(seed=3)
    fs.load_state_dict(fresh.state_dict())
    x = torch.randn(2, 5)
    torch.testing.assert_close(fs(x), fresh(x), rtol=1e-6, atol=1e-6)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_full_state_dict_and_optim_state_dict(dist_pool, world):
    assert all(dist_pool(world).run(_train_and_state_dict, "SHARD_OPTIM"))


def _memory(strategy):
    rank, world = dist.get_rank(), dist.get_world_size()
    fs = FSDP(build(d=16), sharding_strategy=ShardingStrategy[strategy])
    opt = torch.optim.AdamW(fs.parameters(), lr=1e-3)
    x = torch.randn(2, 5)
    fs(x).sum().backward()
    opt.step()
    g = fs._unit.groups[0]
    return {"stats": flatshard.memory_stats(fs, opt), "shard_bytes": g.shard.numel() * 4,
            "padded_bytes": g.padded_numel * 4, "world": world}


def test_memory_is_whole_params_and_grads_plus_sharded_optimizer_state(dist_pool):
    res = dist_pool(4).run(_memory, "SHARD_OPTIM")
    ddp = dist_pool(4).run(_memory, "NO_SHARD")
    for r, d in zip(res, ddp):
        s, shard, padded = r["stats"], r["shard_bytes"], r["padded_bytes"]
        assert s["unsharded"] == padded  # whole parameters, kept between steps
        assert s["params"] == shard      # the fp32 master shard the optimizer updates
        assert s["grads"] == padded      # whole gradient (the shard's is a view of it)
        step_bytes = 4                   # AdamW's scalar step tensor
        assert s["optim"] == 2 * shard + step_bytes
        assert shard * r["world"] == padded
        # DDP (NO_SHARD) holds the moments of every parameter: world times more
        assert d["stats"]["optim"] == 2 * d["shard_bytes"] + step_bytes
        assert d["stats"]["grads"] == d["shard_bytes"]


def _mixed_precision_against_torch(param_dtype, reduce_dtype, steps=4):
    """ZeRO-1 against torch FSDP's SHARD_GRAD_OP with the same MixedPrecision:
    the same arithmetic (gradients averaged in reduce_dtype, fp32 master
    updated, cast to param_dtype); only where the parameters live differs."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy as TS
    mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                        buffer_dtype=param_dtype)
    kw = dict(auto_wrap_policy=policy("blocks"), mixed_precision=mp,
              device_id=torch.device("cpu"))
    ours = FSDP(build(), sharding_strategy=ShardingStrategy.SHARD_OPTIM, **kw)
    theirs = TorchFSDP(build(), sharding_strategy=TS.SHARD_GRAD_OP, **kw)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(dist.get_rank())
    worst = 0.0
    for _ in range(steps):
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        losses = []
        for m, o in zip((ours, theirs), opts):
            out = m(x)
            assert out.dtype == param_dtype
            loss = ((out.float() - y) ** 2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]) / abs(losses[1]))
    a, b = ours.state_dict(), theirs.state_dict()
    pdiff = max(((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()).item()
                for k in b if b[k].numel() and b[k].is_floating_point())
    lp_bytes = sum(u._unit.groups[0].padded_numel for u in ours.modules()
                   if isinstance(u, FSDP)) * torch.finfo(param_dtype).bits // 8
    master = {v.dtype for k, v in a.items() if "scale" not in k}  # (buffers: buffer_dtype)
    return worst, pdiff, master, flatshard.memory_stats(ours), lp_bytes


@pytest.mark.parametrize("param_dtype,reduce_dtype", [(torch.bfloat16, None),
                                                      (torch.float16, torch.float32)])
def test_mixed_precision_matches_torch_fsdp(dist_pool, param_dtype, reduce_dtype):
    for worst, pdiff, dtypes, stats, lp_bytes in dist_pool(2).run(
            _mixed_precision_against_torch, param_dtype, reduce_dtype):
        assert worst <= 1e-6 and pdiff <= 1e-6, (worst, pdiff)
        assert dtypes == {torch.float32}  # the master parameters stay fp32
        assert stats["unsharded"] == lp_bytes  # the whole low-precision parameters, kept
