"""fully_shard against torch's own fully_shard in the same run: gradient
accumulation without sync sums in the reduce dtype, and torch's init-time
checks (mesh shape and names, scalar and non-contiguous parameters)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from flatshard import ConfigError, MixedPrecisionPolicy, NotBuiltError, fully_shard

TIMEOUT = 240


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _shard(shard_fn, mp):
    m = _mlp()
    shard_fn(m[0], mp_policy=mp)
    shard_fn(m[2], mp_policy=mp)
    return shard_fn(m, mp_policy=mp)


def _accumulated_grads(micro=3, reduce_dtype=torch.float32):
    """Sharded gradients after `micro` backwards without sync and one with,
    bf16 compute: -> (max |ours - torch's|, max |torch's|), from each rank."""
    rank = dist.get_rank()
    theirs = _shard(torch_fully_shard, TorchMP(param_dtype=torch.bfloat16,
                                               reduce_dtype=reduce_dtype))
    ours = _shard(fully_shard, MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=reduce_dtype))
    g = torch.Generator().manual_seed(7 + rank)
    xs = [torch.randn(4, 16, generator=g) for _ in range(micro + 1)]
    for model in (theirs, ours):
        for i, x in enumerate(xs):
            model.set_requires_gradient_sync(i == micro)
            model(x).float().square().mean().backward()
    worst = scale = 0.0
    for (n, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
        a, b = p.grad._local_tensor, q.grad._local_tensor
        assert a.dtype == b.dtype == torch.float32, n
        worst = max(worst, (a - b).abs().max().item())
        scale = max(scale, b.abs().max().item())
    return worst, scale


def test_accumulation_without_sync_sums_in_the_reduce_dtype(dist_pool):
    for worst, scale in dist_pool(2).run(_accumulated_grads, timeout=TIMEOUT):
        assert scale > 1e-3
        # bf16 sums differ from torch's float32 sums by ~1e-3 relative; the
        # same float32 sums differ only in the order of the last additions.
        assert worst <= 1e-6 * scale, (worst, scale)


def test_accumulation_in_the_compute_dtype_without_reduce_dtype(dist_pool):
    # reduce_dtype=None: torch keeps bf16 gradients and sums them in bf16.
    for worst, scale in dist_pool(2).run(_accumulated_grads, 2, None, timeout=TIMEOUT):
        assert worst <= 1e-6 * scale, (worst, scale)


def _refusals():
    """(our exception, torch's exception or None) for each bad input."""
    world = dist.get_world_size()
    cases = {}

    def both(name, build):
        got = []
        for fn in (fully_shard, torch_fully_shard):
            try:
                build(fn)
                got.append(None)
            except Exception as e:  # noqa: BLE001 - the type is what is compared
                got.append((type(e), str(e)))
        cases[name] = got

    unnamed = init_device_mesh("cpu", (1, world))
    both("2d_unnamed", lambda fn: fn(nn.Linear(4, 4), mesh=unnamed))
    three = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("a", "b", "c"))
    both("3d", lambda fn: fn(nn.Linear(4, 4), mesh=three))

    class Scalar(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.tensor(2.0))
    both("scalar", lambda fn: fn(Scalar()))
    return cases


def test_init_checks_refuse_as_torch_does(dist_pool):
    cases = dist_pool(2).run(_refusals, timeout=TIMEOUT)[0]
    (ours_t, ours), (theirs_t, theirs) = cases["2d_unnamed"]
    assert issubclass(theirs_t, AssertionError)
    assert issubclass(ours_t, AssertionError) and issubclass(ours_t, ConfigError)
    assert "mesh_dim_names" in ours and "Please init the 2D mesh for HSDP" in ours
    (ours_t, ours), (theirs_t, theirs) = cases["3d"]
    assert issubclass(theirs_t, ValueError) and issubclass(ours_t, ValueError)
    # the texts scripts match end ours as they are torch's whole message
    assert theirs.startswith("fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh(")
    assert ours.endswith(theirs) and "mesh=" in ours
    (ours_t, ours), (theirs_t, theirs) = cases["scalar"]
    assert issubclass(theirs_t, ValueError) and issubclass(ours_t, ConfigError)
    assert issubclass(ours_t, ValueError)
    assert theirs.endswith("Change s to a 1D tensor with numel equal to 1.")
    assert ours.endswith(theirs) and "parameter s " in ours


def _channels_last(steps=3):
    """torch's fully_shard refuses a channels_last conv weight; flatshard
    shards it (its shards are taken contiguous) and trains as plain torch."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 4, 3)).to(
            memory_format=torch.channels_last)
    ref, ours, theirs = net(), net(), net()
    assert not ours[0].weight.is_contiguous()
    try:
        torch_fully_shard(theirs)
        refused = None
    except NotImplementedError as e:
        refused = str(e)
    fully_shard(ours[0])
    fully_shard(ours)
    o = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    o_ref = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    worst = 0.0
    for _ in range(steps):
        x = torch.randn(2 * world, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
        ours(x[2 * rank:2 * rank + 2]).square().mean().backward()
        ref(x).square().mean().backward()
        o.step(), o_ref.step()
        o.zero_grad(), o_ref.zero_grad()
    for (n, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        worst = max(worst, ((p.full_tensor() - q).abs().max() / q.abs().max()).item())
    return refused, worst


def test_non_contiguous_parameters_are_sharded_correctly(dist_pool):
    for refused, worst in dist_pool(2).run(_channels_last, timeout=TIMEOUT):
        assert refused is not None and "non-contiguous" in refused  # torch's behaviour
        assert worst < 1e-5, worst


def _grad_dtype_set(when):
    m = _mlp()
    if when == "before":  # refused by fully_shard
        m[0].weight.grad_dtype = torch.float64
    try:
        fully_shard(m)
        if when == "after":  # on a shard, before the first forward (torch reads it there)
            m[2].bias.grad_dtype = torch.float64
        m(torch.randn(2, 16)).sum().backward()
    except NotBuiltError as e:
        return str(e)
    return None


@pytest.mark.skipif(not hasattr(nn.Parameter(torch.zeros(1)), "_has_grad_dtype_override"),
                    reason="this torch's fully_shard does not read grad_dtype")
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_grad_dtype_set_by_hand_is_refused(dist_pool, when):
    """torch 2.15's fully_shard reduces a parameter whose grad_dtype was set in
    that dtype; flatshard does not build that and says so, naming it."""
    name = "0.weight" if when == "before" else "2.bias"
    for text in dist_pool(2).run(_grad_dtype_set, when, timeout=TIMEOUT):
        assert text is not None and f"parameter {name} has grad_dtype=torch.float64" in text
