"""Mixed precision against torch's own FSDP with the same MixedPrecision:
same losses and parameters step by step (flatshard casts the fp32 master shard
to param_dtype in one C pass, gathers in param_dtype, reduces in reduce_dtype
and accumulates into fp32 shards, as torch does). Tolerance: 1e-6 relative
(in practice the two agree to the bit)."""
import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard import FSDP, NotBuiltError, ConfigError, ShardingStrategy
from toy_models import Block, build

TOL = 1e-6


def _against_torch(param_dtype, reduce_dtype, strategy, use_orig, steps=4):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision, ShardingStrategy as TS
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    mp = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                        buffer_dtype=param_dtype)
    kw = dict(auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp,
              device_id=torch.device("cpu"), use_orig_params=use_orig)
    ours = FSDP(build(), sharding_strategy=ShardingStrategy[strategy], **kw)
    theirs = TorchFSDP(build(), sharding_strategy=TS[strategy], **kw)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(dist.get_rank())
    worst, dtypes = 0.0, set()
    for _ in range(steps):
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        losses = []
        for m, o in zip((ours, theirs), opts):
            out = m(x)
            dtypes.add(out.dtype)
            loss = ((out.float() - y) ** 2).mean()
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]) / abs(losses[1]))
    live = flatshard.memory_stats(ours)["unsharded"]
    a, b = ours.state_dict(), theirs.state_dict()
    pdiff = max(((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()).item()
                for k in b if b[k].numel() and b[k].is_floating_point())
    master = {v.dtype for k, v in a.items() if "scale" not in k}
    return worst, pdiff, live, sorted(map(str, dtypes)), sorted(map(str, master))


@pytest.mark.parametrize("param_dtype,reduce_dtype", [
    (torch.bfloat16, None), (torch.bfloat16, torch.float32), (torch.float16, None),
    (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_mixed_precision_matches_torch_fsdp(dist_pool, param_dtype, reduce_dtype, strategy):
    for worst, pdiff, live, out_dtypes, master in dist_pool(2).run(
            _against_torch, param_dtype, reduce_dtype, strategy, False):
        assert worst <= TOL and pdiff <= TOL, (worst, pdiff)
        assert live == 0  # low-precision gathered buffers freed too
        assert out_dtypes == [str(param_dtype)]  # forward ran in param_dtype
        assert master == ["torch.float32"]  # the master parameters stay fp32


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_mixed_precision_other_world_sizes_and_orig_params(dist_pool, world, strategy):
    for worst, pdiff, *_ in dist_pool(world).run(_against_torch, torch.bfloat16, torch.float32,
                                                 strategy, True):
        assert worst <= TOL and pdiff <= TOL, (worst, pdiff)


def _refusals():
    from torch.distributed.fsdp import MixedPrecision
    out = []
    for kw, exc in [
        (dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                             keep_low_precision_grads=True)), NotBuiltError),
        (dict(mixed_precision=flatshard.MixedPrecision(param_dtype=torch.int8)), ConfigError),
    ]:
        try:
            FSDP(build(), **kw)
            out.append("no error")
        except exc as e:
            out.append(str(e))
    return out


def test_mixed_precision_refusals_name_the_option(dist_pool):
    msgs = dist_pool(2).run(_refusals)[0]
    assert "keep_low_precision_grads" in msgs[0] and "param_dtype" in msgs[1]


def _grad_scaler_skips_everywhere():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    model = FSDP(build(), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                 mixed_precision=flatshard.MixedPrecision(param_dtype=torch.float16,
                                                          buffer_dtype=torch.float16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(dist.get_rank())
    seen = []
    for step in range(3):
        x = torch.randn(2, 5, generator=g)
        if step == 1 and dist.get_rank() == 1:
            x[0, 0] = float("inf")  # an overflow on one rank only
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(model(x).float().pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
        seen.append((changed, scaler.get_scale()))
    return seen


def test_torch_sharded_grad_scaler_skips_the_step_on_every_rank(dist_pool):
    # torch's own ShardedGradScaler works unchanged on flatshard's fp16 shards:
    # an overflow on rank 1 makes both ranks skip the step and halve the scale.
    for seen in dist_pool(2).run(_grad_scaler_skips_everywhere):
        assert seen == [(True, 1024.0), (False, 512.0), (True, 512.0)]


def _fp16_no_shard(steps=3):
    """fp16 parameters (no MixedPrecision) under NO_SHARD: the gradient is
    divided by the world size once (before the sum, where fp16 could
    overflow), as torch FSDP does."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TS
    ours = FSDP(build().half(), sharding_strategy=ShardingStrategy.NO_SHARD)
    theirs = TorchFSDP(build().half(), sharding_strategy=TS.NO_SHARD,
                       device_id=torch.device("cpu"))
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (ours, theirs)]
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(4, 5, generator=g).half()
        for m, o in zip((ours, theirs), opts):
            m(x).float().pow(2).mean().backward()
            o.step()
            o.zero_grad()
    a, b = ours.state_dict(), theirs.state_dict()
    return max(((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()).item()
               for k in b if b[k].numel() and b[k].is_floating_point())


def test_fp16_parameters_under_no_shard_match_torch_fsdp(dist_pool):
    for pdiff in dist_pool(2).run(_fp16_no_shard):
        assert pdiff <= 1e-3, pdiff  # fp16 rounding of the order of the sums
