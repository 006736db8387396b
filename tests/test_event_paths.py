"""fully_shard's events, each one sequence ([Note: one sequence per event]
in fsdp2/state.py): the same training with the C plain path, with every
event through its Python method (no plain flags handed) and with torch's own
fully_shard, in one run on 2 ranks: losses and sharded parameters bit for
bit. The Python methods are counted per event: after the first step (lazy
init, the first gathers) the plain flow never runs a Python frame in the
blocks' events, and each case that the plain path leaves to Python reaches
them and still trains as torch does."""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from flatshard import MixedPrecisionPolicy, fully_shard
from flatshard.fsdp2 import root as roots
from flatshard.fsdp2.state import FSDPState, state_of
from test_fully_shard_torch_flows import Block

TIMEOUT = 240
# each event's Python frames: the steps that need Python of its sequence
# (C's, [Note: one sequence per event])
EVENTS = {"pre_forward": ("_begin_forward", "_gather_forward", "_watch_forward",
                          "_prefetch_forward"),
          "post_forward": ("_reshard_post_forward", "_end_forward", "_take_watching",
                           "_cast_output"),
          "pre_backward": ("_gather_backward", "_prefetch_backward"),
          "post_backward": ("_accumulate_grads", "_reduce_grads", "_reshard_after_backward",
                            "_keep_unsynced")}


def _net(blocks=3, d=12):
    """Blocks of Linear and LayerNorm (4 parameters each) and a head."""
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d) for _ in range(blocks)], nn.Linear(d, 3))


@contextlib.contextmanager
def _counting(plain=True):
    """Counts of each event's Python frames, per state: {event: {id: n}}.
    Entered before the states are made (their C hooks hold the methods they
    call). plain False: no state is lean (root.decide_plain hands nothing):
    the forward's begin, the gathers, the reduction and the reshard after
    backward are Python's steps."""
    counts = {e: {} for e in EVENTS}
    saved = {name: getattr(FSDPState, name) for names in EVENTS.values() for name in names}
    decide_plain = roots.decide_plain

    def counted(event, fn):
        def call(self, *args):
            counts[event][id(self)] = counts[event].get(id(self), 0) + 1
            return fn(self, *args)
        return call
    for event, names in EVENTS.items():
        for name in names:
            setattr(FSDPState, name, counted(event, saved[name]))
    if not plain:
        roots.decide_plain = lambda root: None
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(FSDPState, name, fn)
        roots.decide_plain = decide_plain


def _blocks_python(counts, model):
    """{event: calls of its Python method in the blocks' states}."""
    ids = [id(state_of(m)) for m in model[:-1]]
    return {e: sum(c.get(i, 0) for i in ids) for e, c in counts.items()}


def _train(shard, steps, change=None, mp=None, plain=True):
    """steps of AdamW on _net() sharded block by block; change(model, step)
    before each step. -> (losses, local shards, the blocks' Python event
    calls in step 0, in the later steps)."""
    model = _net()
    kw = {} if mp is None else {"mp_policy": mp}
    losses, first = [], None
    with _counting(plain) as counts:
        for m in model[:-1]:
            shard(m, **kw)
        shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        g = torch.Generator().manual_seed(3 + dist.get_rank())
        for step in range(steps):
            if change is not None:
                change(model, step)
            loss = model(torch.randn(4, 12, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step == 0 and shard is fully_shard:
                first = _blocks_python(counts, model)
    later = None
    if shard is fully_shard:
        total = _blocks_python(counts, model)
        later = {e: total[e] - first[e] for e in total}
    return losses, [p._local_tensor.detach().clone() for p in model.parameters()], first, later


def _three(steps, change=None, flat_mp=None, torch_mp=None):
    """The run with the C plain path, the all-Python run and torch's, each
    from the same start with the same batches."""
    return {"plain": _train(fully_shard, steps, change, flat_mp),
            "python": _train(fully_shard, steps, change, flat_mp, plain=False),
            "torch": _train(torch_fully_shard, steps, change, torch_mp)}


def _same_as_torch(runs):
    for name in ("plain", "python"):
        losses, params = runs[name][:2]
        assert losses == runs["torch"][0], (name, losses, runs["torch"][0])
        for a, b in zip(params, runs["torch"][1]):
            assert torch.equal(a, b), name


def test_the_plain_flow_runs_no_python_and_trains_as_torch(dist_pool):
    steps = 4
    for runs in dist_pool(2).run(_three, steps, timeout=TIMEOUT):
        _same_as_torch(runs)
        blocks = 3
        first, later = runs["plain"][2], runs["plain"][3]
        # step 0: each block's first gather makes its unsharded buffer
        # (Python's); the plain flags are handed by the root's lazy init,
        # which runs before them, so nothing else of the blocks is Python's
        assert first == {e: blocks if e == "pre_forward" else 0 for e in EVENTS}, first
        assert later == {e: 0 for e in EVENTS}, later
        # no state lean: the pre-forward begins (lazy init, the order) and
        # gathers through its Python steps, the pre-backward gathers through
        # its own, the post-backward reduces and reshards through its two;
        # the post-forward's reshard needs none
        full = runs["python"][3]
        per_step = {"pre_forward": 2, "post_forward": 0, "pre_backward": 1, "post_backward": 2}
        assert full == {e: n * blocks * (steps - 1) for e, n in per_step.items()}, full


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


# each case, and the events that run a Python frame after step 0 (the plain
# flow: none): a frozen parameter's forward watches its inputs (its
# pre-forward), the outputs' pre-backward hook is that forward's (the
# post-forward takes it) and the reshard after backward waits for them; a
# reassigned parameter is adopted by Python's gather; a prefetch list is
# Python's; under a profiler the ranges and counts are (the post-forward's
# reshard in its range is C's); reshard_after_forward False leaves the
# post-forward nothing to do
CASES = {"freeze": (_freeze_then_thaw, {"pre_forward", "post_forward", "post_backward"}),
         "reassign": (_reassign, {"pre_forward"}),
         "prefetch": (_prefetch_lists, {"pre_forward", "pre_backward"}),
         "profiler": (_profiled, {"pre_forward", "pre_backward", "post_backward"}),
         "reshard_after_forward": (_no_reshard, set()),
         "no_sync": (_no_sync, {"post_backward"})}


def _case(name, steps):
    return _three(steps, CASES[name][0])


@pytest.mark.parametrize("name", sorted(CASES))
def test_what_the_plain_path_leaves_to_python_trains_as_torch(dist_pool, name):
    steps = 4
    for runs in dist_pool(2).run(_case, name, steps, timeout=TIMEOUT):
        _same_as_torch(runs)
        later = runs["plain"][3]
        want = CASES[name][1]
        assert {e for e, n in later.items() if n} == want, later


def _mixed(steps):
    flat = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    theirs = TorchMP(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    return _three(steps, flat_mp=flat, torch_mp=theirs)


def test_an_output_cast_is_never_plain(dist_pool):
    """mixed precision with an output dtype: the forward events cast, so
    no state is lean: each pre-forward begins and gathers in Python, each
    post-forward casts, the pre-backward gathers in Python and the
    post-backward reduces and reshards in Python; bf16 trains bit-equal to
    torch."""
    steps = 3
    for runs in dist_pool(2).run(_mixed, steps, timeout=TIMEOUT):
        _same_as_torch(runs)
        later = runs["plain"][3]
        per_step = {"pre_forward": 2, "post_forward": 1, "pre_backward": 1, "post_backward": 2}
        assert later == {e: n * 3 * (steps - 1) for e, n in per_step.items()}, later
