"""set_requires_all_reduce(False) on HSDP and set_all_reduce_hook, against
torch's own fully_shard in the same run (torch's collectives on gloo,
flatshard's on its default backend).

Reduce-scatter only: each backward's reduce-scatter output is added into a
partial sum the group keeps, and the next backward that all-reduces adds it
to its own before the replicas' all-reduce; torch keeps the same partial sum.
The hook sees the reduce output, this rank's block. Every collective sum
here is of two values (groups of 2 ranks) and every divide is by 2 or 4,
which round nothing, so gradients, parameters and what the hooks see are
compared bit for bit."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import flatshard
from flatshard import MixedPrecisionPolicy
from flatshard.errors import ConfigError

TIMEOUT = 300
WHICH = ("torch", "flatshard")


def _net():
    torch.manual_seed(0)  # uneven rows: 7, 9 and 3 over groups of 2
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 9), nn.ReLU(),
                         nn.Linear(9, 3))


def _shard(which, mesh, reduce_dtype=None):
    shard, policy = ((torch_fully_shard, TorchMP) if which == "torch" else
                     (flatshard.fully_shard, MixedPrecisionPolicy))
    m = _net()
    kw = {"mesh": mesh, "mp_policy": policy(reduce_dtype=reduce_dtype)}
    shard(m[0], **kw)
    shard(m[2], **kw)
    return shard(m, **kw)


def _mesh(shape):
    names = ("rep", "dp") if len(shape) == 2 else ("dp",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _batches(n):
    g = torch.Generator().manual_seed(100 + dist.get_rank())  # every rank its own data
    return [(torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)) for _ in range(n)]


def _backward(m, x, y):
    nn.functional.mse_loss(m(x), y).backward()


def _grads(m):
    return [p.grad.to_local().clone() if p.grad is not None else None for p in m.parameters()]


def _equal(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), (x, y)


# ---------------------------------------------------------------------------
# set_requires_all_reduce(False): reduce-scatter only, then one all-reduce


def _accumulate(every, shape=(2, 2)):
    """Three micro-batches without the replicas' all-reduce (unless `every`),
    one with it, an SGD step: -> {which: (which parameters had a sharded
    gradient before the last backward, the sharded gradients, the
    parameters after the step)}."""
    mesh = _mesh(shape)
    data = _batches(4)
    out = {}
    for which in WHICH:
        m = _shard(which, mesh)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for k, (x, y) in enumerate(data):
            last = k == len(data) - 1
            m.set_requires_all_reduce(every or last)
            if last:
                before = [p.grad is not None for p in m.parameters()]
            _backward(m, x, y)
        grads = _grads(m)
        opt.step()
        out[which] = (before, grads, [p.to_local().detach().clone() for p in m.parameters()])
    return out


@pytest.mark.parametrize("shape", [(2, 2), (2, 1)])  # (2, 1): the replicas alone
def test_reduce_scatter_only_then_all_reduce_matches_torch(dist_pool, shape):
    n = math.prod(shape)
    partial = dist_pool(n).run(_accumulate, False, shape, timeout=TIMEOUT)
    every = dist_pool(n).run(_accumulate, True, shape, timeout=TIMEOUT)
    for p, e in zip(partial, every):
        t, o = p["torch"], p["flatshard"]
        assert o[0] == t[0] == [False] * 6  # nothing written before the all-reduce
        _equal(o[1], t[1])
        _equal(o[2], t[2])
        # all-reducing every time: the same sums, added in another order
        assert e["flatshard"][0] == e["torch"][0] == [True] * 6
        _equal(e["flatshard"][1], e["torch"][1])
        for a, b in zip(o[1] + o[2], e["flatshard"][1] + e["flatshard"][2]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _one_d_flag():
    mesh = _mesh((2,))
    data = _batches(2)
    out = {}
    for flag in (True, False):
        m = _shard("flatshard", mesh)
        m.set_requires_all_reduce(flag)
        for x, y in data:
            _backward(m, x, y)
        out[flag] = _grads(m)
    _equal(out[False], out[True])


def test_requires_all_reduce_changes_nothing_on_a_1d_mesh(dist_pool):
    dist_pool(2).run(_one_d_flag, timeout=TIMEOUT)


# ---------------------------------------------------------------------------
# set_all_reduce_hook


def _split(which, module, params, world, flat):
    """The flat reduce output as each parameter's rows (this rank's): torch
    packs the padded chunks back to back, flatshard's engine starts each at
    an aligned offset (the group's entries). The padding is zero in both."""
    pieces, off = [], 0
    for i, p in enumerate(params):
        row = math.prod(p.shape[1:])
        chunk = -(-p.shape[0] // world)
        if which == "flatshard":
            off = module._fsdp_state().group.entries[i].block_offset
        n = p.to_local().shape[0] * row
        assert not flat[off + n:off + chunk * row].any()
        pieces.append(flat[off:off + n])
        off += chunk * row
    return pieces


def _hook_run(shape, reduce_dtype):
    """A hook on the root and another on the first block, each recording what
    it sees and halving it in place; two backwards: -> {which: (what each
    hook saw, per parameter, the sharded gradients)}."""
    mesh = _mesh(shape)
    data = _batches(2)
    out = {}
    for which in WHICH:
        m = _shard(which, mesh, reduce_dtype)
        seen, kept = {"root": [], "block": []}, {"root": [], "block": []}

        def record(key):
            def hook(t):
                assert t.dim() == 1 and t.dtype == (reduce_dtype or torch.float32)
                seen[key].append(t.clone())
                kept[key].append(t)
                t.mul_(0.5)
            return hook
        m.set_all_reduce_hook(record("root"))
        m[0].set_all_reduce_hook(record("block"))
        for x, y in data:
            _backward(m, x, y)
        assert [len(v) for v in seen.values()] == [2, 2]
        if which == "flatshard":  # what the hook was given outlives the reduction
            for key in seen:
                for k, s in zip(kept[key], seen[key]):
                    assert torch.equal(k, s * 0.5)
        owners = {"root": (m, [m[4].weight, m[4].bias]),
                  "block": (m[0], [m[0].weight, m[0].bias])}
        split = {key: [_split(which, owners[key][0], owners[key][1], shape[-1], t) for t in v]
                 for key, v in seen.items()}
        out[which] = (split, _grads(m))
    return out


def _check_hooks(results):
    for r in results:
        t, o = r["torch"], r["flatshard"]
        for key in ("root", "block"):
            for a, b in zip(o[0][key], t[0][key]):
                _equal(a, b)
        _equal(o[1], t[1])


def test_all_reduce_hook_on_a_1d_mesh_matches_torch(dist_pool):
    _check_hooks(dist_pool(2).run(_hook_run, (2,), None, timeout=TIMEOUT))


def test_all_reduce_hook_on_hsdp_matches_torch(dist_pool):
    _check_hooks(dist_pool(4).run(_hook_run, (2, 2), None, timeout=TIMEOUT))


def test_all_reduce_hook_on_the_replicas_alone_matches_torch(dist_pool):
    """A shard dim of one rank: the unsharded parameters are the shards, and
    a held reduction still shows the hook what torch's does."""
    _check_hooks(dist_pool(2).run(_hook_run, (2, 1), None, timeout=TIMEOUT))


def test_all_reduce_hook_bf16_reduce_on_hsdp_matches_torch(dist_pool):
    _check_hooks(dist_pool(4).run(_hook_run, (2, 2), torch.bfloat16, timeout=TIMEOUT))


def _hook_after_partial():
    """The hook sees nothing of the backwards that only reduce-scatter, and
    the partial sums with the next one."""
    mesh = _mesh((2, 2))
    data = _batches(3)
    out = {}
    for which in WHICH:
        m = _shard(which, mesh)
        seen = []
        m.set_all_reduce_hook(lambda t: seen.append(t.clone()))
        for k, (x, y) in enumerate(data):
            m.set_requires_all_reduce(k == len(data) - 1)
            _backward(m, x, y)
        assert len(seen) == 1
        out[which] = (_split(which, m, [m[4].weight, m[4].bias], 2, seen[0]), _grads(m))
    _equal(out["flatshard"][0], out["torch"][0])
    _equal(out["flatshard"][1], out["torch"][1])


def test_all_reduce_hook_after_reduce_scatter_only_matches_torch(dist_pool):
    dist_pool(4).run(_hook_after_partial, timeout=TIMEOUT)


# ---------------------------------------------------------------------------
# the device path (the host device table): deferred reductions


def _hook_and_partial(device_path):
    """HSDP, a hook on the root and on the first block, two backwards
    reduce-scatter only, then one all-reducing: -> (what the hooks saw, the
    sharded gradients, reductions deferred)."""
    import flatshard.fsdp2.mesh as fmesh  # where fully_shard makes its Comms
    from flatshard.runtime.device import host_device_comm
    saved, made = fmesh.comm_for, {}

    def comm_for(group, backend, device=None):  # one device Comm per host Comm
        host = saved(group, backend, device)
        if id(host) not in made:
            made[id(host)] = (host, host_device_comm(host))
        return made[id(host)][1]
    if device_path:
        fmesh.comm_for = comm_for
    try:
        m = _shard("flatshard", _mesh((2, 2)))
    finally:
        fmesh.comm_for = saved
    seen = []

    def hook(t):
        seen.append(t.clone())
        t.mul_(0.5)
    m.set_all_reduce_hook(hook)
    m[0].set_all_reduce_hook(hook)
    data = _batches(3)
    for k, (x, y) in enumerate(data):
        m.set_requires_all_reduce(k == len(data) - 1)
        _backward(m, x, y)
    groups = [mod._fsdp_state().group for mod in (m, m[0], m[2])]
    return seen, _grads(m), sum(g.n_deferred_reduces for g in groups)


def _device_and_host():
    host, dev = _hook_and_partial(False), _hook_and_partial(True)
    _equal(dev[0], host[0])
    _equal(dev[1], host[1])
    assert len(host[0]) == 2 and host[2] == 0 and dev[2] == 9


def test_hook_and_partial_sums_on_the_device_path_match_the_host_path(dist_pool):
    dist_pool(4).run(_device_and_host, timeout=TIMEOUT)


# ---------------------------------------------------------------------------
# bad arguments


def _refusals():
    one = _shard("flatshard", _mesh((4,)))
    two = _shard("flatshard", _mesh((2, 2)))
    got = []
    for call in (lambda: one.set_all_reduce_hook(42),
                 lambda: one.set_all_reduce_hook(lambda t: None, stream=torch.Stream("cpu")),
                 lambda: two.set_all_reduce_hook(lambda t: None, stream=torch.Stream("cpu")),
                 lambda: one.set_requires_all_reduce(1),
                 lambda: two.set_requires_all_reduce(False, recurse=None)):
        try:
            call()
            got.append(None)
        except ConfigError as e:
            got.append((type(e).__name__, str(e)))
    one.set_all_reduce_hook(None)  # None: no hook
    return got


def test_bad_arguments_name_the_argument(dist_pool):
    got = dist_pool(4).run(_refusals, timeout=TIMEOUT)[0]
    want = [("ConfigTypeError", "hook got int"), ("ConfigError", "stream="),
            ("ConfigError", "native HSDP"), ("ConfigTypeError", "requires_all_reduce"),
            ("ConfigTypeError", "recurse")]
    for (kind, text), g in zip(want, got):
        assert g is not None and g[0] == kind and text in g[1], (kind, text, g)



def _reset_drops_partial():
    """reset_iter_state after a backward without the replicas' all-reduce:
    the partial sum is dropped, as torch drops it, so the next step's
    gradients are that step's alone."""
    mesh = _mesh((2, 2))
    data = _batches(2)
    out = {}
    for which in WHICH:
        m = _shard(which, mesh)
        m.set_requires_all_reduce(False)
        _backward(m, *data[0])
        m.reset_iter_state()
        m.set_requires_all_reduce(True)
        _backward(m, *data[1])
        out[which] = _grads(m)
    fresh = _shard("flatshard", mesh)
    _backward(fresh, *data[1])
    out["fresh"] = _grads(fresh)
    return out


def test_reset_iter_state_drops_the_partial_sum(dist_pool):
    for r in dist_pool(4).run(_reset_drops_partial, timeout=TIMEOUT):
        _equal(r["flatshard"], r["fresh"])
        _equal(r["flatshard"], r["torch"])
