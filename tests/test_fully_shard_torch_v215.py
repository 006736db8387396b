"""torch 2.15's FSDP2 additions against torch's own fully_shard of the same
version in the same run, on gloo ranks: manual and asynchronous backward
finalization (several backwards without gradient sync before one
finalization, the no-op cases and refusals torch's docstring lists),
kept unsharded storage (the same data pointers across reshard and unshard,
counted by memory_stats), and MixedPrecisionPolicy.param_dtype_override_fn.
Losses and gradients are compared bit for bit.

Each exists in flatshard exactly where the installed torch has it
(torch_facts.VERSIONED): under an older torch these parity tests are
skipped, and the first test checks that the names are absent there as in
torch."""
import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as tfsdp
import torch.nn as nn
from torch.distributed.tensor import DTensor

import flatshard
from flatshard import MixedPrecisionPolicy, torch_facts

TIMEOUT = 300
HAS = {n: torch_facts.torch_has(w, n) for w, n in torch_facts.VERSIONED}
needs = {n: pytest.mark.skipif(not HAS[n], reason=f"torch {torch.__version__} has no {n} "
                               "(torch 2.15's), so neither has flatshard")
         for n in HAS}


def test_the_names_are_present_exactly_where_torch_has_them():
    for where, name in torch_facts.VERSIONED:
        if where == "torch.distributed.fsdp":
            assert hasattr(flatshard, name) == hasattr(tfsdp, name), name
            assert hasattr(flatshard._fully_shard, name) == hasattr(tfsdp._fully_shard, name)
        elif where == "FSDPModule":
            assert hasattr(flatshard.FSDPModule, name) == hasattr(tfsdp.FSDPModule, name), name
        else:  # torch's own dataclass: the field comes with torch
            assert flatshard.MixedPrecisionPolicy is tfsdp.MixedPrecisionPolicy
    if not HAS["finalize_backward"]:
        with pytest.raises(AttributeError):
            flatshard.FSDPModule.finalize_backward
        with pytest.raises(TypeError):
            MixedPrecisionPolicy(param_dtype_override_fn=lambda p: None)


# ---------------------------------------------------------------------------
# helpers, run inside each rank


def _shard_fn(which):
    return tfsdp.fully_shard if which == "torch" else flatshard.fully_shard


def _model(which, mp=None, norm=False, seed=0):
    """Linear(7, 13) [LayerNorm(13)] ReLU Linear(13, 13) ReLU Linear(13, 5),
    each Linear (and the norm) sharded, then the root: uneven shards on 2
    ranks."""
    torch.manual_seed(seed)
    layers = [nn.Linear(7, 13)] + ([nn.LayerNorm(13)] if norm else []) + \
        [nn.ReLU(), nn.Linear(13, 13), nn.ReLU(), nn.Linear(13, 5)]
    m = nn.Sequential(*layers)
    kw = {} if mp is None else {"mp_policy": mp(m) if callable(mp) else mp}
    shard = _shard_fn(which)
    for layer in m:
        if any(True for _ in layer.parameters()):
            shard(layer, **kw)
    return shard(m, **kw)


def _batches(n, seed=3):
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    return [(torch.randn(3, 7, generator=g), torch.randn(3, 5, generator=g)) for _ in range(n)]


def _loss(m, x, y):
    return (m(x).float() - y).square().mean()


def _grads(m):
    return {n: None if p.grad is None else p.grad.to_local().clone()
            for n, p in m.named_parameters()}


def _params(m):
    return {n: p.to_local().clone() for n, p in m.named_parameters()}


def _same(a, b):
    """Bit-equal nested results (floats, tensors, dicts, lists, None)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


def _errors(calls):
    """(exception type name, message) or None for each call."""
    out = []
    for call in calls:
        try:
            call()
            out.append(None)
        except Exception as e:  # noqa: BLE001 - the type is what is compared
            out.append((type(e).__name__, str(e)))
    return out


# ---------------------------------------------------------------------------
# manual backward finalization


def _manual_steps(which, micro, async_op):
    """Three steps, each `micro` backwards (gradient sync off for all of them,
    on again before the one finalization), then finalize_backward and an SGD
    step. Records whether any sharded gradient was set before finalizing."""
    m = _model(which)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m.set_manual_backward_finalization(True)
    data = _batches(3 * micro)
    losses, before, grads, handles = [], [], None, []
    for step in range(3):
        m.set_requires_gradient_sync(micro == 1)
        for x, y in data[step * micro:(step + 1) * micro]:
            loss = _loss(m, x, y)
            loss.backward()
            losses.append(loss.item())
        before.append(sorted(n for n, p in m.named_parameters() if p.grad is not None))
        m.set_requires_gradient_sync(True)
        if async_op:
            h = m.finalize_backward(async_op=True)
            handles.append(isinstance(h, tfsdp.GradientReductionHandle))
            x, y = data[0]
            refused = _errors([lambda: m(x), lambda: m.finalize_backward()])
            handles.append([r[0] if r else None for r in refused])
            h.wait()
        else:
            assert m.finalize_backward() is None
        grads = _grads(m)
        opt.step()
        opt.zero_grad()
    resharded = all(isinstance(p, DTensor) for p in m.parameters())
    return losses, grads, _params(m), before if micro > 1 else None, handles, resharded


@needs["finalize_backward"]
@pytest.mark.parametrize("micro,async_op", [(1, False), (3, False), (2, True)])
def test_manual_finalization_matches_torch(dist_pool, micro, async_op):
    """One backward then finalize_backward(); three backwards without sync
    then one finalization; async_op=True with wait(), where a forward or a
    second finalization before wait() raises (RuntimeError, as torch)."""
    pool = dist_pool(2)
    theirs = pool.run(_manual_steps, "torch", micro, async_op, timeout=TIMEOUT)
    ours = pool.run(_manual_steps, "flatshard", micro, async_op, timeout=TIMEOUT)
    for t, o in zip(theirs, ours):
        assert _same(o[0], t[0]), (o[0], t[0])  # losses
        assert _same(o[1], t[1])                # the last step's sharded gradients
        assert _same(o[2], t[2])                # the parameters after training
        assert o[3] == t[3]                     # which gradients were set before finalizing
        assert o[4] == t[4]
        assert o[5] and t[5]
        if async_op:
            assert o[4][0] is True and o[4][1] == ["RuntimeError", "RuntimeError"]


def _automatic_reference():
    """The same steps as _manual_steps(micro=3) without manual finalization:
    the accumulated sum reduced in the last backward, as before."""
    m = _model("flatshard")
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    data = _batches(9)
    losses = []
    for step in range(3):
        for i, (x, y) in enumerate(data[step * 3:(step + 1) * 3]):
            m.set_requires_gradient_sync(i == 2)
            loss = _loss(m, x, y)
            loss.backward()
            losses.append(loss.item())
        grads = _grads(m)
        opt.step()
        opt.zero_grad()
    return losses, grads, _params(m)


@needs["finalize_backward"]
def test_several_backwards_before_one_finalization_sum_as_automatic(dist_pool):
    """Three backwards without sync and one finalization give the gradients
    of the automatic flow (sync on for the last backward): one reduction of
    the same sums, to the bit."""
    pool = dist_pool(2)
    manual = pool.run(_manual_steps, "flatshard", 3, False, timeout=TIMEOUT)
    auto = pool.run(_automatic_reference, timeout=TIMEOUT)
    for m, a in zip(manual, auto):
        assert _same(m[0], a[0]) and _same(m[1], a[1]) and _same(m[2], a[2])


def _no_ops_and_refusals(which):
    """torch's documented no-op cases and its refusals, in one sequence."""
    out = {}
    m = _model(which)
    # before the root's first forward: a no-op (a handle whose wait does nothing)
    out["before"] = (m.finalize_backward(), m.finalize_backward(async_op=True).wait())
    x, y = _batches(1)[0]
    _loss(m, x, y).backward()  # automatic mode: finalizing is refused
    out["automatic"] = _errors([lambda: m.finalize_backward()])
    out["nonroot"] = _errors([lambda: m[0].finalize_backward(),
                              lambda: m[0].set_manual_backward_finalization(True)])
    m.set_manual_backward_finalization(True)
    for p in m.parameters():
        p.grad = None
    # a backward that reaches no FSDP-managed parameter: finalizing is safe
    with torch.no_grad():
        m(x)  # leaves the root gathered (reshard_after_forward False for the root)
    z = torch.ones(3, requires_grad=True)
    (z * 2).sum().backward()
    m.finalize_backward()
    out["resharded"] = all(isinstance(p, DTensor) for p in m.parameters())
    out["no_grads"] = all(p.grad is None for p in m.parameters())
    # after a backward starts the mode is fixed until finalized
    _loss(m, x, y).backward()
    out["switch"] = _errors([lambda: m.set_manual_backward_finalization(False)])
    m.finalize_backward()
    m.set_manual_backward_finalization(False)  # allowed again
    out["grads"] = _grads(m)
    # set on a module that is not the root, before the first forward
    m2 = _model(which, seed=1)
    m2[0].set_manual_backward_finalization(True)
    out["lazy"] = _errors([lambda: m2(x)])
    return out


@needs["finalize_backward"]
def test_no_op_cases_and_refusals_match_torch(dist_pool):
    pool = dist_pool(2)
    theirs = pool.run(_no_ops_and_refusals, "torch", timeout=TIMEOUT)
    ours = pool.run(_no_ops_and_refusals, "flatshard", timeout=TIMEOUT)
    for t, o in zip(theirs, ours):
        assert o["before"] == t["before"] == (None, None)
        for key in ("automatic", "nonroot", "switch", "lazy"):
            assert [e and e[0] for e in o[key]] == [e and e[0] for e in t[key]], key
            assert [e and e[1] for e in o[key]] == [e and e[1] for e in t[key]], key
        assert o["resharded"] and t["resharded"] and o["no_grads"] and t["no_grads"]
        assert _same(o["grads"], t["grads"])


def _hsdp_manual(which):
    """HSDP (replicas x shard) under manual finalization: two backwards
    without sync, one finalization; then a backward without the replicas'
    all-reduce (a partial reduction), which finalization refuses, and
    reset_iter_state, after which an asynchronous finalization's handle is
    invalidated (torch's RuntimeErrors)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(7, 13), nn.ReLU(), nn.Linear(13, 5))
    shard = _shard_fn(which)
    shard(m[0], mesh=mesh)
    shard(m, mesh=mesh)
    m.set_manual_backward_finalization(True)
    data = _batches(4)
    m.set_requires_gradient_sync(False)
    for x, y in data[:2]:
        _loss(m, x, y).backward()
    m.set_requires_gradient_sync(True)
    m.finalize_backward()
    grads = _grads(m)
    m.zero_grad()
    m.set_requires_all_reduce(False)
    _loss(m, *data[2]).backward()
    partial = _errors([lambda: m.finalize_backward()])
    m.reset_iter_state()
    m.set_requires_all_reduce(True)
    _loss(m, *data[3]).backward()
    h = m.finalize_backward(async_op=True)
    m.reset_iter_state()
    stale = _errors([h.wait])
    return grads, [e and e[0] for e in partial], [e and e[0] for e in stale]


@needs["finalize_backward"]
def test_hsdp_manual_finalization_matches_torch(dist_pool):
    pool = dist_pool(2)
    theirs = pool.run(_hsdp_manual, "torch", timeout=TIMEOUT)
    ours = pool.run(_hsdp_manual, "flatshard", timeout=TIMEOUT)
    for t, o in zip(theirs, ours):
        assert _same(o[0], t[0])
        assert o[1] == t[1] == ["RuntimeError"]
        assert o[2] == t[2] == ["RuntimeError"]


# ---------------------------------------------------------------------------
# kept unsharded storage


def _kept_storage(which):
    m = _model(which)
    m.set_keep_unsharded_storage(True)
    ptrs = {i: set() for i, layer in enumerate(m) if isinstance(layer, nn.Linear)}

    def record(i):
        def hook(module, args):
            ptrs[i].add(module.weight.data_ptr())
        return hook
    for i in ptrs:
        m[i].register_forward_pre_hook(record(i))  # after fully_shard's: gathered
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in _batches(3):
        loss = _loss(m, x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    m[0].unshard()
    p0 = m[0].weight.data_ptr()
    m[0].reshard()
    m[0].unshard()
    again = m[0].weight.data_ptr() == p0
    m[0].reshard()
    out = {"losses": losses, "params": _params(m), "same_ptrs": all(len(v) == 1 for v in ptrs.values()),
           "again": again}
    if which == "flatshard":
        groups = [flatshard.fully_shard.state(layer).group for layer in m
                  if flatshard.fully_shard.state(layer) is not None and
                  flatshard.fully_shard.state(layer).group is not None]
        full = sum(g.full_alloc * g.compute_dtype.itemsize for g in groups)
        out["kept"] = (flatshard.memory_stats(m)["unsharded"], full)
        m.set_keep_unsharded_storage(False)
        out["freed"] = flatshard.memory_stats(m)["unsharded"]
    return out


@needs["set_keep_unsharded_storage"]
def test_kept_storage_keeps_data_pointers_and_trains_as_torch(dist_pool):
    pool = dist_pool(2)
    theirs = pool.run(_kept_storage, "torch", timeout=TIMEOUT)
    ours = pool.run(_kept_storage, "flatshard", timeout=TIMEOUT)
    for t, o in zip(theirs, ours):
        assert _same(o["losses"], t["losses"]) and _same(o["params"], t["params"])
        assert o["same_ptrs"] and t["same_ptrs"] and o["again"] and t["again"]
        kept, full = o["kept"]
        assert kept == full > 0  # every group's unsharded bytes, resharded
        assert o["freed"] == 0


# ---------------------------------------------------------------------------
# param_dtype_override_fn


def _override(which):
    """bf16 compute with the LayerNorm's parameters kept in float32 (its own
    group)."""
    def policy(m):
        keep = {id(p) for p in m[1].parameters()}
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p:
                                    p.dtype if id(p) in keep else None)
    m = _model(which, policy, norm=True)
    seen = {}

    def record(i):
        def hook(module, args):
            seen[i] = module.weight.dtype
        return hook
    for i in (0, 1, 3):
        m[i].register_forward_pre_hook(record(i))
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in _batches(3):
        loss = _loss(m, x, y)
        loss.backward()
        losses.append(loss.item())
        grads = _grads(m)
        opt.step()
        opt.zero_grad()
    return losses, grads, _params(m), seen


def _override_refusals(which):
    shard = _shard_fn(which)
    return _errors([
        lambda: shard(nn.Linear(4, 4), mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: torch.float16)),
        lambda: shard(nn.Linear(4, 4), mp_policy=MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p: "float32"))])


@needs["param_dtype_override_fn"]
def test_param_dtype_override_matches_torch(dist_pool):
    pool = dist_pool(2)
    theirs = pool.run(_override, "torch", timeout=TIMEOUT)
    ours = pool.run(_override, "flatshard", timeout=TIMEOUT)
    for t, o in zip(theirs, ours):
        assert o[3] == t[3] == {0: torch.bfloat16, 1: torch.float32, 3: torch.bfloat16}
        assert _same(o[0], t[0]) and _same(o[1], t[1]) and _same(o[2], t[2])
    # a return other than None, param_dtype or the parameter's dtype: a
    # ValueError from both (flatshard's ConfigError is one)
    for t, o in zip(pool.run(_override_refusals, "torch", timeout=TIMEOUT),
                    pool.run(_override_refusals, "flatshard", timeout=TIMEOUT)):
        assert [e[0] for e in t] == ["ValueError", "ValueError"]
        assert [e[0] for e in o] == ["ConfigError", "ConfigError"]
        assert all("param_dtype_override_fn" in e[1] for e in o)


def _split_group():
    lin = nn.Linear(4, 4)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                              param_dtype_override_fn=lambda p: p.dtype if p.ndim == 1 else None)
    got = _errors([lambda: flatshard.fully_shard(lin, mp_policy=mp)])
    return got, isinstance(lin, flatshard.FSDPModule), type(lin.weight).__name__


@needs["param_dtype_override_fn"]
def test_a_group_split_by_the_override_is_refused_naming_it(dist_pool):
    """One group gathers in one dtype: a Linear whose bias is kept in
    float32 and whose weight is cast is refused before anything changes
    (torch builds it; apply fully_shard to the kept parameters' module)."""
    for got, wrapped, kind in dist_pool(2).run(_split_group, timeout=TIMEOUT):
        assert got[0][0] == "NotBuiltError" and "bias" in got[0][1] and "weight" in got[0][1]
        assert not wrapped and kind == "Parameter"
