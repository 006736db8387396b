"""The memory planner's arithmetic: the ZeRO paper's worked example, the
model-from-meta path, hybrid groups, the activation estimate, ranking under
a device limit, and refusals. (Predicted against measured bytes on real
multi-rank runs: test_plan_measure.py.)"""
import pytest
import torch
import torch.nn as nn

import flatshard
from flatshard import ConfigError, ShardingStrategy
from flatshard.plan import flat_layout, plan, rank
from toy_models import Block, Net

PSI, N = 7.5e9, 64


@pytest.mark.parametrize("strategy,paper_gb", [
    ("NO_SHARD", 120.0), ("SHARD_OPTIM", 31.4), ("SHARD_GRAD_OP", 16.6), ("FULL_SHARD", 1.9)])
def test_zero_paper_worked_example(strategy, paper_gb):
    # Rajbhandari et al. 2019, Figure 1: 7.5B parameters, N=64, K=12, fp16
    # mixed precision; the paper's GB are 1e9 bytes, rounded to 0.1.
    p = plan(params=PSI, world_size=N, strategy=strategy, mixed_precision="fp16",
             optimizer="adam", layout="zero")
    assert p.config["k_bytes"] == 12
    assert round(p.model_states / 1e9, 1) == paper_gb
    # and by the paper's own formula, to the byte
    stage = {"NO_SHARD": 0, "SHARD_OPTIM": 1, "SHARD_GRAD_OP": 2, "FULL_SHARD": 3}[strategy]
    expect = 2 * PSI / (N if stage >= 3 else 1) + 2 * PSI / (N if stage >= 2 else 1) \
        + 12 * PSI / (N if stage >= 1 else 1)
    assert abs(p.model_states - expect) < 4


def test_strategy_accepted_as_enum_or_name():
    by_name = plan(params=1000, world_size=4, strategy="SHARD_OPTIM")
    member = getattr(ShardingStrategy, "SHARD_OPTIM", None)
    if member is not None:
        assert plan(params=1000, world_size=4, strategy=member).model_states == \
            by_name.model_states
    from torch.distributed.fsdp import ShardingStrategy as TorchSS
    a = plan(params=1000, world_size=4, strategy=TorchSS.FULL_SHARD)
    assert a.model_states == plan(params=1000, world_size=4, strategy="FULL_SHARD").model_states


def test_meta_model_plans_like_the_real_one_and_allocates_nothing():
    policy = flatshard.ModuleWrapPolicy({Block})
    with torch.device("meta"):
        meta = Net(nested=True, tied=True, frozen=True)
    torch.manual_seed(0)
    real = Net(nested=True, tied=True, frozen=True)
    for st in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        a = plan(meta, world_size=4, strategy=st, auto_wrap_policy=policy)
        b = plan(real, world_size=4, strategy=st, auto_wrap_policy=policy)
        assert [(ln.key, ln.bytes) for ln in a.lines] == [(ln.key, ln.bytes) for ln in b.lines]
    # counted once though tied; the frozen ones have no gradient or moments
    uniq = {id(p): p for p in real.parameters()}.values()
    assert a.config["params"] == sum(p.numel() for p in uniq)
    trainable = sum(p.numel() for p in uniq if p.requires_grad)
    assert trainable * 4 <= a["grads"] < a["params"]


def test_big_meta_model_costs_nothing():
    with torch.device("meta"):
        big = nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(40)])  # 2.7e9 parameters
    p = plan(big, world_size=8, strategy="FULL_SHARD", mixed_precision=torch.bfloat16,
             auto_wrap_policy=flatshard.ModuleWrapPolicy({nn.Linear}))
    psi = 40 * (8192 * 8192 + 8192)
    assert p.config["params"] == psi
    # each unit: weight and bias aligned to 4 fp32 elements, then split in 8
    shard, padded = flat_layout([8192 * 8192, 8192], 4, 8)
    assert p["params"] == 40 * shard * 4
    assert p["params_gathered"] == 2 * padded * 2   # two bf16 units at once; empty root
    assert p["moments"] == 40 * 2 * shard * 4 and p["optim_steps"] == 40 * 4


def test_hybrid_shards_within_the_group():
    full = plan(params=8e9, world_size=16, strategy="FULL_SHARD")
    hyb = plan(params=8e9, world_size=16, strategy="HYBRID_SHARD", hybrid_group=8)
    fs8 = plan(params=8e9, world_size=8, strategy="FULL_SHARD")
    assert hyb.model_states == fs8.model_states > full.model_states
    assert hyb.comm_bytes > fs8.comm_bytes  # plus the all-reduce across groups


def test_activation_estimate_formula_and_checkpointing():
    kw = dict(params=7e9, world_size=8, layers=32, hidden=4096, heads=32, seq_len=2048,
              batch_size=2, mixed_precision="bf16")
    p = plan(**kw)
    s, b, h, a, L = 2048, 2, 4096, 32, 32
    assert p["activations"] == int(L * s * b * h * (34 + 5 * a * s / h))
    ac = plan(activation_checkpointing=True, **kw)
    assert ac["activations"] == int(L * 2 * s * b * h + s * b * h * (34 + 5 * a * s / h))
    assert "estimate" in next(ln.formula for ln in p.lines if ln.key == "activations")


def test_offload_moves_lines_to_host_and_disk():
    kw = dict(params=1e9, world_size=8, strategy="FULL_SHARD", mixed_precision="bf16",
              comm_backend="nccl")
    base = plan(**kw)
    cpu = plan(offload_optimizer="cpu", **kw)
    assert cpu.total("host") == base["moments"] + base["master"] + base["optim_steps"]
    assert cpu.total("device") == base.total("device") - cpu.total("host")
    par = plan(offload_params=True, **kw)
    assert par.total("host") == base.model_states
    disk = plan(offload_optimizer="disk", disk_chunks=3, disk_chunk_bytes=1 << 20, **kw)
    assert disk.total("disk") == base["moments"]
    assert disk.total("host") == (3 << 20) + base["optim_steps"]  # chunks + step counters


def test_rank_lists_what_fits_fastest_first():
    # Paper accounting with 64 units: DDP 120 GB, ZeRO-1 31.4, ZeRO-2 16.6,
    # ZeRO-3 1.9 (+ two gathered units). A 20 GB device takes ZeRO-2 first:
    # same communication as DDP, less than ZeRO-3, no host traffic.
    r = rank(params=PSI, world_size=N, units=64, mixed_precision="fp16", optimizer="adam",
             layout="zero", device_bytes=20e9)
    for x in r.all:
        assert x.fits == (x.plan.total("device") <= 20e9)
    assert [x.step_s for x in r.fitting] == sorted(x.step_s for x in r.fitting)
    assert r.first.plan.name == "ZeRO-2"
    assert abs(r.first.plan.total("device") - (2 * PSI + 14 * PSI / N)) < 4
    names = {x.plan.name for x in r.fitting}
    assert "DDP" not in names and "ZeRO-1" not in names and "ZeRO-3" in names
    assert "first to fit in" in r.table() and "ZeRO-2" in r.table()
    none = rank(params=PSI, world_size=N, units=64, layout="zero", device_bytes=1e6,
                host_bytes=1e6)
    assert none.first is None and "none" in none.table()


@pytest.mark.parametrize("kw,arg", [
    (dict(params=1e9, strategy="ZERO9"), "strategy"),
    (dict(params=1e9, world_size=6, strategy="HYBRID_SHARD", hybrid_group=4), "hybrid_group"),
    (dict(params=0.5), "params"),
    (dict(), "params"),
    (dict(params=1e9, optimizer="lion"), "optimizer"),
    (dict(params=1e9, mixed_precision="fp8"), "mixed_precision"),
    (dict(params=1e9, offload_optimizer="nvme"), "offload_optimizer"),
    (dict(params=1e9, offload_params=True, offload_optimizer="cpu"), "offload_optimizer"),
    (dict(params=1e9, world_size=0), "world_size"),
    (dict(params=1e9, gather_ahead_bytes=-1), "gather_ahead_bytes"),
])
def test_bad_arguments_are_named(kw, arg):
    with pytest.raises(ConfigError, match=arg):
        plan(**kw)


def test_a_device_keeps_one_reduction_in_flight():
    """On the nccl backend a unit's reduction is deferred while the next
    unit's gradient is made: the unreduced-gradient estimate counts the two
    largest units; on the host backends, the largest one."""
    kw = dict(params=4e6, units=4, world_size=4, strategy="FULL_SHARD", mixed_precision="bf16")
    one = plan(comm_backend="shm", **kw)["grad_unreduced"]
    two = plan(comm_backend="nccl", **kw)["grad_unreduced"]
    assert one > 0 and two == 2 * one  # equal units
    assert plan(comm_backend="nccl", **{**kw, "units": 1})["grad_unreduced"] == 4 * one


def test_units_gathered_ahead_raise_the_gathered_peak():
    """The torch backend gathers units ahead within 1 MiB by default
    (runtime/ahead.py). Equal units of 512 KiB gathered: a unit and the two
    after it that fit, where prefetching alone holds two units; shm gathers
    none ahead."""
    kw = dict(params=2 ** 20, units=8, world_size=4, strategy="FULL_SHARD")
    unit = 4 * 2 ** 20 // 8  # a unit's gathered bytes (fp32, no padding here)
    shm = plan(comm_backend="shm", **kw)["params_gathered"]
    off = plan(comm_backend="torch", gather_ahead_bytes=0, **kw)["params_gathered"]
    assert shm == off
    assert plan(comm_backend="torch", **kw)["params_gathered"] == off + unit
    assert plan(comm_backend="torch", gather_ahead_bytes=3 * unit,
                **kw)["params_gathered"] == off + 2 * unit
    # a budget smaller than a unit gathers none ahead
    assert plan(comm_backend="torch", gather_ahead_bytes=unit - 1,
                **kw)["params_gathered"] == off


def test_kept_unsharded_storage_holds_every_unit_gathered():
    """set_keep_unsharded_storage(True) (torch 2.15's fully_shard): every
    unit's unsharded buffer stays allocated, so the gathered line is their
    sum, not the root and the two largest."""
    with torch.device("meta"):
        m = nn.Sequential(*[nn.Linear(64, 48) for _ in range(5)])
    kw = dict(world_size=4, strategy="FULL_SHARD", mixed_precision=torch.bfloat16,
              auto_wrap_policy=flatshard.ModuleWrapPolicy({nn.Linear}))
    _, padded = flat_layout([64 * 48, 48], 4, 4)
    kept = plan(m, keep_unsharded_storage=True, **kw)
    assert kept["params_gathered"] == 5 * padded * 2  # five bf16 units; empty root
    assert plan(m, **kw)["params_gathered"] == 2 * padded * 2
    assert "kept across reshard" in kept.table(explain=True)
    with pytest.raises(flatshard.ConfigError, match="keep_unsharded_storage"):
        plan(m, keep_unsharded_storage=1, **kw)
