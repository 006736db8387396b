"""fully_shard's events, each with one implementation ([Note: lean events]
in fsdp2/state.py): the same training with lean events, with every event
through its *_full method and with torch's own fully_shard, in one run on 2
ranks: losses and sharded parameters bit for bit. The *_full methods are
counted per event: after the first step (lazy init, the first gathers) the
plain flow never needs them in the blocks, and each case that needs what a
lean event skips reaches them and still trains as torch does."""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from flatshard import MixedPrecisionPolicy, fully_shard
from flatshard.fsdp2.state import FSDPState, state_of
from test_fully_shard_torch_flows import Block

TIMEOUT = 240
EVENTS = {"pre_forward": "_pre_forward_full", "post_forward": "_post_forward_full",
          "pre_backward": "_pre_backward_full", "post_backward": "_post_backward_full"}


def _net(blocks=3, d=12):
    """Blocks of Linear and LayerNorm (4 parameters each) and a head."""
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d) for _ in range(blocks)], nn.Linear(d, 3))


@contextlib.contextmanager
def _counting(lean=True):
    """Counts of each *_full method's calls, per state: {event: {id: n}}.
    lean False: every state's events take the *_full path (lean never set)."""
    counts = {e: {} for e in EVENTS}
    saved = {name: getattr(FSDPState, name) for name in EVENTS.values()}
    saved["_decide_lean"] = FSDPState._decide_lean

    def counted(event, fn):
        def call(self, *args):
            counts[event][id(self)] = counts[event].get(id(self), 0) + 1
            return fn(self, *args)
        return call
    for event, name in EVENTS.items():
        setattr(FSDPState, name, counted(event, saved[name]))
    if not lean:
        FSDPState._decide_lean = lambda self: None
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(FSDPState, name, fn)


def _blocks_full(counts, model):
    """{event: calls of its *_full method in the blocks' states}."""
    ids = [id(state_of(m)) for m in model[:-1]]
    return {e: sum(c.get(i, 0) for i in ids) for e, c in counts.items()}


def _train(shard, steps, change=None, mp=None, lean=True):
    """steps of AdamW on _net() sharded block by block; change(model, step)
    before each step. -> (losses, local shards, the blocks' *_full calls in
    step 0, in the later steps)."""
    model = _net()
    kw = {} if mp is None else {"mp_policy": mp}
    for m in model[:-1]:
        shard(m, **kw)
    shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(3 + dist.get_rank())
    losses, first = [], None
    with _counting(lean) as counts:
        for step in range(steps):
            if change is not None:
                change(model, step)
            loss = model(torch.randn(4, 12, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step == 0 and shard is fully_shard:
                first = _blocks_full(counts, model)
    later = None
    if shard is fully_shard:
        total = _blocks_full(counts, model)
        later = {e: total[e] - first[e] for e in total}
    return losses, [p._local_tensor.detach().clone() for p in model.parameters()], first, later


def _three(steps, change=None, flat_mp=None, torch_mp=None):
    """The lean run, the all-*_full run and torch's, each from the same
    start with the same batches."""
    return {"lean": _train(fully_shard, steps, change, flat_mp),
            "full": _train(fully_shard, steps, change, flat_mp, lean=False),
            "torch": _train(torch_fully_shard, steps, change, torch_mp)}


def _same_as_torch(runs):
    for name in ("lean", "full"):
        losses, params = runs[name][:2]
        assert losses == runs["torch"][0], (name, losses, runs["torch"][0])
        for a, b in zip(params, runs["torch"][1]):
            assert torch.equal(a, b), name


def test_the_plain_flow_is_lean_and_trains_as_torch(dist_pool):
    steps = 4
    for runs in dist_pool(2).run(_three, steps, timeout=TIMEOUT):
        _same_as_torch(runs)
        blocks = 3
        first, later = runs["lean"][2], runs["lean"][3]
        # step 0: the blocks' first pre-forwards run lazy init's tree (lean is
        # decided by the root's lazy init, which runs before them: only the
        # root's own events are full then)
        assert first == {e: 0 for e in EVENTS}, first
        assert later == {e: 0 for e in EVENTS}, later
        # with lean events off every event of every block is the full one
        full = runs["full"][3]
        assert full == {e: blocks * (steps - 1) for e in EVENTS}, full


def _freeze_then_thaw(model, step):
    """A frozen parameter in steps 1 and 2 (its group holds the reshard
    after backward until backward reaches the forward's inputs), trainable
    again in step 3."""
    model[1].norm.bias.requires_grad_(step not in (1, 2))


def _reassign(model, step):
    """New shards assigned into the modules between steps (what
    load_state_dict(assign=True) does): the gather adopts them."""
    if step == 2:
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(sd, assign=True)


def _prefetch_lists(model, step):
    """Explicit prefetch lists from step 1."""
    if step == 1:
        blocks = list(model[:-1])
        blocks[0].set_modules_to_forward_prefetch([blocks[1]])
        blocks[2].set_modules_to_backward_prefetch([blocks[1]])


def _profiled(model, step):
    """A profiler on in step 2: the events record torch's ranges."""
    if step == 2:
        _profiled.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        _profiled.prof.__enter__()
    elif step == 3:
        _profiled.prof.__exit__(None, None, None)
        names = {e.name for e in _profiled.prof.events()}
        assert any(n.startswith("FSDP::pre_forward") for n in names), sorted(names)[:20]


def _no_reshard(model, step):
    """reshard_after_forward False on one block from step 1."""
    if step == 1:
        model[1].set_reshard_after_forward(False)


def _no_sync(model, step):
    """Gradient sync off in step 1 (accumulated), on again after."""
    model.set_requires_gradient_sync(step != 1)


# each case, and the events that must take their full path after step 0
# (the plain flow: none); what the lean path handles itself (a frozen or
# reassigned parameter: the gather's own sync_registered) needs none but the
# frozen parameter's held reshard at post-backward
CASES = {"freeze": (_freeze_then_thaw, {"post_backward"}),
         "reassign": (_reassign, set()),
         "prefetch": (_prefetch_lists, {"pre_forward", "pre_backward"}),
         "profiler": (_profiled, set(EVENTS)),
         "reshard_after_forward": (_no_reshard, {"post_forward"}),
         "no_sync": (_no_sync, {"post_backward"})}


def _case(name, steps):
    return _three(steps, CASES[name][0])


@pytest.mark.parametrize("name", sorted(CASES))
def test_what_a_lean_event_skips_is_done_and_trains_as_torch(dist_pool, name):
    steps = 4
    for runs in dist_pool(2).run(_case, name, steps, timeout=TIMEOUT):
        _same_as_torch(runs)
        later = runs["lean"][3]
        want = CASES[name][1]
        assert {e for e, n in later.items() if n} == want, later


def _mixed(steps):
    flat = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    theirs = TorchMP(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    return _three(steps, flat_mp=flat, torch_mp=theirs)


def test_an_output_cast_is_never_lean(dist_pool):
    """mixed precision with an output dtype: the forward events cast, so
    the states are not lean; bf16 trains bit-equal to torch."""
    steps = 3
    for runs in dist_pool(2).run(_mixed, steps, timeout=TIMEOUT):
        _same_as_torch(runs)
        later = runs["lean"][3]
        assert later == {e: 3 * (steps - 1) for e in EVENTS}, later
