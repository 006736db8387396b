"""fully_shard's arguments and FSDPModule's methods: every bad argument is
refused up front with an error naming it, and every method changes what it
says it does, checked against plain single-process torch."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import flatshard
from flatshard import (ConfigError, ConfigTypeError, FSDPModule, MixedPrecisionPolicy,
                       NotBuiltError, fully_shard, register_fsdp_forward_method)
from flatshard.fsdp2.state import state_of

TIMEOUT = 240
PER_RANK = 2


class Shift(nn.Module):
    """x + shift: backward needs no parameter data (set_unshard_in_backward)."""

    def __init__(self, d, trainable=False):
        super().__init__()
        self.shift = nn.Parameter(torch.linspace(-1, 1, d), requires_grad=trainable)

    def forward(self, x):
        return x + self.shift


class Lin(nn.Linear):
    def project(self, x):  # a second entry point that reads the parameters
        return x @ self.weight.t()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = Lin(5, 7)
        self.shift = Shift(7)
        self.b = nn.Linear(7, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.shift(self.a(x))))


def _data(steps, world, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(PER_RANK * world, 5, generator=g),
             torch.randn(PER_RANK * world, 3, generator=g)) for _ in range(steps)]


def _sharded(mesh=None, **kw):
    m = Net()
    fully_shard(m.a, mesh=mesh, **kw)
    fully_shard(m.shift, mesh=mesh, **kw)
    fully_shard(m.b, mesh=mesh, **kw)
    return fully_shard(m, mesh=mesh, **kw)


def _close_to(model, ref):
    sd = model.state_dict()
    for name, want in ref.state_dict().items():
        got = sd[name].full_tensor() if isinstance(sd[name], DTensor) else sd[name]
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6 * want.abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def _step(model, ref, x, y, o=None, o_ref=None):
    rank = dist.get_rank()
    xs, ys = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
    ((model(xs) - ys) ** 2).mean().backward()
    ((ref(x) - y) ** 2).mean().backward()
    if o is not None:
        for opt in (o, o_ref):
            opt.step()
            opt.zero_grad()


def _expect(exc, *words):
    class Check:
        def __enter__(self):
            return self

        def __exit__(self, et, e, tb):
            assert et is not None, f"no {exc.__name__} raised"
            assert issubclass(et, exc), f"{et.__name__}: {e}"
            for w in words:
                assert w in str(e), f"{w!r} not in {e}"
            return True
    return Check()


# ----------------------------------------------------------------------


def _bad_arguments():
    m = Net()
    with _expect(ConfigError, "module", "twice"):
        fully_shard([m.a, m.a])
    with _expect(ConfigError, "module"):
        fully_shard([])
    with _expect(ConfigTypeError, "module"):
        fully_shard(3)
    with _expect(ConfigError, "reshard_after_forward=3", "divide"):
        fully_shard(m.a, reshard_after_forward=3)
    with _expect(ConfigError, "reshard_after_forward=0"):
        fully_shard(m.a, reshard_after_forward=0)
    with _expect(ConfigTypeError, "reshard_after_forward"):
        fully_shard(m.a, reshard_after_forward="yes")
    with _expect(ConfigTypeError, "mp_policy"):
        fully_shard(m.a, mp_policy=flatshard.MixedPrecision(param_dtype=torch.float16))
    with _expect(ConfigError, "mp_policy.param_dtype"):
        fully_shard(m.a, mp_policy=MixedPrecisionPolicy(param_dtype=torch.int32))
    with _expect(ConfigTypeError, "offload_policy"):
        fully_shard(m.a, offload_policy="cpu")
    with _expect(ConfigTypeError, "ignored_params"):
        fully_shard(m.a, ignored_params={torch.zeros(2)})
    with _expect(ConfigTypeError, "mesh"):
        fully_shard(m.a, mesh="cpu")
    with _expect(ConfigError, "shard_placement_fn", "Shard dim 2", "weight"):
        fully_shard(m.a, shard_placement_fn=lambda p: Shard(2))
    with _expect(ConfigError, "shard_placement_fn", "Invalid", "weight"):
        fully_shard(m.a, shard_placement_fn=lambda p: Replicate())
    mixed = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with _expect(ConfigError, "module", "dtypes"):
        fully_shard(mixed)
    scalar = nn.Module()
    scalar.w = nn.Parameter(torch.tensor(1.0))
    with _expect(ConfigError, "0-d"):
        fully_shard(scalar)
    # nothing was half-applied by the refusals above
    assert not any(isinstance(x, FSDPModule) for x in m.modules())
    fully_shard(m.a)
    with _expect(ConfigError, "already"):
        fully_shard(m.a)
    fully_shard(m)
    with _expect(ConfigTypeError, "requires_gradient_sync"):
        m.set_requires_gradient_sync("no")
    with _expect(ConfigError, "factor"):
        m.set_gradient_divide_factor(0)
    with _expect(ConfigTypeError, "modules"):
        m.set_modules_to_forward_prefetch([m.b])  # not an FSDPModule
    with _expect(ConfigTypeError, "event"):
        m.set_post_optim_event(object())
    with _expect(ConfigError, "reshard_after_forward=-1"):
        m.set_reshard_after_forward(-1)
    with _expect(ConfigTypeError, "reshard_after_forward", "expected True, False or an int"):
        m.set_reshard_after_forward(None)  # the allowed values as they are here: not None
    with pytest.warns(UserWarning, match=r"reshard_after_forward=1 \(an int\).*pass True"):
        m.set_reshard_after_forward(1)  # as torch warns: meant as True?
    assert state_of(m).reshard_after_forward is False
    with _expect(ConfigError, "method_name"):
        register_fsdp_forward_method(m, "nope")
    with torch.device("meta"):
        late = nn.Linear(3, 3)
    fully_shard(late)
    with _expect(ConfigError, "meta", "to_empty"):
        late(torch.zeros(1, 3))
    return True


def test_bad_arguments_are_refused(dist_pool):
    assert dist_pool(2).run(_bad_arguments, timeout=TIMEOUT) == [True, True]


def test_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with _expect(ConfigError, "mesh", "init_process_group"):
        fully_shard(nn.Linear(2, 2))


# ----------------------------------------------------------------------


def _methods():
    world = dist.get_world_size()
    ref, model = Net(), _sharded()
    assert isinstance(model.a.weight, DTensor) and model.a.weight.placements == (Shard(0),)
    # explicit unshard / reshard: the full tensors are registered in between
    h = model.a.unshard(async_op=True)
    h.wait()
    assert not isinstance(model.a.weight, DTensor)
    torch.testing.assert_close(model.a.weight.detach(), ref.a.weight.detach())
    model.a.reshard()
    assert isinstance(model.a.weight, DTensor)
    # the post-optimizer event is waited on by the root's next forward, once
    class Event:
        n = 0

        def synchronize(self):
            Event.n += 1
    model.set_post_optim_event(Event())
    o = torch.optim.SGD(model.parameters(), lr=0.1)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = _data(6, world)
    _step(model, ref, *data[0], o, o_ref)
    _step(model, ref, *data[1], o, o_ref)
    assert Event.n == 1
    _close_to(model, ref)

    # register_fsdp_forward_method: project() reads a's parameters
    x, _ = data[0]
    with pytest.raises(Exception):  # the sharded DTensor meets a plain tensor
        model.a.project(x)
    register_fsdp_forward_method(model.a, "project")
    torch.testing.assert_close(model.a.project(x), ref.a.project(x))
    assert model.a._fsdp_state().group.is_unsharded is False  # resharded after it

    # set_reshard_after_forward(False): one all-gather per step, not two
    ga = model.a._fsdp_state().group
    n0 = ga.n_all_gathers
    model.set_reshard_after_forward(False)
    _step(model, ref, *data[2], o, o_ref)
    assert ga.n_all_gathers - n0 == 1
    model.set_reshard_after_forward(True)
    model.set_reshard_after_forward(False, recurse=False)  # the root only, as by default

    # set_unshard_in_backward(False) on the frozen shift: gathered in forward only
    gs = model.shift._fsdp_state().group
    model.shift.set_unshard_in_backward(False)
    n0 = gs.n_all_gathers
    _step(model, ref, *data[3], o, o_ref)
    assert gs.n_all_gathers - n0 == 1
    _close_to(model, ref)

    # accumulation keeping the parameters unsharded: no all-gather, no reduce
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    r0 = ga.n_reduce_scatters
    _step(model, ref, *data[4])
    assert ga.is_unsharded and ga.n_reduce_scatters == r0
    n0 = ga.n_all_gathers
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    _step(model, ref, *data[5], o, o_ref)
    assert ga.n_all_gathers == n0 + 1  # forward found it unsharded; only backward gathers
    assert ga.n_reduce_scatters == r0 + 1 and not ga.is_unsharded
    _close_to(model, ref)

    # unfreezing after fully_shard: the shift trains from now on, as in torch
    model.shift.shift.requires_grad_(True)
    ref.shift.shift.requires_grad_(True)
    r0 = gs.n_reduce_scatters
    _step(model, ref, *data[0], o, o_ref)
    assert gs.n_reduce_scatters == r0 + 1
    _close_to(model, ref)
    return True


def test_fsdp_module_methods(dist_pool):
    assert dist_pool(2).run(_methods, timeout=TIMEOUT) == [True, True]


def _ignored_and_placement():
    rank, world = dist.get_rank(), dist.get_world_size()
    ref, m = Net(), Net()
    keep = m.b.bias
    fully_shard(m.b, ignored_params={keep}, shard_placement_fn=lambda p: Shard(0))
    fully_shard(m, shard_placement_fn=lambda p: None)
    assert m.b.bias is keep and not isinstance(keep, DTensor)
    x, y = _data(1, world)[0]
    xs, ys = x[rank * PER_RANK:(rank + 1) * PER_RANK], y[rank * PER_RANK:(rank + 1) * PER_RANK]
    ((m(xs) - ys) ** 2).mean().backward()
    ((ref(xs) - ys) ** 2).mean().backward()  # an ignored gradient stays this rank's own
    torch.testing.assert_close(keep.grad, ref.b.bias.grad)
    ref.zero_grad()
    ((ref(x) - y) ** 2).mean().backward()
    torch.testing.assert_close(m.b.weight.grad.full_tensor(), ref.b.weight.grad)
    return True


def _list_group(steps=2):
    """fully_shard([a, b]): one group over two modules that run apart."""
    world = dist.get_world_size()
    ref, model = Net(), Net()
    fully_shard(model.shift)
    out = fully_shard([model.a, model.b])
    fully_shard(model)
    assert out == [model.a, model.b] and all(isinstance(m, FSDPModule) for m in out)
    st = model.a._fsdp_state()
    assert st is model.b._fsdp_state() and len(st.group.sharded) == 4
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in _data(steps, world):
        _step(model, ref, x, y, o, o_ref)
        _close_to(model, ref)
    # one reduce-scatter per step for the two modules' gradients together;
    # the group's name in the ledger and in errors: its modules' paths
    return st.group.n_reduce_scatters, st.group.c.name, model.shift._fsdp_state().group.c.name


def test_one_group_over_a_list_of_modules(dist_pool):
    assert dist_pool(2).run(_list_group, timeout=TIMEOUT) == [(2, "a, b", "shift")] * 2


def test_ignored_params_and_placement_fn(dist_pool):
    assert dist_pool(2).run(_ignored_and_placement, timeout=TIMEOUT) == [True, True]


def _parity(mesh_shape=None, backend=None, steps=2):
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    old = os.environ.get("FLATSHARD_COMM_BACKEND")
    if backend:
        os.environ["FLATSHARD_COMM_BACKEND"] = backend
    try:
        names = ("replicate", "shard") if mesh_shape and len(mesh_shape) == 2 else None
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names) if mesh_shape else None
        ref, model = Net(), _sharded(mesh)
    finally:
        if backend:
            os.environ.pop("FLATSHARD_COMM_BACKEND")
            if old is not None:
                os.environ["FLATSHARD_COMM_BACKEND"] = old
    o = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for x, y in _data(steps, world):
        _step(model, ref, x, y, o, o_ref)
        _close_to(model, ref)
    return tuple(model.a.weight.placements), model.a._fsdp_state().group.comm.world_size


def test_hybrid_2d_mesh_4_ranks(dist_pool):
    from torch.distributed.tensor import Replicate
    res = dist_pool(4).run(_parity, (2, 2), timeout=TIMEOUT)
    assert res == [((Replicate(), Shard(0)), 2)] * 4


def test_gloo_backend_averages_right(dist_pool):
    assert dist_pool(2).run(_parity, None, "torch", timeout=TIMEOUT) == [((Shard(0),), 2)] * 2


def _dcp_roundtrip(path):
    import torch.distributed.checkpoint as dcp
    world = dist.get_world_size()
    a = _sharded()
    x, y = _data(1, world)[0]
    o = torch.optim.SGD(a.parameters(), lr=0.5)
    ((a(x) - y) ** 2).mean().backward()
    o.step()
    dcp.save(a.state_dict(), checkpoint_id=path)
    torch.manual_seed(9)
    b = Net()
    for lin in (b.a, b.b):
        lin.reset_parameters()
    for mod in (b.a, b.shift, b.b, b):
        fully_shard(mod)
    sd = b.state_dict()
    dcp.load(sd, checkpoint_id=path)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(q.full_tensor(), p.full_tensor(), rtol=0, atol=0,
                                   msg=lambda m: f"{n}: {m}")
    torch.testing.assert_close(b(x), a(x), rtol=0, atol=0)  # the gathers read the loaded shards
    return True


def test_distributed_checkpoint_roundtrip(dist_pool, tmp_path):
    assert dist_pool(2).run(_dcp_roundtrip, str(tmp_path / "ckpt"), timeout=TIMEOUT) == [True] * 2
