"""fully_shard (FSDP2's API) against plain single-process torch: the same
model trained on the whole batch in one process is the reference, and every
rank's DTensor parameters (gathered with full_tensor) must match it after
every step, on 1, 2 and 4 ranks. Tolerance as in parity.py (only the order
of floating-point sums differs)."""
import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard.optim
from flatshard import ConfigError, CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from toy_models import build

RTOL, SCALE_ATOL = 2e-6, 2e-6
TIMEOUT = 240
PER_RANK = 2


def _shard(model, **kw):
    for b in model.blocks:
        fully_shard(b, **kw)
    return fully_shard(model, **kw)


def _batches(steps, world, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(PER_RANK * world, 5, generator=g),
             torch.randn(PER_RANK * world, 3, generator=g)) for _ in range(steps)]


def _mine(t):
    """This rank's rows of a whole-batch tensor."""
    r = dist.get_rank()
    return t[r * PER_RANK:(r + 1) * PER_RANK]


def _compare(model, ref, what):
    """full_tensor() of every sharded parameter (and gradient) against ref."""
    worst = 0.0
    sd = model.state_dict()
    for name, want in ref.state_dict().items():
        got = sd[name]
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        scale = want.abs().max().item() if want.numel() else 0.0
        torch.testing.assert_close(got, want, rtol=RTOL, atol=max(1e-7, SCALE_ATOL * scale),
                                   msg=lambda m: f"{what} {name}: {m}")
        if want.numel() and scale:
            worst = max(worst, (got - want).abs().max().item() / scale)
    return worst


def _opt(params, kind):
    """torch's optimizer, or with "fs_" flatshard.optim's fused one (the
    reference then gets torch's)."""
    mod = flatshard.optim if kind.startswith("fs_") else torch.optim
    if kind.endswith("adamw"):
        return mod.AdamW(params, lr=0.01, weight_decay=0.1)
    return mod.SGD(params, lr=0.05, momentum=0.9)


def _run(case="basic", steps=3, model_kw=None, opt="sgd"):
    """One rank's side of a parity case; returns (worst relative param
    difference, number of all-gathers of the first block)."""
    world = dist.get_world_size()
    model_kw = model_kw or {}
    ref = build(**model_kw)
    kw = {}
    if case == "raf_false":
        kw["reshard_after_forward"] = False
    if case == "raf_int":  # between forward and backward: sharded over pairs of ranks
        kw["reshard_after_forward"] = 2
    if case == "offload":
        kw["offload_policy"] = CPUOffloadPolicy()
    if case == "meta":
        with torch.device("meta"):
            model = build(**model_kw)
        _shard(model)
        model.to_empty(device="cpu")
        torch.manual_seed(5)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        for name, p in model.named_parameters():
            if name.endswith((".one", ".three")):  # Odd's own parameters have no reset
                nn.init.uniform_(p, -1.0, 1.0)
        for b in model.blocks:
            b.scale.fill_(0.5)  # buffers come out of to_empty uninitialised too
        full = {k: v.full_tensor() for k, v in model.state_dict().items()
                if hasattr(v, "full_tensor")}
        assert full["inp.weight"].std() > 0 and full["blocks.0.norm.weight"].eq(1).all()
        ref.load_state_dict(full, strict=False)
    else:
        model = _shard(build(**model_kw), **kw)
    assert isinstance(model, FSDPModule) and isinstance(model.blocks[0], FSDPModule)
    assert isinstance(model, type(ref)) and type(model).__name__ == "FSDPNet"
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    seen = []
    if case == "prefetch":
        blocks = list(model.blocks)
        for a, b in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
        # inside block 0's forward, block 1 is already gathered; inside block 1's
        # backward, block 0 (resharded after its forward) is gathered again
        g0, g1 = (b._fsdp_state().group for b in blocks[:2])
        blocks[0].ff.register_forward_pre_hook(lambda *a: seen.append(g1.is_unsharded))
        blocks[1].ff.register_full_backward_pre_hook(lambda *a: seen.append(g0.is_unsharded))
    if case == "divide":
        for m in model.modules():  # each module's own group, as in torch
            if isinstance(m, FSDPModule):
                m.set_gradient_divide_factor(2.0 * world)  # half the average
    o = _opt([p for p in model.parameters() if p.requires_grad], opt)
    o_ref = _opt([p for p in ref.parameters() if p.requires_grad], opt.replace("fs_", ""))
    micro = 2 if case == "accum" else 1
    data = iter(_batches(steps * micro, world))
    worst = 0.0
    for step in range(steps):
        for mb in range(micro):
            x, y = next(data)
            last = mb == micro - 1
            if case == "accum":
                model.set_requires_gradient_sync(last)
                model.set_is_last_backward(last)
            loss = ((model(_mine(x)) - _mine(y)) ** 2).mean()
            loss.backward()
            ref_loss = ((ref(x) - y) ** 2).mean()
            (ref_loss * (0.5 if case == "divide" else 1.0)).backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            torch.testing.assert_close(total / world, ref_loss.detach(), rtol=1e-5, atol=1e-6)
            if case == "accum" and not last:
                # nothing reduced yet: the sharded gradients are still empty
                assert all(p.grad is None for p in model.parameters())
        if case == "clip":
            n = torch.nn.utils.clip_grad_norm_([p for p in model.parameters()
                                                if p.requires_grad], 0.05)
            n_ref = torch.nn.utils.clip_grad_norm_([p for p in ref.parameters()
                                                    if p.requires_grad], 0.05)
            n = n.full_tensor() if hasattr(n, "full_tensor") else n
            torch.testing.assert_close(n, n_ref, rtol=1e-5, atol=1e-7)
        for p in model.parameters():  # every group is resharded after backward
            assert p.grad is None or type(p.grad).__name__ == "DTensor"
        assert not any(m._fsdp_state().group.is_unsharded for m in model.blocks)
        o.step()
        o.zero_grad()
        o_ref.step()
        o_ref.zero_grad()
        worst = max(worst, _compare(model, ref, f"step {step}"))
    if case == "prefetch":
        assert seen == [True] * (2 * steps)
    g = model.blocks[0]._fsdp_state().group
    if case == "raf_int":
        assert g.post_comm.world_size == 2 and g.n_post_gathers == steps
    return worst, g.n_all_gathers


CASES = [
    (1, "basic", {}), (2, "basic", {}), (4, "basic", {}),
    (2, "raf_false", {}), (4, "raf_int", {}), (2, "accum", {}), (2, "prefetch", {}),
    (2, "offload", {}),
    (2, "meta", {}), (2, "clip", {}), (2, "divide", {}),
    (2, "basic", {"tied": True}), (4, "basic", {"frozen": True}),
    (2, "basic", {"reuse": True}), (4, "basic", {"nested": True}),
]


@pytest.mark.parametrize("world,case,model_kw", CASES,
                         ids=[f"{w}-{c}-{'-'.join(k) or 'plain'}" for w, c, k in CASES])
def test_parity_with_torch(dist_pool, world, case, model_kw):
    res = dist_pool(world).run(_run, case, model_kw=model_kw, timeout=TIMEOUT)
    # one all-gather per forward and one per backward (reshard_after_forward) per step
    gathers = {r[1] for r in res}
    assert len(gathers) == 1
    per_step = 1 if case in ("raf_false", "raf_int") else 2
    if model_kw.get("reuse"):
        per_step = 2  # the last block reruns; its first block is not reused
    if case == "accum":
        per_step *= 2
    assert gathers == {3 * per_step}


def test_adamw_parity_2_ranks(dist_pool):
    res = dist_pool(2).run(_run, "basic", opt="adamw", timeout=TIMEOUT)
    assert all(r[0] < 1e-5 for r in res)


@pytest.mark.parametrize("case,opt", [("basic", "fs_adamw"), ("offload", "fs_adamw"),
                                      ("basic", "fs_sgd")])
def test_flatshard_optimizers_step_dtensor_parameters(dist_pool, case, opt):
    """flatshard.optim on fully_shard's DTensor parameters, each rank stepping
    its local shards ([Note: DTensor parameters] in flatshard/optim), trains
    as torch's optimizer on the whole model in one process."""
    res = dist_pool(2).run(_run, case, opt=opt, timeout=TIMEOUT)
    assert all(r[0] < 1e-5 for r in res)


def _run_optimizer_state(steps=2):
    """flatshard's AdamW state on a fully_shard model: DTensors laid out as
    their parameters, whose full state dict (torch.distributed.checkpoint)
    matches torch's AdamW state after the same steps on the whole model."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                         get_optimizer_state_dict)
    world = dist.get_world_size()
    ref = build()
    model = _shard(build())
    o = flatshard.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    o_ref = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    for x, y in _batches(steps, world):
        ((model(_mine(x)) - _mine(y)) ** 2).mean().backward()
        ((ref(x) - y) ** 2).mean().backward()
        for opt in (o, o_ref):
            opt.step()
            opt.zero_grad()
    for p in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            t = o.state[p][key]
            assert type(t).__name__ == "DTensor" and t.placements == p.placements
    full = get_optimizer_state_dict(model, o, options=StateDictOptions(full_state_dict=True))
    want = get_optimizer_state_dict(ref, o_ref, options=StateDictOptions(full_state_dict=True))
    assert full["state"].keys() == want["state"].keys()
    for name, st in want["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            scale = st[key].abs().max().item() if st[key].numel() else 0.0
            torch.testing.assert_close(full["state"][name][key], st[key], rtol=1e-5,
                                       atol=max(1e-8, 1e-5 * scale),
                                       msg=lambda m: f"{name} {key}: {m}")
        assert full["state"][name]["step"].item() == steps
    return True


def test_flatshard_adamw_state_is_dtensors_that_checkpoint_as_torchs(dist_pool):
    assert dist_pool(2).run(_run_optimizer_state, timeout=TIMEOUT) == [True, True]


def _run_partial_gradient():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    p = nn.Parameter(DTensor.from_local(torch.randn(4, 3), mesh, [Shard(0)]))
    p.grad = DTensor.from_local(torch.randn(8, 3), mesh, [Partial()])  # not reduced yet
    before = p._local_tensor.clone()
    with pytest.raises(ConfigError, match="group 0 gradient 0.*laid out as its parameter"):
        flatshard.optim.AdamW([p]).step()
    assert torch.equal(p._local_tensor, before)
    return True


def test_a_partial_gradient_is_refused_by_name(dist_pool):
    """A DTensor gradient not laid out as its parameter (here Partial: not
    reduced) would be stepped wrongly shard by shard: refused, named."""
    assert dist_pool(2).run(_run_partial_gradient, timeout=TIMEOUT) == [True, True]


def _plain(apply):
    """Uneven shapes, no zero-size parameter (torch's CPU copy-in refuses those)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Sequential(nn.Linear(5, 7), nn.Tanh()),
                      nn.Sequential(nn.Linear(7, 9), nn.Tanh()), nn.Linear(9, 3))
    apply(m[0])
    apply(m[1])
    return apply(m)


# ----------------------------------------------------------------------
# mixed precision: the reference runs each rank's half of the batch on a
# bf16 copy of the model, as the ranks do, and averages the bf16 gradients
# in fp32 (reduce_dtype)


def _run_mixed_precision(backend, steps=2):
    rank, world = dist.get_rank(), dist.get_world_size()
    ref = _plain(lambda m: m)
    old = os.environ.get("FLATSHARD_COMM_BACKEND")
    os.environ["FLATSHARD_COMM_BACKEND"] = backend  # read by fully_shard
    low_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                   output_dtype=torch.float32)
    # output_dtype on the root only: the inner modules hand bf16 on
    try:
        model = _plain(lambda m: fully_shard(m, mp_policy=root_mp
                                             if isinstance(m[0], nn.Sequential) else low_mp))
    finally:
        os.environ.pop("FLATSHARD_COMM_BACKEND")
        if old is not None:
            os.environ["FLATSHARD_COMM_BACKEND"] = old
    o = torch.optim.SGD(model.parameters(), lr=0.05)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x, y in _batches(steps, world):
        out = model(_mine(x))
        assert out.dtype == torch.float32
        ((out - _mine(y)) ** 2).mean().backward()
        low = copy.deepcopy(ref).to(torch.bfloat16)
        grads = [torch.zeros_like(p) for p in ref.parameters()]
        for r in range(world):
            xs = x[r * PER_RANK:(r + 1) * PER_RANK].to(torch.bfloat16)
            loss = ((low(xs).float() - y[r * PER_RANK:(r + 1) * PER_RANK]) ** 2).mean()
            gs = torch.autograd.grad(loss, list(low.parameters()))
            for acc, gr in zip(grads, gs):
                acc.add_(gr.float())
        for p, gr in zip(ref.parameters(), grads):
            p.grad = gr / world
        for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{name}: {m}")
        o.step()
        o.zero_grad()
        o_ref.step()
        o_ref.zero_grad()
        _compare(model, ref, "mixed precision")
    return model[0]._fsdp_state().group.compute_dtype


@pytest.mark.parametrize("backend", ["shm", "torch"])
def test_mixed_precision_parity(dist_pool, backend):
    res = dist_pool(2).run(_run_mixed_precision, backend, timeout=TIMEOUT)
    assert res == [torch.bfloat16] * 2


# ----------------------------------------------------------------------
# torch's own fully_shard on the same model: same dim-0 shards, same losses,
# same gradient shards (torch asks the backend for ReduceOp.AVG; flatshard
# sums and divides in C, whatever the backend).


def _run_against_torch_fsdp2(steps=3):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    world = dist.get_world_size()
    theirs = _plain(torch_fully_shard)
    ours = _plain(fully_shard)
    o_t = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9)
    o_f = torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9)
    for x, y in _batches(steps, world):
        lt = ((theirs(_mine(x)) - _mine(y)) ** 2).mean()
        lf = ((ours(_mine(x)) - _mine(y)) ** 2).mean()
        lt.backward()
        lf.backward()
        torch.testing.assert_close(lf, lt, rtol=1e-6, atol=1e-7)
        for (n, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
            assert p._local_tensor.shape == q._local_tensor.shape, n  # same dim-0 shards
            torch.testing.assert_close(p.grad._local_tensor, q.grad._local_tensor,
                                       rtol=1e-5, atol=1e-7, msg=lambda m: f"{n}: {m}")
        for o in (o_t, o_f):
            o.step()
            o.zero_grad()
    return True


def test_parity_with_torch_fully_shard(dist_pool):
    assert dist_pool(2).run(_run_against_torch_fsdp2, timeout=TIMEOUT) == [True, True]
