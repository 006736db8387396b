"""End to end: flatshard on 1, 2 and 4 gloo ranks against plain torch in one
process on the whole batch (tolerance in parity.py)."""
import itertools

import pytest

from parity import run_case

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy,opt,use_orig",
                         list(itertools.product(STRATEGIES, ["sgd", "adamw"], [False, True])))
def test_parity_with_plain_torch(dist_pool, world, strategy, opt, use_orig):
    res = dist_pool(world).run(run_case, strategy=strategy, opt=opt, use_orig_params=use_orig)
    for r in res:
        assert r["n_params"] > 0 and r["states"] == ["IDLE"] * len(r["states"])
    assert res[0]["units"] == ["<root>", "blocks.0", "blocks.1", "blocks.2"]


@pytest.mark.parametrize("backend", ["torch", "shm"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_parity_on_each_backend(dist_pool, backend, strategy):
    res = dist_pool(4).run(run_case, strategy=strategy, opt="sgd", comm_backend=backend,
                           model_kw={"nested": True}, wrap="nested")
    assert res[0]["backend"] == backend
