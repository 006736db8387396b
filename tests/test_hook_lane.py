"""fully_shard's hooks in C ([Note: hook lane] in fsdp2/state.py,
csrc/glue/py_hooks.c): the same training with the lane open, with every
hook event in Python (FLATSHARD_C_HOOKS=0) and with torch's own
fully_shard, in one run on 2 ranks: losses and sharded parameters bit for
bit. Each event's Hook counts the calls it ran in C and those it gave to
the Python hook: after the first step (lazy init, the first gathers) the
plain flow runs wholly in C, and each case the lane does not cover goes to
Python and still trains as torch does."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from flatshard import MixedPrecisionPolicy, _C, fully_shard
from flatshard.errors import ConfigError
from flatshard.fsdp2.state import state_of
from test_fully_shard_torch_flows import Block

TIMEOUT = 240
ENV = "FLATSHARD_C_HOOKS"
KINDS = {_C.HOOK_PRE_FORWARD: "pre_forward", _C.HOOK_POST_FORWARD: "post_forward",
         _C.HOOK_PRE_BACKWARD: "pre_backward", _C.HOOK_ARRIVE: "arrive"}


def _net(blocks=3, d=12):
    """Blocks of Linear and LayerNorm (4 parameters each) and a head."""
    torch.manual_seed(0)
    return nn.Sequential(*[Block(d) for _ in range(blocks)], nn.Linear(d, 3))


def _hooks(model):
    """Every flatshard._C.Hook registered for model's blocks."""
    out = []
    for m in model[:-1]:
        st = state_of(m)
        found = list(m._forward_pre_hooks.values()) + list(m._forward_hooks.values()) + \
            [st.pre_backward_hook]
        for p in st.group.unsharded or ():
            found += list(p._post_accumulate_grad_hooks.values())
        out += [h for h in found if isinstance(h, _C.Hook)]
    return out


def _counts(model):
    """{event: [calls in C, calls given to Python]} over model's blocks."""
    tot = {name: [0, 0] for name in KINDS.values()}
    for h in _hooks(model):
        tot[KINDS[h.kind]][0] += h.taken
        tot[KINDS[h.kind]][1] += h.passed
    return tot


def _train(shard, steps, change=None, mp=None):
    """steps of AdamW on _net() sharded block by block; change(model, step)
    before each step (what the lane must notice). -> (losses, local shards,
    counts after step 0, counts at the end)."""
    model = _net()
    kw = {} if mp is None else {"mp_policy": mp}
    for m in model[:-1]:
        shard(m, **kw)
    shard(model)  # (the head computes on the blocks' float32 outputs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(3 + dist.get_rank())
    losses, first = [], None
    for step in range(steps):
        if change is not None:
            change(model, step)
        loss = model(torch.randn(4, 12, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 0 and shard is fully_shard:
            first = _counts(model)
    last = _counts(model) if shard is fully_shard else None
    return losses, [p._local_tensor.detach().clone() for p in model.parameters()], first, last


def _three(steps, change=None, flat_mp=None, torch_mp=None):
    """The lane's run, the all-Python run and torch's, each from the same
    start with the same batches."""
    out = {}
    for name, shard, env, mp in (("lane", fully_shard, None, flat_mp),
                                 ("python", fully_shard, "0", flat_mp),
                                 ("torch", torch_fully_shard, None, torch_mp)):
        if env is not None:
            os.environ[ENV] = env  # read at the root's first forward
        try:
            out[name] = _train(shard, steps, change, mp)
        finally:
            os.environ.pop(ENV, None)
    return out


def _same_as_torch(runs):
    for name in ("lane", "python"):
        losses, params = runs[name][:2]
        assert losses == runs["torch"][0], (name, losses, runs["torch"][0])
        for a, b in zip(params, runs["torch"][1]):
            assert torch.equal(a, b), name


def _plain(steps):
    return _three(steps)


def test_the_plain_flow_runs_in_c_and_trains_as_torch(dist_pool):
    steps = 4
    for runs in dist_pool(2).run(_plain, steps, timeout=TIMEOUT):
        _same_as_torch(runs)
        blocks, params = 3, len(list(Block(1).parameters()))
        first, last = runs["lane"][2], runs["lane"][3]
        # step 0: lazy init and the first gathers (the gradient hooks are put
        # on then) are Python's; the root's pre-backward, each backward's
        # first, queues the end-of-backward callback in Python (the root's
        # hooks are not counted here)
        assert first["pre_forward"] == [0, blocks]
        assert first["post_forward"] == [blocks, 0]
        assert first["pre_backward"] == [blocks, 0]
        assert first["arrive"] == [blocks * params, 0]
        # the later steps: every event of the blocks in C
        assert last["pre_forward"] == [blocks * (steps - 1), blocks]
        assert last["post_forward"] == [blocks * steps, 0]
        assert last["pre_backward"] == [blocks * steps, 0]
        assert last["arrive"] == [blocks * params * steps, 0]
        # FLATSHARD_C_HOOKS=0: nothing but the arrival count in C
        off = runs["python"][3]
        assert off["pre_forward"][0] == off["post_forward"][0] == off["pre_backward"][0] == 0
        # (the last arrival of each group calls the Python post-backward)
        assert off["arrive"] == [(params - 1) * blocks * steps, blocks * steps]


def _freeze_then_thaw(model, step):
    """A frozen parameter (a group with frozen parameters watches its
    inputs, in Python) in steps 1 and 2, trainable again in step 3."""
    model[1].norm.bias.requires_grad_(step not in (1, 2))


def _reassign(model, step):
    """New shards assigned into the modules between steps (what
    load_state_dict(assign=True) does): the gather adopts them."""
    if step == 2:
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.load_state_dict(sd, assign=True)


def _prefetch_lists(model, step):
    """Explicit prefetch lists from step 1 (the lane leaves them to Python)."""
    if step == 1:
        blocks = list(model[:-1])
        blocks[0].set_modules_to_forward_prefetch([blocks[1]])
        blocks[2].set_modules_to_backward_prefetch([blocks[1]])


def _profiled(model, step):
    """A profiler on in step 2: the hooks record torch's ranges, in Python."""
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


# each case, and the event whose Python hook it must reach more often than
# the plain flow does (step 0's pre-forwards: 3; nothing else)
CASES = {"freeze": (_freeze_then_thaw, "pre_forward"), "reassign": (_reassign, "pre_forward"),
         "prefetch": (_prefetch_lists, "pre_forward"), "profiler": (_profiled, "post_forward"),
         "reshard_after_forward": (_no_reshard, "post_forward"), "no_sync": (_no_sync, "arrive")}
PLAIN_PASSED = {"pre_forward": 3, "post_forward": 0, "pre_backward": 0, "arrive": 0}


def _case(name, steps):
    return _three(steps, CASES[name][0])


@pytest.mark.parametrize("name", sorted(CASES))
def test_what_the_lane_leaves_to_python_trains_as_torch(dist_pool, name):
    steps = 4
    for runs in dist_pool(2).run(_case, name, steps, timeout=TIMEOUT):
        _same_as_torch(runs)
        event = CASES[name][1]
        last = runs["lane"][3]
        assert last[event][1] > PLAIN_PASSED[event], last


def _mixed(steps):
    flat = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    theirs = TorchMP(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    return _three(steps, flat_mp=flat, torch_mp=theirs)


def test_an_output_cast_closes_the_lane(dist_pool):
    """mixed precision with an output dtype: the forward hooks cast in
    Python; the lane stays closed, and bf16 trains bit-equal to torch."""
    steps = 3
    for runs in dist_pool(2).run(_mixed, steps, timeout=TIMEOUT):
        _same_as_torch(runs)
        last = runs["lane"][3]
        assert last["pre_forward"][0] == last["post_forward"][0] == 0


def test_a_bad_switch_is_refused_naming_it(monkeypatch):
    from flatshard import envvars
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ConfigError, match=ENV):
        envvars.read_flag(ENV, True)


def test_hook_arguments_are_checked():
    with pytest.raises(ValueError, match="kind"):
        _C.Hook(99, {}, None, print)
    with pytest.raises(TypeError, match="fallback"):
        _C.Hook(_C.HOOK_PRE_FORWARD, {}, None, 3)
    with pytest.raises(TypeError, match="index"):
        _C.Hook(_C.HOOK_ARRIVE, {}, None, print)
    # a hook whose lane is closed calls its Python hook with the same arguments
    seen = []
    h = _C.Hook(_C.HOOK_PRE_FORWARD, {"c_hooks": False}, None, lambda *a: seen.append(a))
    h("module", ("x",), {"k": 1})
    assert seen == [("module", ("x",), {"k": 1})] and (h.taken, h.passed) == (0, 1)
