"""torch's contract for the modules fully_shard is given and the classes it
makes (fsdp2/torch_class.py, fsdp2/torch_state.py), on flatshard's
fully_shard and torch's own in the same run (2 ranks):

  slicing a sharded nn.Sequential gives a plain Sequential of the same
  children (no FSDP state), and the sharded model trains on unchanged;
  nn.ModuleList / nn.ModuleDict without a forward of their own are refused
  with a ValueError (a subclass with a forward is not);
  copy.deepcopy of a sharded module and fully_shard applied twice raise an
  AssertionError with torch's text (flatshard's says more, before it);
  the state's _lazy_init() decides the root as torch's does, and
  _modules_to_run_forward is empty outside a forward, as torch's.

Where flatshard does more than torch on purpose (a channels_last parameter
torch refuses): tests/test_fully_shard_torch_checks.py, docs/migrating.md."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from flatshard import ConfigError, FSDPModule, fully_shard
from toy_models import MLP

TIMEOUT = 240
BOTH = (("torch", torch_fully_shard), ("ours", fully_shard))


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 7), nn.Linear(7, 3))


def _sharded(fn):
    m = _net()
    fn(m[0])
    fn(m[2])
    return fn(m)


def _slicing():
    rank = dist.get_rank()
    out = {}
    for name, fn in BOTH:
        base = FSDPModule if name == "ours" else TorchFSDPModule
        m = _sharded(fn)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(5 + rank)
        losses = []
        for step in range(3):
            head = m[:2]  # between steps: the model itself trains on unchanged
            tail = m[1:]
            loss = m(torch.randn(4, 5, generator=g)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[name] = {
            "types": [type(head).__name__, type(tail).__name__, type(m).__name__],
            "plain": [type(x) is nn.Sequential and not isinstance(x, base)
                      for x in (head, tail)],
            "stateless": [fn.state(x) is None for x in (head, tail)],
            "children": [head[0] is m[0], head[1] is m[1], tail[1] is m[2], len(tail) == 3],
            "indexed": [m[0] is head[0], isinstance(m[0], base), isinstance(m, base)],
            "losses": losses,
        }
    return out


def test_slicing_a_sharded_sequential_gives_a_plain_one(dist_pool):
    for res in dist_pool(2).run(_slicing, timeout=TIMEOUT):
        assert res["ours"] == res["torch"]
        assert res["ours"]["types"] == ["Sequential", "Sequential", "FSDPSequential"]
        assert res["ours"]["plain"] == res["ours"]["stateless"] == [True, True]
        assert res["ours"]["children"] == [True] * 4
        assert res["ours"]["indexed"] == [True] * 3


def _outcome(call):
    try:
        call()
        return None
    except Exception as e:  # noqa: BLE001 - the type and text are what is compared
        return type(e), str(e)


class _ListWithForward(nn.ModuleList):
    def forward(self, x):
        for m in self:
            x = m(x)
        return x


def _refusals():
    out = {}
    for name, fn in BOTH:
        cases = {
            "module_list": _outcome(lambda: fn(nn.ModuleList([nn.Linear(3, 3)]))),
            "module_dict": _outcome(lambda: fn(nn.ModuleDict({"a": nn.Linear(3, 3)}))),
            "list_with_forward": _outcome(lambda: fn(_ListWithForward([nn.Linear(3, 3)]))),
        }
        m = _sharded(fn)
        cases["deepcopy"] = _outcome(lambda: copy.deepcopy(m))
        cases["deepcopy_inner"] = _outcome(lambda: copy.deepcopy(m[0]))
        cases["twice"] = _outcome(lambda: fn(m[2]))
        out[name] = cases
    return out


def test_refused_as_torch_refuses(dist_pool):
    res = dist_pool(2).run(_refusals, timeout=TIMEOUT)[0]
    ours, theirs = res["ours"], res["torch"]
    assert ours["list_with_forward"] is None and theirs["list_with_forward"] is None
    for case in ("module_list", "module_dict"):
        (ot, om), (tt, tm) = ours[case], theirs[case]
        assert tt is ValueError and issubclass(ot, ConfigError) and issubclass(ot, ValueError)
        assert tm in om and om.startswith("flatshard: module=")
    for case in ("deepcopy", "deepcopy_inner", "twice"):
        (ot, om), (tt, tm) = ours[case], theirs[case]
        assert tt is AssertionError, case
        assert issubclass(ot, AssertionError) and issubclass(ot, ConfigError), case
        assert om.endswith(tm) or om.endswith(tm[:-1] + ")") or tm.rstrip(".") in om, \
            (case, om, tm)
        assert len(om) > len(tm), case  # flatshard says what to do instead


def _lazy_init():
    out = {}
    for name, fn in BOTH:
        m = _sharded(fn)
        mods = [m[0], m[2], m]
        st = fn.state(m)
        lazy = st._lazy_init

        def to_run(s):
            return s._modules_to_run_forward
        before = [fn.state(x)._is_root for x in mods]
        lazy()
        lazy()  # a no-op once done
        after = [fn.state(x)._is_root for x in mods]
        waiting = [len(to_run(fn.state(x))) for x in mods]
        m(torch.randn(2, 5)).sum().backward()
        out[name] = {"before": before, "after": after, "waiting": waiting,
                     "waiting_after_step": [len(to_run(fn.state(x))) for x in mods],
                     "is_set": isinstance(to_run(st), set)}
    return out


def test_lazy_init_and_modules_to_run_forward_read_as_torchs(dist_pool):
    for res in dist_pool(2).run(_lazy_init, timeout=TIMEOUT):
        assert res["ours"] == res["torch"]
        assert res["ours"]["before"] == [None] * 3
        assert res["ours"]["after"] == [False, False, True]
        assert res["ours"]["waiting"] == res["ours"]["waiting_after_step"] == [0] * 3


def _state_names():
    m = fully_shard(nn.Linear(3, 3))
    return [hasattr(fully_shard.state(m), n) for n in ("_lazy_init", "_modules_to_run_forward")]


def test_the_state_has_torchs_private_names(dist_pool):
    assert dist_pool(2).run(_state_names, timeout=TIMEOUT)[0] == [True, True]


# ----------------------------------------------------------------------
# lazy init refused as torch refuses it (torch's
# test_fully_shard_double_lazy_init, test_fully_shard_multi_module_root)




def _mlps(fn):
    """FSDP(model(0: MLP(FSDP(in_proj), FSDP(out_proj)), 1: MLP))."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), MLP())
    fn(model[0].in_proj)
    fn(model[0].out_proj)
    fn(model)
    return model


def _x():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(2 + dist.get_rank()))


def _double_lazy_init():
    out = {}
    for name, fn in BOTH:
        cases = {}
        model = _mlps(fn)  # torch's test: the submodule's state first, then the root's
        fn.state(model[0].in_proj)._lazy_init()
        cases["lazy_init"] = _outcome(fn.state(model)._lazy_init)
        cases["root_left"] = fn.state(model)._is_root
        model = _mlps(fn)  # the same through forward: a submodule's forward ran first
        model[0].in_proj(_x())
        cases["forward"] = _outcome(lambda: model(_x()))
        model = _mlps(fn)  # the same after the root's first forward: no error
        model(_x()).sum().backward()
        model[0].in_proj(_x()).sum().backward()
        cases["forward_after_root"] = _outcome(lambda: model(_x()).sum().backward())
        model = _mlps(fn)  # unshard() before any forward decides no root
        model[0].in_proj.unshard()
        cases["unshard_is_root"] = fn.state(model[0].in_proj)._is_root
        model[0].in_proj.reshard()
        cases["unshard_first"] = _outcome(lambda: model(_x()).sum().backward())
        out[name] = cases
    return out


def test_double_lazy_init_refused_as_torch_refuses_it(dist_pool):
    from flatshard.errors import RootError
    for res in dist_pool(2).run(_double_lazy_init, timeout=TIMEOUT):
        ours, theirs = res["ours"], res["torch"]
        for case in ("forward_after_root", "unshard_first"):
            assert ours[case] is None and theirs[case] is None, case
        assert ours["unshard_is_root"] is None and theirs["unshard_is_root"] is None
        torch_text = ("FSDP state has already been lazily initialized for 0.in_proj\n"
                      "FSDP requires running forward through the root module first")
        for case in ("lazy_init", "forward"):
            (ot, om), (tt, tm) = ours[case], theirs[case]
            assert tt is RuntimeError and tm == torch_text, case
            assert issubclass(ot, RootError) and issubclass(ot, RuntimeError) and \
                issubclass(ot, ConfigError), case
            assert om.startswith("flatshard: fully_shard module 0.in_proj ") and \
                om.endswith(torch_text), (case, om)
            assert "run the first forward through the root module" in om, om
        assert theirs["root_left"] is True  # torch has set it before it raised
        assert ours["root_left"] is None  # flatshard refuses before it changes anything


def _multi_module_root():
    out = {}
    for name, fn in BOTH:
        cases = {}
        torch.manual_seed(0)
        model = nn.Sequential(MLP(), MLP())
        fn([model[0], model[1]])
        cases["lazy_init"] = _outcome(fn.state(model[0])._lazy_init)
        cases["root_left"] = fn.state(model[0])._is_root
        model = nn.Sequential(MLP(), MLP())
        fn([model[0], model[1]])
        cases["forward"] = _outcome(lambda: model(_x()))
        model = nn.Sequential(MLP(), MLP())  # under a root of its own: one group, no error
        fn([model[0], model[1]])
        fn(model)
        cases["under_a_root"] = _outcome(lambda: model(_x()).sum().backward())
        out[name] = cases
    return out


def test_multi_module_root_refused_as_torch_refuses_it(dist_pool):
    from flatshard.errors import RootError
    for res in dist_pool(2).run(_multi_module_root, timeout=TIMEOUT):
        ours, theirs = res["ours"], res["torch"]
        assert ours["under_a_root"] is None and theirs["under_a_root"] is None
        for case in ("lazy_init", "forward"):
            (ot, om), (tt, tm) = ours[case], theirs[case]
            assert tt is RuntimeError and tm.startswith(
                "FSDP requires a single root module but got (FSDPMLP("), (case, tm)
            assert issubclass(ot, RootError) and issubclass(ot, RuntimeError) and \
                issubclass(ot, ConfigError), case
            assert om.startswith("flatshard: ") and om.endswith(tm), (case, om, tm)
            assert "fully_shard call given 2 modules (FSDPMLP, FSDPMLP)" in om, om
            assert "apply fully_shard to a module holding them all" in om, om
        # (what torch leaves marked after refusing differs between its
        # releases: 2.13 has made the group the root, 2.15 not)
        assert ours["root_left"] is None
