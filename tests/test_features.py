"""End to end features against plain torch: uneven sizes, nesting, policies,
no_sync, frozen and tied parameters, buffers, eval/no_grad, repeated forwards,
two backwards a step, reuse of a unit, prefetch options, memory after reshard."""
import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard import FSDP, ShardingStrategy
from parity import run_case
from toy_models import Block, Inner, build


def test_uneven_sizes_on_four_ranks_with_nested_units(dist_pool):
    # Odd holds 1-, 3- and 0-element parameters; 4 ranks: most ranks hold
    # nothing of them, and padding is exercised in every unit.
    res = dist_pool(4).run(run_case, model_kw={"nested": True}, wrap="nested")
    assert res[0]["units"] == ["<root>", "blocks.0", "blocks.0.inner", "blocks.1", "blocks.2",
                               "blocks.2.inner"]


def _units_flatshard_and_torch(wrap):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from parity import policy

    def names(model, cls):
        return sorted((n.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
                       or "<root>") for n, m in model.named_modules() if isinstance(m, cls))
    ours = FSDP(build(nested=True), auto_wrap_policy=policy(wrap))
    theirs = TorchFSDP(build(nested=True), auto_wrap_policy=policy(wrap.replace("fs_", "")),
                       device_id=torch.device("cpu"))
    return names(ours, FSDP), names(theirs, TorchFSDP)


@pytest.mark.parametrize("wrap", ["blocks", "fs_blocks", "nested", "transformer", "custom",
                                  "lambda", "size", "none"])
def test_wrap_policies_pick_the_units_torch_fsdp_picks(dist_pool, wrap):
    ours, theirs = dist_pool(2).run(_units_flatshard_and_torch, wrap)[0]
    assert ours == theirs and len(ours) > (wrap != "none")


@pytest.mark.parametrize("wrap", ["size", "lambda", "fs_custom"])
def test_training_parity_under_other_policies(dist_pool, wrap):
    dist_pool(2).run(run_case, wrap=wrap, model_kw={"nested": True}, steps=2)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@pytest.mark.parametrize("use_orig", [False, True])
def test_no_sync_accumulation(dist_pool, strategy, use_orig):
    dist_pool(2).run(run_case, strategy=strategy, use_orig_params=use_orig, microbatches=3,
                     no_sync=True, opt="sgd")


@pytest.mark.parametrize("use_orig", [False, True])
def test_accumulation_across_backwards_without_no_sync(dist_pool, use_orig):
    dist_pool(2).run(run_case, use_orig_params=use_orig, microbatches=2, opt="sgd")


@pytest.mark.parametrize("use_orig", [False, True])
def test_frozen_parameters_mixed_into_units(dist_pool, use_orig):
    res = dist_pool(2).run(run_case, use_orig_params=use_orig, model_kw={"frozen": True})
    assert res[0]["n_params"] > 0


@pytest.mark.parametrize("use_orig", [False, True])
def test_tied_parameters_inside_one_unit(dist_pool, use_orig):
    dist_pool(2).run(run_case, use_orig_params=use_orig, model_kw={"tied": True})


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_same_unit_twice_in_one_forward(dist_pool, strategy):
    dist_pool(2).run(run_case, strategy=strategy, model_kw={"reuse": True})


@pytest.mark.parametrize("use_orig", [False, True])
def test_several_forwards_before_one_backward(dist_pool, use_orig):
    dist_pool(2).run(run_case, forwards=3, use_orig_params=use_orig)


def _backwards_apart(flow, use_orig):
    """Frozen parameters (toy_models' frozen=True), trained where a unit's
    backward runs twice per step: "two_backwards" (two forwards, then the
    backward of each) or "retain_graph" (two backwards through one graph).
    Each rank trains on the whole batch, so the plain model is the reference."""
    from parity import compare_params
    fs = FSDP(build(frozen=True), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
              use_orig_params=use_orig)
    ref = build(frozen=True)
    opts = [torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
            for m in (fs, ref)]
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        x, x2 = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
        for m, opt in zip((fs, ref), opts):
            loss = m(x).pow(2).mean()
            if flow == "two_backwards":
                loss2 = m(x2).pow(2).mean()
                loss.backward()
                loss2.backward()
            else:
                loss.backward(retain_graph=True)
                loss.backward()
            opt.step()
            opt.zero_grad()
    return compare_params(fs, ref)[1]


@pytest.mark.parametrize("flow", ["two_backwards", "retain_graph"])
@pytest.mark.parametrize("use_orig", [False, True])
def test_frozen_parameters_through_two_backwards_a_step(dist_pool, flow, use_orig):
    """Each unit is gathered again for the second backward (torch's FSDP1
    raises there: a parameter's storage is already freed)."""
    for compared in dist_pool(2).run(_backwards_apart, flow, use_orig):
        assert compared > 0


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_eval_and_no_grad_forwards_between_steps(dist_pool, strategy):
    res = dist_pool(2).run(run_case, strategy=strategy, eval_every=True)
    for r in res:
        assert r["memory"]["unsharded"] == 0 or strategy == "NO_SHARD"


@pytest.mark.parametrize("bp,fp", [("BACKWARD_POST", False), (None, True), ("BACKWARD_PRE", True)])
def test_prefetch_options_keep_results(dist_pool, bp, fp):
    dist_pool(4).run(run_case, backward_prefetch=bp, forward_prefetch=fp)


# ---------------------------------------------------------------------------
# memory after reshard, measured from torch's storages


def _memory_case(strategy, use_orig):
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(depth=4)
    total = sum(p.numel() for p in model.parameters())
    fs = FSDP(model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
              sharding_strategy=ShardingStrategy[strategy], use_orig_params=use_orig)
    opt = torch.optim.AdamW(fs.parameters(), lr=1e-3)
    seen_unsharded = []
    for unit in [m for m in fs.modules() if isinstance(m, FSDP)]:
        unit._fsdp_wrapped_module.register_forward_hook(
            lambda *a: seen_unsharded.append(flatshard.memory_stats(fs)["unsharded"]))
    x = torch.randn(4, 5)
    fs(x).sum().backward()
    opt.step()
    after = flatshard.memory_stats(fs, opt)
    fulls = [g.full.untyped_storage().nbytes() for m in fs.modules() if isinstance(m, FSDP)
             for g in m._unit.groups]
    shards = sum(g.shard_numel for m in fs.modules() if isinstance(m, FSDP)
                 for g in m._unit.groups)
    pieces = sum(e.piece_numel for m in fs.modules() if isinstance(m, FSDP) for g in m._unit.groups
                 for e in g.entries)
    return {"total": total, "after": after, "fulls": fulls, "shards": shards, "pieces": pieces,
            "peak_unsharded": max(seen_unsharded), "world": world}


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("use_orig", [False, True])
def test_live_memory_after_reshard(dist_pool, strategy, use_orig):
    for r in dist_pool(4).run(_memory_case, strategy, use_orig):
        assert all(b == 0 for b in r["fulls"])  # every unsharded storage really freed
        assert r["after"]["unsharded"] == 0
        # Parameters held: this rank's shards only (padding: 16-byte alignment per
        # parameter, so a few elements per parameter at most).
        assert r["after"]["params"] == r["shards"] * 4
        assert r["shards"] <= r["total"] / r["world"] + 4 * 40
        assert r["after"]["grads"] == r["shards"] * 4
        # exp_avg and exp_avg_sq over every real element held (padding too
        # when the optimizer sees the flat shard).
        assert r["after"]["optim"] >= 2 * 4 * (r["pieces"] if use_orig else r["shards"])
        assert r["peak_unsharded"] > 0  # the forward really ran unsharded


class _Branchy(torch.nn.Module):
    """No parameters of its own; blocks[2] runs but its output is dropped."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(7) for _ in range(3))

    def forward(self, x):
        h = self.blocks[0](x)
        self.blocks[2](h)
        return self.blocks[1](h)


def _root_without_params_and_unused_unit(strategy):
    from parity import compare_params
    torch.manual_seed(0)
    model = _Branchy()
    torch.manual_seed(0)
    ref = _Branchy()
    fs = FSDP(model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
              sharding_strategy=ShardingStrategy[strategy])
    opt = torch.optim.SGD(fs.parameters(), lr=0.1, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(2 * world, 7, generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        fs(x[2 * rank:2 * rank + 2]).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    compare_params(fs, ref)
    states = [m._unit.c.state for m in fs.modules() if isinstance(m, FSDP)]
    return states, flatshard.memory_stats(fs)["unsharded"]


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_root_without_parameters_and_unit_without_gradient(dist_pool, strategy):
    for states, live in dist_pool(2).run(_root_without_params_and_unused_unit, strategy):
        assert states == ["IDLE"] * 4
        assert live == 0
