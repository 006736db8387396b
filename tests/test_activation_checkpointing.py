"""torch's activation checkpointing (apply_activation_checkpointing,
checkpoint_wrapper, offload_wrapper) on flatshard-wrapped models, applied
after wrapping (around each unit's module) and before (around the modules
that become units): training matches plain torch (tolerance in parity.py)
and state-dict keys are the plain model's."""
import functools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointWrapper, apply_activation_checkpointing, checkpoint_wrapper, offload_wrapper)

import parity
from flatshard import FSDP, ShardingStrategy
from toy_models import Block, build

WRAPPERS = {"checkpoint": checkpoint_wrapper, "offload": offload_wrapper}


def _after(wrapper):
    class Checkpointed(FSDP):
        """Wrap, then checkpoint every Block inside its unit."""

        def __init__(self, module, **kw):
            super().__init__(module, **kw)
            apply_activation_checkpointing(self, checkpoint_wrapper_fn=WRAPPERS[wrapper],
                                           check_fn=lambda m: isinstance(m, Block))
    return Checkpointed


def _checkpointed_build(wrapper, **kw):
    model = build(**kw)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=WRAPPERS[wrapper],
                                   check_fn=lambda m: isinstance(m, Block))
    return model


def _run(when, wrapper, **kw):
    """parity.run_case with checkpointing applied after wrapping (to the
    flatshard model only), or before (to both models: the reference's
    parameter names then carry the wrapper's prefix too)."""
    saved = parity.FSDP, parity.build
    if when == "after":
        parity.FSDP = _after(wrapper)
    else:
        parity.build = functools.partial(_checkpointed_build, wrapper)
    try:
        res = parity.run_case(**kw)
    finally:
        parity.FSDP, parity.build = saved
    return res


def _count_checkpoint_wrappers():
    return sum(isinstance(m, CheckpointWrapper) for m in _after("checkpoint")(
        build()).modules())


@pytest.mark.parametrize("world", [1, 2, 4])
def test_after_wrapping_matches_plain_torch(dist_pool, world):
    dist_pool(world).run(_run, "after", "checkpoint", strategy="FULL_SHARD", steps=3)
    assert dist_pool(world).run(_count_checkpoint_wrappers)[0] == 3


@pytest.mark.parametrize("when,wrapper,strategy,use_orig", [
    ("after", "checkpoint", "FULL_SHARD", True),
    ("after", "offload", "SHARD_GRAD_OP", False),
    ("after", "checkpoint", "SHARD_OPTIM", False),
    ("before", "checkpoint", "FULL_SHARD", False),
    ("before", "offload", "FULL_SHARD", True),
])
def test_variants_match_plain_torch(dist_pool, when, wrapper, strategy, use_orig):
    dist_pool(2).run(_run, when, wrapper, strategy=strategy, use_orig_params=use_orig, steps=2)


def _state_dict_keys(when):
    rank = dist.get_rank()
    plain = build()
    if when == "after":
        fs = _after("checkpoint")(build(), auto_wrap_policy=parity.policy("blocks"))
    else:
        fs = FSDP(_checkpointed_build("checkpoint"), auto_wrap_policy=parity.policy("blocks"),
                  sharding_strategy=ShardingStrategy.FULL_SHARD)
    x = torch.randn(2, 5) + rank
    fs(x).sum().backward()
    sd = fs.state_dict()
    want = plain.state_dict()
    assert list(sd) == list(want), (list(sd), list(want))
    for k in want:
        torch.testing.assert_close(sd[k], want[k])
    # and a full state dict loads back (into a model that trained on)
    fs.load_state_dict(sd)
    fs(x).sum().backward()
    return True


@pytest.mark.parametrize("when", ["after", "before"])
def test_state_dict_keys_are_the_plain_models(dist_pool, when):
    assert all(dist_pool(2).run(_state_dict_keys, when))
