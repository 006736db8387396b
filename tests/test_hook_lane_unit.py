"""The FSDP1 wrapper's hooks in C ([Note: unit hook lane] in fsdp/unit.py,
csrc/glue/py_hooks_unit.c): the same training with the lane open, with
every hook event in Python (FLATSHARD_C_HOOKS=0) and with torch's own FSDP1,
in one run on 2 ranks, for both use_orig_params settings and the three
backward prefetch choices: losses and full parameters bit for bit. Each
unit's Hooks count the calls they ran in C and those they gave to Python:
every event of the inner units runs in C; BACKWARD_POST keeps them in
Python."""
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import BackwardPrefetch as TorchBP
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

from flatshard import BackwardPrefetch, FullyShardedDataParallel, ModuleWrapPolicy, _C
from flatshard.fsdp.unit import fsdp_units
from test_hook_lane import _net
from test_fully_shard_torch_flows import Block

TIMEOUT = 240
ENV = "FLATSHARD_C_HOOKS"
KINDS = {_C.HOOK_UNIT_PRE_FORWARD: "pre_forward", _C.HOOK_UNIT_POST_FORWARD: "post_forward",
         _C.HOOK_UNIT_PRE_BACKWARD: "pre_backward", _C.HOOK_UNIT_POST_BACKWARD: "post_backward"}


def _counts(model):
    """{event: [calls in C, calls given to Python]} over the inner units."""
    tot = {name: [0, 0] for name in KINDS.values()}
    for m in fsdp_units(model)[1:]:  # the root's steps are Python's by design
        u = m._unit
        found = [m.__dict__["_pre_forward"], m.__dict__["_post_forward"], u.pre_backward_hook]
        for g in u.groups:
            found += list(g.compute._post_accumulate_grad_hooks.values())
        for h in found:
            tot[KINDS[h.kind]][0] += h.taken
            tot[KINDS[h.kind]][1] += h.passed
    return tot


def _train(wrap, steps, orig, prefetch):
    model = wrap(_net(), orig, prefetch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(3 + dist.get_rank())
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 12, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    counts = _counts(model) if isinstance(model, FullyShardedDataParallel) else None
    with type(model).summon_full_params(model):
        params = [p.detach().clone() for p in model.parameters()]
    return losses, params, counts


def _ours(model, orig, prefetch):
    bp = None if prefetch is None else getattr(BackwardPrefetch, prefetch)
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                                    use_orig_params=orig, backward_prefetch=bp)


def _torchs(model, orig, prefetch):
    bp = None if prefetch is None else getattr(TorchBP, prefetch)
    return TorchFSDP(model, auto_wrap_policy=TorchPolicy({Block}), use_orig_params=orig,
                     backward_prefetch=bp, device_id=torch.device("cpu"))


def _three(steps, orig, prefetch):
    out = {}
    for name, wrap, env in (("lane", _ours, None), ("python", _ours, "0"),
                            ("torch", _torchs, None)):
        if env is not None:
            os.environ[ENV] = env  # read at the root's first forward
        try:
            out[name] = _train(wrap, steps, orig, prefetch)
        finally:
            os.environ.pop(ENV, None)
    return out


@pytest.mark.parametrize("orig", [False, True])
@pytest.mark.parametrize("prefetch", ["BACKWARD_PRE", "BACKWARD_POST", None])
def test_units_run_in_c_and_train_as_torch(dist_pool, orig, prefetch):
    steps = 3
    for runs in dist_pool(2).run(_three, steps, orig, prefetch, timeout=TIMEOUT):
        for name in ("lane", "python"):
            assert runs[name][0] == runs["torch"][0], (name, runs[name][0], runs["torch"][0])
            for a, b in zip(runs[name][1], runs["torch"][1]):
                assert torch.equal(a, b), name
        blocks = 3
        lane, off = runs["lane"][2], runs["python"][2]
        if prefetch == "BACKWARD_POST":  # its prefetch is Python's: the lane stays closed
            assert all(v[0] == 0 for v in lane.values()), lane
        else:
            # lazy init is the root's, before the blocks run; the root's
            # pre-backward (the head is its own) runs first in each
            # backward and queues its callback, in Python
            assert lane["pre_forward"] == [blocks * steps, 0]
            assert lane["post_forward"] == [blocks * steps, 0]
            assert lane["pre_backward"] == [blocks * steps, 0]
            assert lane["post_backward"] == [blocks * steps, 0]
        assert all(v[0] == 0 for v in off.values()), off
