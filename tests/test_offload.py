"""CPUOffload(offload_params=True) with torch FSDP1's meaning, on CPU devices:
training matches plain torch (tolerance in parity.py), everything stays in
host memory, and torch's rule holds: no gradient accumulation across
backwards outside no_sync()."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffload as TorchCPUOffload

import flatshard
import parity
from flatshard import FSDP, ShardingStrategy
from toy_models import build


class Offloaded(FSDP):
    """FSDP with parameter offload on, so parity.run_case trains it unchanged."""

    def __init__(self, module, **kw):
        super().__init__(module, cpu_offload=TorchCPUOffload(offload_params=True), **kw)


def _run_offloaded(**kw):
    saved = parity.FSDP
    parity.FSDP = Offloaded
    try:
        res = parity.run_case(**kw)
    finally:
        parity.FSDP = saved
    return res


@pytest.mark.parametrize("world", [1, 2, 4])
def test_parity_with_plain_torch(dist_pool, world):
    dist_pool(world).run(_run_offloaded, strategy="FULL_SHARD", opt="fs_adamw", steps=3)


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "SHARD_OPTIM", "NO_SHARD"])
def test_parity_other_strategies_with_no_sync(dist_pool, strategy):
    dist_pool(2).run(_run_offloaded, strategy=strategy, opt="sgd", microbatches=2,
                     no_sync=True, use_orig_params=strategy == "SHARD_GRAD_OP", steps=2)


def _accumulate_outside_no_sync(strategy, use_orig):
    rank = dist.get_rank()
    fs = Offloaded(build(), sharding_strategy=ShardingStrategy[strategy],
                   use_orig_params=use_orig)
    assert all(p.device.type == "cpu" for p in fs.parameters())
    x = torch.randn(2, 5) + rank
    fs(x).sum().backward()
    assert all(p.grad is None or p.grad.device.type == "cpu" for p in fs.parameters())
    try:
        fs(x).sum().backward()
    except flatshard.ConfigError as e:
        return str(e)
    return None


@pytest.mark.parametrize("strategy,use_orig", [("FULL_SHARD", False), ("SHARD_OPTIM", True),
                                               ("NO_SHARD", False)])
def test_accumulation_outside_no_sync_is_refused(dist_pool, strategy, use_orig):
    for msg in dist_pool(2).run(_accumulate_outside_no_sync, strategy, use_orig):
        assert msg is not None and "cpu_offload" in msg and "no_sync()" in msg, msg
        assert "zero_grad" in msg
