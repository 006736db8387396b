"""The gradient divide rule (csrc/core/reduce_rule.c, through _C.grad_divide)
against torch's own divisor functions, and fully_shard under a float16
reduce dtype against torch's fully_shard in the same run.

The rule is held against torch's functions on every world size 1..1024, with
and without replicas (HSDP), with and without a divide factor and forced
sums, for float16, bfloat16, float32 (and float64): FSDP1's
DefaultState._get_gradient_predivide_factor (pre, and post = N / pre, as
_init_utils sets them), fully_shard's _get_gradient_divide_factors (pre,
post, and the reduce ops, whose divide is the rule's in_comm).

Then two ranks train fully_shard with float16 parameters and reduce dtype on
gradients near float16's subnormal range, where dividing before the sum
(torch: each rank's gradient halved, then summed) and after it (the sum
halved) round differently: the sharded gradients of every step and the
parameters after 10 Adam steps are equal to torch's bit for bit, and the
test checks that its gradients are ones where the two orders differ."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ReduceOp
from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

import flatshard
from flatshard import _C
from flatshard.tensors import dtype_code

TIMEOUT = 300
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _Group:
    """What _get_gradient_divide_factors reads of a process group."""

    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


def _op_divisor(op, group_size):
    """By what a torch reduce op divides its sum."""
    if op == ReduceOp.SUM:
        return 1.0
    if op == ReduceOp.AVG:
        return float(group_size)
    return 1.0 / op.factor  # PREMUL_SUM(1 / factor)


def _torch_fully_shard(dtype, shard, replicate, factor, force_sum):
    pre, post, rs_op, ar_op = _get_gradient_divide_factors(
        _Group(shard), _Group(replicate) if replicate > 1 else None, dtype, "cpu", factor,
        force_sum)
    # on one rank torch copies instead of reduce-scattering, dividing by a set factor
    # (reduce_rule.h: with pre/post too, torch's alone; not reached here)
    in_comm = _op_divisor(rs_op, shard) if shard > 1 else \
        (float(factor) if factor is not None else 1.0)
    if replicate > 1:
        in_comm *= _op_divisor(ar_op, replicate)
    pre, post = pre or 1.0, post or 1.0
    return {"pre": float(pre), "in_comm": in_comm, "post": float(post),
            "hold": float(pre) * in_comm}


def _sizes():
    return range(1, 1025)


def test_fsdp1_rule_is_torchs_predivide_and_postdivide():
    for dtype in DTYPES:
        for shard in _sizes():
            for replicate in (1, 2, 3, 8) if shard <= 128 else (1,):
                n = shard * replicate
                pre = DefaultState._get_gradient_predivide_factor(n)
                got = _C.grad_divide("fsdp1", dtype_code(dtype), shard, replicate)
                want = {"pre": pre, "in_comm": 1.0, "post": n / pre, "hold": pre}
                assert got == want, (dtype, shard, replicate, got, want)


def test_fully_shard_rule_is_torchs_divide_factors():
    checked = 0
    for dtype in DTYPES:
        for shard in _sizes():
            for replicate in (1, 2, 3, 8) if shard <= 64 else (1,):
                n = shard * replicate
                factors = [None, 1.0, 2.0, 3.5, float(n), 4.0 * n]
                if shard == 1:  # torch's one-rank copy divides a set factor again
                    factors = [None] if dtype not in (torch.float32, torch.bfloat16) else \
                        factors
                for factor in factors:
                    for force_sum in (False, True):
                        if shard == 1 and force_sum and factor is not None:
                            continue  # the same one-rank copy
                        want = _torch_fully_shard(dtype, shard, replicate, factor, force_sum)
                        got = _C.grad_divide("fully_shard", dtype_code(dtype), shard, replicate,
                                             factor or 0.0, force_sum)
                        assert got == pytest.approx(want, rel=1e-15, abs=0), \
                            (dtype, shard, replicate, factor, force_sum, got, want)
                        checked += 1
    assert checked > 20000


def test_rule_divides_by_the_whole_factor_exactly_once():
    """The factors multiply to the mean's divisor (or the set factor) on
    every world size, in both APIs, float16 pre-dividing by about sqrt(N)."""
    for n in _sizes():
        d = _C.grad_divide("fully_shard", dtype_code(torch.float16), n)
        assert d["pre"] * d["in_comm"] * d["post"] == pytest.approx(n, rel=1e-15)
        pre = d["pre"]  # a power of two, doubled while it divides n (so 2 for n = 3)
        assert pre <= 2 * n ** 0.5 and pre == 2.0 ** (int(pre).bit_length() - 1)
        d = _C.grad_divide("fsdp1", dtype_code(torch.float32), n)
        assert d["pre"] * d["post"] == n


def test_bad_arguments_name_what_is_allowed():
    f16 = dtype_code(torch.float16)
    cases = [(("ddp", f16, 2), "api must be 'fsdp1' or 'fully_shard'"),
             (("fully_shard", f16, 0), "shard_world >= 1"),
             (("fully_shard", f16, 2, 0), "replicate_world >= 1"),
             (("fully_shard", f16, 2, 1, -1.0), "factor >= 0"),
             (("fully_shard", f16, 2, 1, float("inf")), "finite"),
             (("fsdp1", f16, 2, 1, 2.0), "no factor or force_sum for 'fsdp1'"),
             (("fully_shard", dtype_code(torch.int32), 2), "floating reduce dtype")]
    for args, text in cases:
        with pytest.raises(ValueError, match=text.replace("(", r"\(").replace(")", r"\)")):
            _C.grad_divide(*args)
    # ... and what was given, the factor as Python writes a float (C's %g is
    # not a conversion Python's error formatting has: 3.12 on refuses it)
    for factor, text in ((-1.0, "factor=-1.0,"), (float("inf"), "factor=inf,"),
                         (-2.5e-7, "factor=-2.5e-07,")):
        with pytest.raises(ValueError) as e:
            _C.grad_divide("fully_shard", f16, 2, 3, factor, True)
        assert f"got code={f16}, shard_world=2, replicate_world=3, {text} force_sum=1" \
            in str(e.value), str(e.value)


# ---------------------------------------------------------------------------
# two ranks: float16 reduce dtype against torch's fully_shard


def _net():
    torch.manual_seed(0)  # uneven rows: 7 and 5 over 2 ranks
    net = nn.Sequential(nn.Linear(16, 7), nn.Linear(7, 5))
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(0.25)
    return net


def _fp16_reduce(steps=10):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    models = {}
    for which, shard, policy in (("torch", torch_fully_shard, TorchMP),
                                 ("flatshard", flatshard.fully_shard,
                                  flatshard.MixedPrecisionPolicy)):
        m = _net()
        mp = policy(param_dtype=torch.float16, reduce_dtype=torch.float16)
        shard(m[0], mesh=mesh, mp_policy=mp)
        models[which] = shard(m, mesh=mesh, mp_policy=mp)
    plain = _net().half()  # each rank's own unsharded float16 gradient
    opts = {k: torch.optim.Adam(m.parameters(), lr=1e-3) for k, m in models.items()}
    g = torch.Generator().manual_seed(7 + rank)
    grads_equal, subnormal, orders_differ = True, 0, 0
    for step in range(steps):
        # gradients about 1e-5..1e-4: float16's subnormals start at 6.1e-5
        x = torch.randn(3, 16, generator=g) * 2e-3
        got = {}
        for which, m in models.items():
            (m(x).float().sum() * 0.01).backward()
            got[which] = [p.grad.to_local().clone() for p in m.parameters()]
        grads_equal &= all(torch.equal(a, b) for a, b in zip(got["torch"], got["flatshard"]))
        if step == 0:
            (plain(x.half()).float().sum() * 0.01).backward()
            for p, theirs in zip(plain.parameters(), got["torch"]):
                mine = p.grad.detach()
                every = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(every, mine)
                pre = sum(e / world for e in every)  # torch: divided, then summed (fp16)
                post = (sum(e.float() for e in every) / world).half()  # summed, then divided
                rows = (mine.shape[0] + world - 1) // world
                mine_rows = slice(rank * rows, (rank + 1) * rows)
                assert torch.equal(pre[mine_rows].float(), theirs)
                orders_differ += int((pre != post).sum())
                subnormal += int(((mine != 0) & (mine.abs() < 6.1e-5)).sum())
        for o in opts.values():
            o.step()
            o.zero_grad()
    params_equal = all(torch.equal(a.to_local(), b.to_local()) for a, b in
                       zip(models["torch"].parameters(), models["flatshard"].parameters()))
    return grads_equal, params_equal, subnormal, orders_differ


def test_fully_shard_float16_reduce_divides_before_as_torch(dist_pool):
    for grads_equal, params_equal, subnormal, orders_differ in dist_pool(2).run(
            _fp16_reduce, timeout=TIMEOUT):
        assert grads_equal and params_equal
        assert subnormal > 0 and orders_differ > 0  # the case where the order shows


# ---------------------------------------------------------------------------
# the reduce dtype ([Note: reduce dtype rule], through _C.reduce_dtype)

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _rule(rule, set_dtype, compute, accumulate=()):
    from flatshard.tensors import reduce_dtype
    return reduce_dtype(rule, set_dtype, compute, accumulate)


def test_reduce_dtype_set_is_the_reduce_dtype_under_both_rules():
    for rule in ("param_dtype", "grad_dtype"):
        for set_dtype in FLOATS:
            for compute in FLOATS:
                assert _rule(rule, set_dtype, compute, [torch.float32]) is set_dtype


def test_reduce_dtype_unset_param_dtype_rule_is_the_compute_dtype():
    for compute in FLOATS:
        for acc in FLOATS:
            assert _rule("param_dtype", None, compute, [acc]) is compute
        assert _rule("param_dtype", None, compute) is compute


def test_reduce_dtype_unset_grad_dtype_rule_promotes_as_torch():
    """The accumulation dtypes promoted as torch.promote_types (what torch
    2.15's _get_reduce_dtype reduces over), on every pair and triple, and
    never the compute dtype."""
    import functools
    import itertools
    for n in (1, 2, 3):
        for acc in itertools.product(FLOATS, repeat=n):
            want = functools.reduce(torch.promote_types, acc)
            for compute in FLOATS:
                assert _rule("grad_dtype", None, compute, acc) is want, (acc, compute)


def test_reduce_dtype_refusals_name_what_is_allowed():
    f32, i32 = dtype_code(torch.float32), dtype_code(torch.int32)
    with pytest.raises(ValueError, match="rule must be 'param_dtype' or 'grad_dtype'"):
        _C.reduce_dtype("compute", None, f32, [f32])
    for args in ((None, f32, []), (i32, f32, [f32]), (None, i32, [f32]), (None, f32, [i32]),
                 (None, f32, [99])):
        with pytest.raises(ValueError, match="need float dtype codes"):
            _C.reduce_dtype("grad_dtype", *args)
