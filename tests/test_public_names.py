"""Every public name of torch.distributed.fsdp, read from the torch installed
at run time, exists in flatshard with a compatible signature, and the names
torch 2.13 added or flatshard lacked until now do what torch's do.

The first part enumerates torch: module-level names of torch.distributed.fsdp
(its __all__ and the other public names it holds), the public methods and
properties of FullyShardedDataParallel, FSDPModule and UnshardHandle,
fully_shard's parameters, the enums' members and the dataclasses' fields. A
torch version that adds one makes these tests fail, naming it, unless it is
in torch_facts.PENDING, the short list of names flatshard does not provide
yet, each reported (an xfail, a PendingTorchName warning) until it does.

The second part runs torch and flatshard side by side on gloo ranks: FSDP1's
older optimizer-state API (full_ / sharded_ / shard_full_ / scatter_full_ /
flatten_sharded_ / rekey_optim_state_dict), check_is_root and fsdp_modules,
register_comm_hook with torch's default hooks, and fully_shard's new
FSDPModule methods, dp_mesh_dims and share_comm_ctx.
"""
import dataclasses
import enum
import inspect
import types
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
import torch.nn as nn

import flatshard
from flatshard import FSDP, ConfigError, torch_facts
from parity import train_steps

TIMEOUT = 300

# ---------------------------------------------------------------------------
# names and signatures, enumerated from torch at run time


def _torch_module_names():
    """Public module-level names of torch.distributed.fsdp: __all__, and any
    other public non-module name it holds (FlatParameter)."""
    names = list(tfsdp.__all__)
    names += [n for n in sorted(vars(tfsdp)) if not n.startswith("_") and n not in names
              and not isinstance(getattr(tfsdp, n), types.ModuleType)]
    return names


def _params(fn):
    return list(inspect.signature(fn).parameters.values())


def _incompatible(theirs, ours, where):
    """Why `ours` cannot be called everywhere `theirs` can (None: it can):
    torch's parameters first, with the same names in the same order and
    kinds, a default wherever torch has one; anything more keyword-only
    with a default. A torch method taking only (*args, **kwargs) forwards
    to nn.Module's: compared with that, unless ours takes the same."""
    tp, op = _params(theirs), _params(ours)
    anything = [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]
    if [p.kind for p in tp if p.name != "self"] == anything:
        if [p.kind for p in op if p.name != "self"] == anything:
            return None
        base = getattr(nn.Module, where.split(".")[-1], None)
        if base is None:
            return f"{where}: torch's takes (*args, **kwargs), flatshard's does not"
        tp = _params(base)
    if [p.name for p in op[:len(tp)]] != [p.name for p in tp]:
        return f"{where}: parameters {[p.name for p in op]}, torch's {[p.name for p in tp]}"
    for t, o in zip(tp, op):
        if t.kind != o.kind and not (t.kind is t.KEYWORD_ONLY and
                                     o.kind is o.POSITIONAL_OR_KEYWORD):
            return f"{where}: {o.name} is {o.kind.description}, torch's {t.kind.description}"
        if t.default is not t.empty and o.default is o.empty:
            return f"{where}: {o.name} has no default, torch's has {t.default!r}"
    for o in op[len(tp):]:
        if o.kind not in (o.KEYWORD_ONLY, o.VAR_KEYWORD) or \
                (o.kind is o.KEYWORD_ONLY and o.default is o.empty):
            return f"{where}: extra parameter {o.name} is not keyword-only with a default"
    return None


def _member_problems(name, theirs, ours):
    """Public methods and properties a torch class defines itself that
    flatshard's class lacks or defines otherwise (static, property...)."""
    out = []
    for attr in sorted(vars(theirs)):
        if attr.startswith("_"):
            continue
        if not hasattr(ours, attr):
            out.append(f"{name}.{attr}: missing")
            continue
        t, o = inspect.getattr_static(theirs, attr), inspect.getattr_static(ours, attr)
        if isinstance(t, (staticmethod, classmethod, property)) and type(t) is not type(o):
            out.append(f"{name}.{attr}: a {type(o).__name__}, torch's is a {type(t).__name__}")
            continue
        if callable(getattr(theirs, attr)) and not isinstance(t, property):
            why = _incompatible(getattr(theirs, attr), getattr(ours, attr), f"{name}.{attr}")
            if why:
                out.append(why)
    return out


# What the installed torch has and flatshard does not provide yet
# (torch_facts.PENDING): left out of the comparisons below, and reported by
# test_pending_names_are_reported, which fails once flatshard provides one
# (then drop it from PENDING). Any other name torch has fails here.
PENDING = torch_facts.pending()
PENDING_MODULE = {n for w, n in PENDING if w == "torch.distributed.fsdp"}
PENDING_METHODS = {f"{w}.{n}: missing" for w, n in PENDING if w == "FSDPModule"}


def test_every_module_level_name_exists():
    missing = [n for n in _torch_module_names() if not hasattr(flatshard, n)]
    assert sorted(set(missing) - PENDING_MODULE) == []


@pytest.mark.parametrize("name", _torch_module_names())
def test_each_name_is_compatible(name):
    if name in PENDING_MODULE:
        pytest.xfail(f"pending: flatshard does not provide torch's {name} yet "
                     "(torch_facts.PENDING)")
    theirs, ours = getattr(tfsdp, name), getattr(flatshard, name)
    if ours is theirs:  # re-exported (fully_shard's policies, FlatParameter, ...)
        return
    if isinstance(theirs, type) and issubclass(theirs, enum.Enum):
        assert [m for m in theirs.__members__ if m not in ours.__members__] == []
        # flatshard's own enums take torch's members too
        return
    if dataclasses.is_dataclass(theirs):
        tf = [f.name for f in dataclasses.fields(theirs) if not f.name.startswith("_")]
        of = [f.name for f in dataclasses.fields(ours)]
        assert of[:len(tf)] == tf
        return
    if isinstance(theirs, type):
        assert isinstance(ours, type)
        assert [p for p in _member_problems(name, theirs, ours) if p not in PENDING_METHODS] == []
        return
    assert callable(ours)
    assert _incompatible(theirs, ours, name) is None


@pytest.mark.parametrize("name", ["FullyShardedDataParallel", "FSDPModule", "UnshardHandle"])
def test_public_methods_of_the_classes(name):
    problems = _member_problems(name, getattr(tfsdp, name), getattr(flatshard, name))
    assert [p for p in problems if p not in PENDING_METHODS] == []


def _still_missing(where, name):
    """Whether flatshard still lacks a PENDING name: a module name or an
    FSDPModule method absent, a MixedPrecisionPolicy field (torch's class
    itself) refused when set, a rule (its own parity tests) listed."""
    if where == "torch.distributed.fsdp":
        return not hasattr(flatshard, name)
    if where == "FSDPModule":
        return not hasattr(flatshard.FSDPModule, name)
    if where == "MixedPrecisionPolicy":
        policy = flatshard.MixedPrecisionPolicy(**{name: lambda p: None})
        try:
            flatshard.fully_shard(nn.Linear(2, 2), mp_policy=policy)
        except flatshard.NotBuiltError as e:
            return f"mp_policy.{name}" in str(e)
        except ConfigError:
            return False
        return False
    return where == "rule"


def test_pending_names_are_reported():
    """torch_facts.PENDING is a short list that shrinks: every entry the
    installed torch has is still missing from flatshard (else drop it there),
    and each is reported here as a warning, naming it, not hidden."""
    assert set(torch_facts.pending()) <= set(torch_facts.PENDING)
    provided = [f"{w}.{n}" for w, n in PENDING if not _still_missing(w, n)]
    assert provided == [], f"flatshard provides these now: drop them from torch_facts.PENDING"
    for where, name in PENDING:
        warnings.warn(f"torch {torch.__version__} has {where}.{name}, which flatshard does "
                      "not provide yet (torch_facts.PENDING)", PendingTorchName)


class PendingTorchName(UserWarning):
    """A torch name flatshard does not provide yet (torch_facts.PENDING)."""


def test_fully_shard_parameters():
    assert _incompatible(tfsdp.fully_shard, flatshard.fully_shard, "fully_shard") is None
    assert [p.name for p in _params(flatshard.fully_shard)] == \
        [p.name for p in _params(tfsdp.fully_shard)]


def test_the_check_finds_what_a_newer_torch_would_add():
    """The comparison itself: a parameter, a method or a default that torch
    has and flatshard lacks is reported."""
    def theirs(model, optim, *, new_flag=False):
        pass

    def ours(model, optim):
        pass

    def ours_no_default(model, optim, *, new_flag):
        pass

    class Theirs:
        def brand_new(self, x):
            pass

    assert "new_flag" in _incompatible(theirs, ours, "f")
    assert "no default" in _incompatible(theirs, ours_no_default, "f")
    assert _member_problems("X", Theirs, object) == ["X.brand_new: missing"]


def test_flat_parameters_are_torchs_flat_parameter_class():
    """torch's class checks `_is_flat_param`: flatshard's flat shards are
    instances, plain parameters are not (no process group needed)."""
    p = nn.Parameter(torch.zeros(3))
    assert not isinstance(p, flatshard.FlatParameter)
    from flatshard.fsdp.flat_param import mark_flat_param
    mark_flat_param(p, ["a.weight"], [torch.Size([3])], [3])
    assert isinstance(p, flatshard.FlatParameter) and isinstance(p, tfsdp.FlatParameter)
    assert p._fqns == ("a.weight",)


# ---------------------------------------------------------------------------
# FSDP1's older optimizer-state API, against torch FSDP1 on the same model


class Blk(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 7)
        self.n = nn.LayerNorm(7)
        self.b = nn.Linear(7, 5)

    def forward(self, x):
        return x + self.b(torch.tanh(self.n(self.a(x))))


def _plain(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(Blk(), Blk(), nn.Linear(5, 3))


def _batches(n, world, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2 * world, 5, generator=g), torch.randn(2 * world, 3, generator=g))
            for _ in range(n)]


def _wrapped(which, use_orig, seed=0, **kw):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    if which == "torch":
        return tfsdp.FullyShardedDataParallel(_plain(seed), auto_wrap_policy=ModuleWrapPolicy(
            {Blk}), use_orig_params=use_orig, device_id=torch.device("cpu"), **kw)
    return FSDP(_plain(seed), auto_wrap_policy=ModuleWrapPolicy({Blk}), use_orig_params=use_orig,
                **kw)


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _close(a, b, what, rtol=1e-5, atol=1e-6):
    if torch.is_tensor(a) or torch.is_tensor(b):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
    else:
        assert a == b, (what, a, b)


def _same_named_dict(ours, theirs, what, values=None):
    """Two optimizer state dicts keyed by names: equal as dicts are (the same
    keys; their order is not compared: torch sorts the names under
    use_orig_params=True, flatshard keeps the optimizer's order), the same
    parameter groups (in order), and values close to `values` (a state keyed
    by names; default theirs)."""
    assert list(ours) == list(theirs), what
    if not ours:
        return
    assert sorted(ours["state"]) == sorted(theirs["state"]), what
    for k, st in (values or theirs["state"]).items():
        assert sorted(ours["state"][k]) == sorted(st), (what, k)  # the same state names
        for n, v in st.items():
            _close(ours["state"][k][n], v, f"{what} {k}.{n}")
    assert ours["param_groups"] == theirs["param_groups"], what


def _reference_state(data):
    """The plain model's AdamW state after `data`, in one process on the
    whole batches: {name: state}."""
    ref = _plain()
    opt = _opt(ref)
    for x, y in data:
        ((ref(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    names = {p: n for n, p in ref.named_parameters()}
    return {names[p]: st for p, st in opt.state.items()}


def _local_chunk(v):
    """This rank's chunk of a ShardedTensor (torch) or DTensor (flatshard)."""
    from torch.distributed.tensor import DTensor
    if isinstance(v, DTensor):
        return v.to_local()
    if hasattr(v, "local_shards"):
        shards = v.local_shards()
        return shards[0].tensor if shards else torch.empty(0, *v.shape[1:], dtype=v.dtype)
    return v


def _legacy_optim_api(use_orig):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return _legacy_optim_api_body(use_orig)


def _legacy_optim_api_body(use_orig):
    world, rank = dist.get_world_size(), dist.get_rank()
    data = _batches(6, world)
    res = {}
    models = {w: _wrapped(w, use_orig) for w in ("torch", "flatshard")}
    opts = {w: _opt(m) for w, m in models.items()}
    straight = {}
    for w in models:
        train_steps(models[w], opts[w], data[:3])
    Cls = {"torch": tfsdp.FullyShardedDataParallel, "flatshard": FSDP}

    # The values: torch's, except that torch FSDP1 with use_orig_params=True
    # on CPU returns wrong moments from its optimizer state dicts (new API
    # and old; its training itself matches the plain model's): there they
    # are checked against the plain optimizer's, which torch's should equal.
    truth = _reference_state(data[:3]) if use_orig else None

    # full_optim_state_dict: rank 0 only (the others {}), or everywhere
    full = {w: Cls[w].full_optim_state_dict(models[w], opts[w]) for w in models}
    _same_named_dict(full["flatshard"], full["torch"], "full_optim_state_dict",
                     truth if rank == 0 else None)
    res["rank1_empty"] = full["flatshard"] == {} if rank == 1 else None
    full0 = {w: Cls[w].full_optim_state_dict(models[w], opts[w], rank0_only=False)
             for w in models}
    _same_named_dict(full0["flatshard"], full0["torch"], "full_optim_state_dict(rank0_only=F)",
                     truth)
    with pytest.warns(FutureWarning, match="optim_state_dict"):
        FSDP.full_optim_state_dict(models["flatshard"], opts["flatshard"])
    # optim_input (deprecated): the same parameters give the same dict
    with pytest.warns(FutureWarning, match="optim_input"):
        again = FSDP.full_optim_state_dict(models["flatshard"], opts["flatshard"],
                                           optim_input=list(models["flatshard"].parameters()),
                                           rank0_only=False)
    _same_named_dict(again, full0["flatshard"], "optim_input")

    # sharded_optim_state_dict: each rank's chunk of every per-element value
    sharded = {w: Cls[w].sharded_optim_state_dict(models[w], opts[w]) for w in models}
    assert sorted(sharded["flatshard"]["state"]) == sorted(sharded["torch"]["state"])
    assert sharded["flatshard"]["param_groups"] == sharded["torch"]["param_groups"]
    for k, st in sharded["torch"]["state"].items():
        for n, v in st.items():
            mine = sharded["flatshard"]["state"][k][n]
            if truth is None:
                _close(_local_chunk(mine), _local_chunk(v), f"sharded {k}.{n}")
            else:  # the chunks of the right values
                _close(mine.full_tensor() if v.dim() else mine, truth[k][n], f"sharded {k}.{n}")

    # rekey: a pure re-keying, the same as torch's on the same input
    plain = _plain()
    ids = tfsdp.FullyShardedDataParallel.rekey_optim_state_dict(
        full0["torch"], tfsdp.OptimStateKeyType.PARAM_ID, plain)
    ours = FSDP.rekey_optim_state_dict(full0["torch"], flatshard.OptimStateKeyType.PARAM_ID,
                                       plain)
    assert list(ours["state"]) == list(ids["state"]) and \
        ours["param_groups"] == ids["param_groups"]
    assert FSDP.rekey_optim_state_dict(ours, tfsdp.OptimStateKeyType.PARAM_ID, plain) is ours
    back = FSDP.rekey_optim_state_dict(ids, tfsdp.OptimStateKeyType.PARAM_NAME, plain)
    back_t = tfsdp.FullyShardedDataParallel.rekey_optim_state_dict(
        ids, tfsdp.OptimStateKeyType.PARAM_NAME, plain)
    assert list(back["state"]) == list(back_t["state"]) and \
        back["param_groups"] == back_t["param_groups"]
    # ... and flatshard's full dict rekeyed loads into the plain model's optimizer
    popt = _opt(plain)
    popt.load_state_dict(FSDP.rekey_optim_state_dict(full0["flatshard"],
                                                     flatshard.OptimStateKeyType.PARAM_ID,
                                                     plain))
    assert len(popt.state) == len(full0["torch"]["state"])

    # loading back: each form into a fresh model and optimizer, then 3 more
    # steps; torch resumes from its own dicts the same way
    for w in models:
        straight[w] = train_steps(models[w], opts[w], data[3:])
    res["straight"] = straight
    for form in ("shard_full", "shard_full_optim", "scatter_full", "flatten_sharded",
                 "rekeyed"):
        losses = {}
        for w in models:
            m = _wrapped(w, use_orig)
            train_steps(m, _opt(m), data[:3])  # the same 3 steps: the parameters as when saved
            o = _opt(m)  # a new optimizer: its state is only what is loaded
            C = Cls[w]
            if form == "shard_full":
                sd = C.shard_full_optim_state_dict(full0[w], m)
            elif form == "shard_full_optim":
                sd = C.shard_full_optim_state_dict(full0[w], m, optim=o)
            elif form == "scatter_full":
                sd = C.scatter_full_optim_state_dict(full[w] if rank == 0 else None, m)
            elif form == "flatten_sharded":
                sd = C.flatten_sharded_optim_state_dict(sharded[w], m, o)
            else:  # via a plain optimizer's dict: to IDs, back to names, then sharded
                plain_ids = C.rekey_optim_state_dict(full0[w], tfsdp.OptimStateKeyType.PARAM_ID,
                                                     _plain())
                named = C.rekey_optim_state_dict(plain_ids, tfsdp.OptimStateKeyType.PARAM_NAME,
                                                 _plain())
                sd = C.shard_full_optim_state_dict(named, m)
            if w == "flatshard":
                assert all(type(k) is int for k in sd["state"]), form
                if not use_orig:  # one flat parameter per unit in both
                    assert list(sd["state"]) == list(res["keys"][form]), form
                    assert [g["params"] for g in sd["param_groups"]] == res["groups"][form]
            else:
                res.setdefault("keys", {})[form] = list(sd["state"])
                res.setdefault("groups", {})[form] = [g["params"] for g in sd["param_groups"]]
            for pg in o.param_groups:
                pg["lr"] = 5.0  # hyperparameters come back too
            o.load_state_dict(sd)
            losses[w] = train_steps(m, o, data[3:])
        res[form] = losses
    return res


@pytest.mark.parametrize("use_orig", [False, True])
def test_older_optimizer_state_api_matches_torch(dist_pool, use_orig):
    out = dist_pool(2).run(_legacy_optim_api, use_orig, timeout=TIMEOUT)
    assert out[1]["rank1_empty"] is True
    for res in out:
        ours, theirs = res["straight"]["flatshard"], res["straight"]["torch"]
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
        for form in ("shard_full", "shard_full_optim", "scatter_full", "flatten_sharded",
                     "rekeyed"):
            # resumed exactly where the straight run went, as torch's does
            # (torch's own resumption with use_orig_params=True starts from
            # its wrong moments: not compared)
            assert res[form]["flatshard"] == ours, form
            if not use_orig:
                torch.testing.assert_close(res[form]["flatshard"], res[form]["torch"],
                                           rtol=1e-5, atol=1e-6, msg=form)


def _legacy_refusals():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return _legacy_refusals_body()


def _legacy_refusals_body():
    m = _wrapped("flatshard", False)
    o = _opt(m)
    train_steps(m, o, _batches(1, dist.get_world_size()))
    out = []
    for call in (lambda: FSDP.full_optim_state_dict(m, "adam"),
                 lambda: FSDP.full_optim_state_dict(m, o, rank0_only=1),
                 lambda: FSDP.shard_full_optim_state_dict({"state": {}}, m),
                 lambda: FSDP.full_optim_state_dict(m, o, optim_input=[]),
                 lambda: FSDP.rekey_optim_state_dict({"state": {0: {}, "a": {}},
                                                      "param_groups": []},
                                                     flatshard.OptimStateKeyType.PARAM_ID, m),
                 lambda: FSDP.rekey_optim_state_dict({"state": {}, "param_groups": [
                     {"params": [0]}]}, "PARAM_NAME", m)):
        try:
            call()
            out.append(None)
        except ConfigError as e:
            out.append(str(e))
    # a flat parameter of several parameters has no single name (torch's rule)
    ids = FSDP.rekey_optim_state_dict(FSDP.full_optim_state_dict(m, o, rank0_only=False),
                                      flatshard.OptimStateKeyType.PARAM_ID, _plain())
    try:
        FSDP.rekey_optim_state_dict(ids, flatshard.OptimStateKeyType.PARAM_NAME, m)
        out.append(None)
    except RuntimeError as e:
        out.append(str(e))
    return out


def test_older_optimizer_state_api_refusals_name_the_argument(dist_pool):
    msgs = dist_pool(2).run(_legacy_refusals, timeout=TIMEOUT)[0]
    for arg, msg in zip(["optim", "rank0_only", "optim_state_dict", "optim_input",
                         "optim_state_dict", "optim_state_key_type", "one parameter name"],
                        msgs):
        assert msg is not None and arg in msg, (arg, msg)


# ---------------------------------------------------------------------------
# check_is_root, fsdp_modules


def _roots():
    out = {}
    for w, C in (("torch", tfsdp.FullyShardedDataParallel), ("flatshard", FSDP)):
        m = _wrapped(w, False)
        mods = C.fsdp_modules(m)
        inner = mods[1]
        out[w] = (len(mods), [x is m for x in mods][:1], len(C.fsdp_modules(inner)),
                  [x.check_is_root() for x in mods],
                  [x is m for x in C.fsdp_modules(m, root_only=True)])
        # the first check on an inner module makes it a root, as the first forward would
        m2 = _wrapped(w, False)
        out[w + "_inner_first"] = [x.check_is_root() for x in C.fsdp_modules(m2)[1:2]]
    return out


def test_check_is_root_and_fsdp_modules_match_torch(dist_pool):
    res = dist_pool(2).run(_roots, timeout=TIMEOUT)[0]
    assert res["flatshard"] == res["torch"] == (3, [True], 1, [True, False, False], [True])
    assert res["flatshard_inner_first"] == res["torch_inner_first"] == [True]


# ---------------------------------------------------------------------------
# apply, named_parameters and named_buffers: torch's overrides of nn.Module's


def _init(m):
    if isinstance(m, nn.Linear):
        with torch.no_grad():
            m.weight.copy_(torch.arange(m.weight.numel(), dtype=m.weight.dtype
                                        ).view_as(m.weight) / 100)
            m.bias.fill_(0.5)


def _apply_and_names(use_orig):
    out = {}
    for w, C in (("torch", tfsdp.FullyShardedDataParallel), ("flatshard", FSDP)):
        m = _wrapped(w, use_orig)
        assert m.apply(_init) is m  # initialization after wrapping reaches the shards
        sd = {k: v.clone() for k, v in m.state_dict().items()}  # FULL, the default
        with C.summon_full_params(m):
            inside = ([n for n, _ in m.named_parameters()], [n for n, _ in m.named_buffers()])
        out[w] = (sd, inside, [n for n, _ in m.named_parameters()])
    return out


@pytest.mark.parametrize("use_orig", [False, True])
def test_apply_and_names_inside_summon_match_torch(dist_pool, use_orig):
    for r in dist_pool(2).run(_apply_and_names, use_orig, timeout=TIMEOUT):
        ours, theirs = r["flatshard"], r["torch"]
        assert list(ours[0]) == list(theirs[0])
        for k, v in theirs[0].items():
            assert torch.equal(ours[0][k], v), k
        assert ours[1] == theirs[1]  # plain names inside summon_full_params
        assert all("_fsdp_wrapped_module" not in n for n in ours[1][0])
        assert sorted(ours[2]) == sorted(theirs[2])  # and wrapped names outside


# ---------------------------------------------------------------------------
# register_comm_hook with torch's default hooks


def _hook_grads(strategy, hook_name, low_state):
    from torch.distributed.algorithms._comm_hooks import default_hooks as dh
    # torch's low-precision hooks call record_stream, a CUDA caching allocator
    # hint that CPU tensors lack: a no-op here, so torch's own hook runs on CPU.
    saved = torch.Tensor.record_stream
    torch.Tensor.record_stream = lambda self, stream: None
    try:
        return _hook_grads_body(getattr(dh, hook_name), strategy, low_state)
    finally:
        torch.Tensor.record_stream = saved


def _hook_grads_body(hook, strategy, low_state):
    from torch.distributed.algorithms._comm_hooks import default_hooks as dh
    out = {}
    x = _batches(1, dist.get_world_size(), seed=11)[0][0] * 30  # gradients fp16 rounds
    for w in ("torch", "flatshard", "flatshard_nohook"):
        m = _wrapped("torch" if w == "torch" else "flatshard", True,
                     sharding_strategy=getattr(tfsdp.ShardingStrategy, strategy))
        state = (dh.LowPrecisionState(dist.group.WORLD) if low_state else
                 dh.DefaultState(dist.group.WORLD))
        if w != "flatshard_nohook":
            m.register_comm_hook(state, hook)
        rank = dist.get_rank()
        (m(x[2 * rank:2 * rank + 2]) ** 2).sum().backward()
        C = tfsdp.FullyShardedDataParallel if w == "torch" else FSDP
        with C.summon_full_params(m, with_grads=True):
            out[w] = {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone()
                      for n, p in m.named_parameters()}
    return out


@pytest.mark.parametrize("strategy,hook,low", [
    ("FULL_SHARD", "reduce_scatter_hook", False), ("NO_SHARD", "allreduce_hook", False),
    ("FULL_SHARD", "fp16_compress_hook", True), ("SHARD_GRAD_OP", "bf16_compress_hook", True),
    ("NO_SHARD", "fp16_compress_hook", True)])
def test_comm_hooks_give_torchs_gradients(dist_pool, strategy, hook, low):
    res = dist_pool(2).run(_hook_grads, strategy, hook, low, timeout=TIMEOUT)[0]
    assert list(res["flatshard"]) == list(res["torch"])
    worst_vs_fp32 = 0.0
    for n, g in res["torch"].items():
        if low:  # the values torch's hook gives: rounded through fp16 / bf16
            tol = 1e-3 if hook == "fp16_compress_hook" else 8e-3
            torch.testing.assert_close(res["flatshard"][n], g, rtol=tol, atol=tol * g.abs().max(),
                                       msg=n)
            worst_vs_fp32 = max(worst_vs_fp32, (res["flatshard"][n] -
                                                res["flatshard_nohook"][n]).abs().max().item())
        else:
            torch.testing.assert_close(res["flatshard"][n], g, rtol=1e-5, atol=1e-6, msg=n)
            assert torch.equal(res["flatshard"][n], res["flatshard_nohook"][n]), n
    if low:
        assert worst_vs_fp32 > 0  # the compression did happen


def _hook_refusals():
    from torch.distributed.algorithms._comm_hooks import default_hooks as dh
    out = []
    st = dh.DefaultState(dist.group.WORLD)
    for strategy, state, hook, inner in [
            ("FULL_SHARD", st, lambda s, g, o: None, False),
            ("FULL_SHARD", st, dh.allreduce_hook, False),
            ("NO_SHARD", st, dh.reduce_scatter_hook, False),
            ("FULL_SHARD", st, dh.fp16_compress_hook, False),
            ("FULL_SHARD", dh.LowPrecisionState(dist.group.WORLD, torch.float64),
             dh.fp16_compress_hook, False),
            ("FULL_SHARD", st, dh.reduce_scatter_hook, True),
            ("SHARD_OPTIM", st, dh.allreduce_hook, False)]:
        m = FSDP(_plain(), auto_wrap_policy=tfsdp.wrap.ModuleWrapPolicy({Blk}),
                 sharding_strategy=flatshard.ShardingStrategy[strategy])
        target = FSDP.fsdp_modules(m)[1] if inner else m
        if inner:
            m.check_is_root()
        try:
            target.register_comm_hook(state, hook)
            out.append(None)
        except (ConfigError, AssertionError) as e:
            out.append((type(e).__name__, str(e)))
    m = _wrapped("flatshard", False)
    m.register_comm_hook(st, dh.reduce_scatter_hook)
    try:
        m.register_comm_hook(st, dh.reduce_scatter_hook)
        out.append(None)
    except AssertionError as e:
        out.append((type(e).__name__, str(e)))
    return out


def test_comm_hooks_that_cannot_be_honoured_are_refused(dist_pool):
    res = dist_pool(2).run(_hook_refusals, timeout=TIMEOUT)[0]
    want = [("NotBuiltError", "hook="), ("ConfigError", "reduce_scatter_hook"),
            ("ConfigError", "allreduce_hook"), ("ConfigTypeError", "LowPrecisionState"),
            ("ConfigError", "parameter_type=torch.float32"),
            ("ConfigAssertionError", "root instance"), ("NotBuiltError", "SHARD_OPTIM"),
            ("ConfigAssertionError", "already registered")]
    for (kind, text), got in zip(want, res):
        assert got is not None and got[0] == kind and text in got[1], (kind, text, got)


# ---------------------------------------------------------------------------
# fully_shard: the new FSDPModule methods, dp_mesh_dims, share_comm_ctx


def _fs_model(which, mesh, **kw):
    m = _plain()
    shard = tfsdp.fully_shard if which == "torch" else flatshard.fully_shard
    for b in list(m)[:2]:
        shard(b, mesh=mesh, **kw)
    return shard(m, mesh=mesh, **kw)


def _fs_steps(model, data, before=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if before is not None:
        before(model)
    return train_steps(model, opt, data)


def _fsdp2_methods():
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    data = _batches(3, world, seed=3)
    out = {"torch": _fs_steps(_fs_model("torch", mesh), data)}

    def tune(m):  # everything that changes memory or speed only
        with pytest.warns(FutureWarning, match="set_gradient_divide_factor"):
            m.set_reduce_scatter_divide_factor(float(world))  # the average, as by default
        m.set_force_sum_reduction_for_comms(True)
        m.set_force_sum_reduction_for_comms(False)
        m.set_reduce_scatter_unused_params(False)
        m.set_reduce_scatter_max_input_buffers(3)
        m.set_separate_reduce_scatter_group(True)
        m.set_allocate_memory_from_process_group_for_comm(True)
        m.set_symm_mem_for_comm("NCCL")
        m.set_requires_all_reduce(False)  # 1-D mesh: nothing to all-reduce (as torch)
        m.set_requires_all_reduce(True)
        flatshard.share_comm_ctx([m, m[0]])
    out["flatshard"] = _fs_steps(_fs_model("flatshard", mesh), data, tune)

    refusals = []
    m = _fs_model("flatshard", mesh)
    for call in (lambda: m.set_custom_all_gather(object()),
                 lambda: m.set_custom_reduce_scatter(3),
                 lambda: m.set_all_reduce_hook(42),
                 lambda: m.set_reduce_scatter_unused_params(1),
                 lambda: m.set_reduce_scatter_max_input_buffers(0),
                 lambda: m.set_reduce_scatter_max_input_buffers(True),
                 lambda: m.set_symm_mem_for_comm("NVSHMEM"),
                 lambda: m.set_force_sum_reduction_for_comms(1),
                 lambda: flatshard.share_comm_ctx([m, nn.Linear(2, 2)])):
        try:
            call()
            refusals.append(None)
        except ConfigError as e:
            refusals.append((type(e).__name__, str(e)))
    out["refusals"] = refusals
    return out


def test_new_fsdp_module_methods(dist_pool):
    res = dist_pool(2).run(_fsdp2_methods, timeout=TIMEOUT)
    for r in res:
        torch.testing.assert_close(r["flatshard"], r["torch"], rtol=1e-5, atol=1e-6)
    want = [("ConfigTypeError", "AllGather"),
            ("ConfigTypeError", "ReduceScatter"),
            ("ConfigTypeError", "hook got int"),
            ("ConfigTypeError", "reduce_scatter_unused_params"),
            ("ConfigError", "max_input_buffers"), ("ConfigTypeError", "max_input_buffers"),
            ("ConfigError", "backend"), ("ConfigTypeError", "enable"),
            ("ConfigError", "FSDPModules")]
    for (kind, text), got in zip(want, res[0]["refusals"]):
        assert got is not None and got[0] == kind and text in got[1], (kind, text, got)


def _root_divide_factor():
    """set_gradient_divide_factor on the root sets the root's group only, as
    in torch: the blocks keep the average."""
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    data = _batches(3, world, seed=5)
    def before(m):
        m.set_force_sum_reduction_for_comms(True)  # torch's on gloo: no PREMUL_SUM there
        m.set_gradient_divide_factor(4.0 * world)
    return {which: _fs_steps(_fs_model(which, mesh), data, before)
            for which in ("torch", "flatshard")}


def test_gradient_divide_factor_is_per_module_as_in_torch(dist_pool):
    for r in dist_pool(2).run(_root_divide_factor, timeout=TIMEOUT):
        assert r["flatshard"] == r["torch"]


class _CountingAllGather:
    """torch's AllGather protocol, counting its calls."""

    def __init__(self):
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op)


class _CountingReduceScatter(_CountingAllGather):
    """torch's ReduceScatter protocol, counting its calls."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)


def _custom_comms():
    """set_custom_all_gather / set_custom_reduce_scatter on every FSDP module:
    the same objects called as many times as torch calls them, the same
    losses."""
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    data = _batches(3, world, seed=9)
    out = {}
    for which in ("torch", "flatshard"):
        ag, rs = _CountingAllGather(), _CountingReduceScatter()
        checks = []

        def before(model):
            for m in model.modules():
                if isinstance(m, (tfsdp.FSDPModule, flatshard.FSDPModule)):
                    m.set_custom_all_gather(ag)
                    calls = rs.calls
                    m.set_custom_reduce_scatter(rs)
                    checks.append(rs.calls - calls)
        steps = _fs_steps(_fs_model(which, mesh), data, before)
        # flatshard checks a custom reduce-scatter's arithmetic when it is set
        # (runtime/comm_check.py): averaging and summing, in its reduce dtype
        assert set(checks) == ({0} if which == "torch" else {2}), (which, checks)
        out[which] = (steps, ag.calls, rs.calls - sum(checks))
    return out


def test_custom_all_gather_and_reduce_scatter_match_torch(dist_pool):
    for r in dist_pool(2).run(_custom_comms, timeout=TIMEOUT):
        assert r["flatshard"] == r["torch"] and r["torch"][1] > 0 and r["torch"][2] > 0, r


class _Branches(nn.Module):
    """Rank 0 goes through `a`, the other ranks through `b`; `c` always."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.a(x) if dist.get_rank() == 0 else self.b(x)
        return self.c(torch.relu(h))


def _unused_params(replicas_alone=False):
    """set_reduce_scatter_unused_params(True): ranks that use different
    parameters still reduce together; every trainable parameter gets its
    sharded gradient (zeros where no rank used it), as in torch.
    replicas_alone: HSDP with a shard dim of one rank, where each gradient
    is all-reduced on its own (csrc/engine/shard_group.h, [Note: direct layout])."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("rep", "dp")) \
        if replicas_alone else init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for which, shard in (("torch", tfsdp.fully_shard), ("flatshard", flatshard.fully_shard)):
        torch.manual_seed(0)
        m = _Branches()
        shard(m, mesh=mesh)
        m.set_reduce_scatter_unused_params(True)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(dist.get_rank())
        losses = []
        for _ in range(3):
            loss = m(torch.randn(3, 4, generator=g)).square().mean()
            loss.backward()
            grads = {n: p.grad.to_local().clone() if p.grad is not None else None
                     for n, p in m.named_parameters()}
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[which] = (losses, grads, {n: p.to_local().clone() for n, p in m.named_parameters()})
    return out


@pytest.mark.parametrize("replicas_alone", [False, True])
def test_reduce_scatter_unused_params_matches_torch(dist_pool, replicas_alone):
    for r in dist_pool(2).run(_unused_params, replicas_alone, timeout=TIMEOUT):
        (tl, tg, tp), (fl, fg, fp) = r["torch"], r["flatshard"]
        assert fl == tl
        assert tg.keys() == fg.keys() and all(
            (tg[k] is None) == (fg[k] is None) and (tg[k] is None or torch.equal(tg[k], fg[k]))
            for k in tg)
        assert all(fg[k] is not None for k in fg)  # a and b have one on every rank
        assert all(torch.equal(tp[k], fp[k]) for k in tp)


class _Boom(Exception):
    pass


def _reset_iter_state(which, reset=True):
    from torch.distributed.device_mesh import init_device_mesh
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    data = _batches(4, world, seed=5)
    m = _fs_model(which, mesh)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    losses = train_steps(m, opt, data[:2])
    # a backward that fails half way: block 0's backward raises
    armed = [True]

    def boom(module, grad_output):
        if armed[0]:
            raise _Boom()
    h = m[0].a.register_full_backward_pre_hook(boom)
    x, y = data[2]
    try:
        ((m(x[2 * rank:2 * rank + 2]) - y[2 * rank:2 * rank + 2]) ** 2).mean().backward()
        raise AssertionError("the backward did not fail")
    except _Boom:
        pass
    h.remove()
    if reset:
        m.reset_iter_state()
    opt.zero_grad(set_to_none=True)
    try:
        m[0].reset_iter_state()
        nonroot = None
    except RuntimeError as e:
        nonroot = str(e)
    losses += train_steps(m, opt, data[2:])
    return losses, nonroot


def _straight(which):
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    m = _fs_model(which, init_device_mesh("cpu", (world,)))
    return _fs_steps(m, _batches(4, world, seed=5))


def test_reset_iter_state_recovers_from_a_failed_backward(dist_pool):
    """torch documents that after reset_iter_state the failed iteration's
    gradients are discarded, so training goes on as if it never ran: the
    same losses as a straight run on the other batches. flatshard's does
    that; without the call the next steps differ. (torch's own, on CPU,
    leaves some of the failed backward's gradients in: its later losses
    differ from its straight run, so its losses are not the reference.)"""
    pool = dist_pool(2)
    ours = pool.run(_reset_iter_state, "flatshard", timeout=TIMEOUT)
    no_reset = pool.run(_reset_iter_state, "flatshard", False, timeout=TIMEOUT)
    theirs = pool.run(_reset_iter_state, "torch", timeout=TIMEOUT)
    straight = pool.run(_straight, "flatshard", timeout=TIMEOUT)
    straight_torch = pool.run(_straight, "torch", timeout=TIMEOUT)
    assert any(n[0] != s for n, s in zip(no_reset, straight))
    for (o, o_err), (t, t_err), s, st in zip(ours, theirs, straight, straight_torch):
        assert o == s  # as if the failed iteration never happened
        torch.testing.assert_close(o, st, rtol=1e-5, atol=1e-6)
        assert o[:3] == t[:3]
        assert "root" in o_err and "root" in t_err


def _dp_mesh_refusals():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    out = []
    mesh1 = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    mesh3 = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("a", "b", "dp"))
    D = tfsdp.DataParallelMeshDims

    def lin(mesh, placement=Replicate(), plain=False):
        m = nn.Linear(4, 4)
        if not plain:
            for n, p in list(m.named_parameters()):
                setattr(m, n, nn.Parameter(distribute_tensor(p.detach(), mesh,
                                                             [placement] * mesh.ndim)))
        return m
    for mesh, dims, kw in [(mesh3, D(shard=("a", "dp")), {}),
                           (mesh1, D(shard="nope"), {}),
                           (init_device_mesh("cpu", (2,)), D(shard="dp"), {}),
                           (mesh1, "dp", {}), (mesh1, D(shard="dp"), {"plain": True}),
                           (mesh1, D(shard="dp"), {"placement": Shard(0)})]:
        module = lin(mesh, **kw)
        before = [type(p).__name__ for p in module.parameters()]
        try:
            flatshard.fully_shard(module, mesh=mesh, dp_mesh_dims=dims)
            out.append(None)
        except ConfigError as e:
            out.append((type(e).__name__, str(e)))
        assert [type(p).__name__ for p in module.parameters()] == before  # untouched
        assert not isinstance(module, flatshard.FSDPModule)
    return out


def test_dp_mesh_dims_refusals_follow_torchs_checks(dist_pool):
    """fully_shard(dp_mesh_dims=...) is built for at most one shard dim and
    one replicate dim (tests/test_fsdp2_tp.py trains it against torch);
    flattened names are refused with a NotBuiltError naming it, after torch's own ValueErrors (here ConfigErrors, ValueError
    subclasses), and so are plain parameters and ones not replicated on the
    data-parallel dim."""
    res = dist_pool(2).run(_dp_mesh_refusals, timeout=TIMEOUT)[0]
    want = [("NotBuiltError", "flattened"),
            ("ConfigError", "not found"), ("ConfigError", "mesh_dim_names"),
            ("ConfigTypeError", "dp_mesh_dims"), ("ConfigError", "must be DTensors"),
            ("ConfigError", "expected Replicate()")]
    assert len(res) == len(want)
    for (kind, text), got in zip(want, res):
        assert got is not None and got[0] == kind and text in got[1], (kind, text, got)
