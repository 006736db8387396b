"""Coalesced collectives on a host Comm ([Note: coalesced gathers] and
[Note: reduction buckets] in csrc/engine/engine.h), through fully_shard:

- a module's gather and the gathers of the modules it prefetches (torch's
  explicit prefetch lists) go in one all-gather;
- gradient reductions of consecutive groups go in one reduce-scatter, up to
  FLATSHARD_REDUCE_BUCKET_BYTES (runtime/bucket.py; default 1 MiB on the
  torch backend, 0 on shm);
- with no prefetch list, the modules that ran next in the last forward (in
  backward: before) join a module's all-gather, up to
  FLATSHARD_GATHER_AHEAD_BYTES (runtime/ahead.py; default 1 MiB on the
  torch backend, 0 on shm); for fully_shard and the FSDP1 wrapper.

The reference is the same model with neither (a budget of 0, no prefetch
lists): coalescing only regroups the collectives, each element is summed from
the same values in the same rank order, so gradients and parameters must be
equal to the bit. The Comm's ledger shows the collectives that were issued.
"""
import os

import pytest
import torch
import torch.distributed as dist

from flatshard import ConfigError, _C, fully_shard
from toy_models import build

TIMEOUT = 240
PER_RANK = 2
ENV = "FLATSHARD_REDUCE_BUCKET_BYTES"
AHEAD = "FLATSHARD_GATHER_AHEAD_BYTES"


class _env:
    """Set environment variables for a block (in a rank process)."""

    def __init__(self, **values):
        self.values = values

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.values}
        os.environ.update(self.values)

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _shard(model, mp=None):
    kw = {"mp_policy": mp} if mp is not None else {}
    parts = [model.inp, *model.blocks, model.head]
    for m in parts:
        fully_shard(m, **kw)
    fully_shard(model, **kw)
    return parts


def _prefetch_lists(parts, k):
    """Every k-th part prefetches the next k - 1 in forward, and likewise
    going backward."""
    for i in range(0, len(parts), k):
        parts[i].set_modules_to_forward_prefetch(parts[i + 1:i + k])
    rev = parts[::-1]
    for i in range(0, len(rev), k):
        rev[i].set_modules_to_backward_prefetch(rev[i + 1:i + k])


def _train(backend, bucket, prefetch, mp=None, steps=2, accum=1, reuse=False, ahead=0):
    """Gradients and parameters after each step (this rank's shards), and the
    ledger's collectives of the last step. ahead None: the backend's default."""
    world, rank = dist.get_world_size(), dist.get_rank()
    env = {ENV: str(bucket)} if ahead is None else {ENV: str(bucket), AHEAD: str(ahead)}
    with _env(FLATSHARD_COMM_BACKEND=backend, **env):
        model = build(depth=4, reuse=reuse)
        parts = _shard(model, mp)
        if prefetch:
            _prefetch_lists(parts, prefetch)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(3)
        seen = []
        comm = parts[1]._fsdp_state().group.comm
        for _ in range(steps):
            start = comm.ledger()[-1]["seq"] if comm.ledger() else 0
            for _ in range(accum):
                x = torch.randn(PER_RANK * world, 5, generator=g)
                y = torch.randn(PER_RANK * world, 3, generator=g)
                mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
                ((model(x[mine]) - y[mine]) ** 2).mean().backward()
            seen.append([p.grad._local_tensor.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
            seen.append([p._local_tensor.clone() for p in model.parameters()])
        ops = [(e["op"], e["unit"]) for e in comm.ledger() if e["seq"] > start]
    return seen, ops


def _bits_equal(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        for j, (p, q) in enumerate(zip(x, y)):
            assert p.dtype == q.dtype and torch.equal(p.view(-1), q.view(-1)), (i, j)


def _count(ops, op):
    return sum(1 for o, _ in ops if o == op)


CASES = {
    "shm": dict(backend="shm"),
    "torch": dict(backend="torch"),
    "shm-bf16": dict(backend="shm", mp="bf16"),
    "shm-accum": dict(backend="shm", accum=2),
    "shm-reuse": dict(backend="shm", reuse=True),
}


def _compare(case):
    kw = dict(CASES[case])
    if kw.pop("mp", None):
        from flatshard import MixedPrecisionPolicy
        kw["mp"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    plain, plain_ops = _train(bucket=0, prefetch=0, **kw)
    coalesced, ops = _train(bucket=1 << 20, prefetch=3, **kw)
    _bits_equal(plain, coalesced)
    return _count(plain_ops, "reduce_scatter"), _count(ops, "reduce_scatter"), \
        _count(plain_ops, "all_gather"), _count(ops, "all_gather")


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_coalesced_collectives_change_no_bit(dist_pool, case, world):
    if world == 3 and case not in ("shm", "torch"):
        pytest.skip("three ranks: the plain cases on both backends are enough")
    accum = CASES[case].get("accum", 1)
    for rs_plain, rs, ag_plain, ag in dist_pool(world).run(_compare, case, timeout=TIMEOUT):
        # 6 groups (inp, 4 blocks, head; the root holds none; a reused
        # block's gradients arrive once, summed): each reduces on its own, or
        # all in one bucket at the end of each backward
        assert rs_plain == accum * 6
        assert rs == accum
        # forward and backward: one gather per group (and the reused
        # block's again), or one per bucket of three prefetched groups
        assert ag < ag_plain


def _budget(bucket):
    """Which reductions of one step went together with a small budget, as
    the ledger's "+k" suffixes; and the groups' sizes in backward order."""
    with _env(FLATSHARD_COMM_BACKEND="shm", **{ENV: str(bucket)}):
        model = build(depth=4)
        parts = _shard(model)
        comm = parts[0]._fsdp_state().group.comm
        model(torch.randn(2, 5)).sum().backward()
        start = comm.ledger()[-1]["seq"]
        model(torch.randn(2, 5)).sum().backward()
    together = [int(e["unit"].rsplit(" +", 1)[1]) + 1 if " +" in e["unit"] else 1
                for e in comm.ledger() if e["seq"] > start and e["op"] == "reduce_scatter"]
    return together, [m._fsdp_state().group.reduce_bytes for m in parts[::-1]]


def _buckets(sizes, budget):
    """The documented rule: a group joins unless it would take the bucket past
    the budget (then the bucket goes first) or is larger than the budget
    (then it goes alone); a bucket that reaches the budget goes at once."""
    out, cur, held = [], 0, 0
    for n in sizes:
        if n > budget:
            out += [cur] * bool(cur) + [1]
            cur = held = 0
            continue
        if cur and held + n > budget:
            out.append(cur)
            cur = held = 0
        cur, held = cur + 1, held + n
        if held >= budget:
            out.append(cur)
            cur = held = 0
    return out + [cur] * bool(cur)


@pytest.mark.parametrize("budget", [2000, 1000, 64])
def test_bucket_budget_splits_the_reductions(dist_pool, budget):
    for together, sizes in dist_pool(2).run(_budget, budget, timeout=TIMEOUT):
        assert together == _buckets(sizes, budget), (together, sizes)
        assert sum(together) == 6
        if budget == 64:  # every group is larger: each on its own
            assert together == [1] * 6


def _bad_env(name, value):
    """The error of a first forward with `name` set to `value`, or None."""
    with _env(FLATSHARD_COMM_BACKEND="torch", **{name: value}):
        model = build(depth=1)
        _shard(model)
        try:
            model(torch.randn(2, 5))
        except ConfigError as e:
            return str(e)
    return None


@pytest.mark.parametrize("name,value", [(ENV, "1MiB"), (AHEAD, "-1")])
def test_budgets_are_validated(dist_pool, name, value):
    for msg in dist_pool(2).run(_bad_env, name, value, timeout=TIMEOUT):
        assert msg is not None and name in msg and value in msg, msg


def test_default_budgets_follow_the_backend(monkeypatch):
    """Without the environment variables, a reduction bucket and gathering
    ahead on the torch backend (collectives of about a millisecond), neither
    on shm (microseconds: measured slower with them) nor on one rank."""
    from types import SimpleNamespace
    from flatshard.runtime.ahead import ahead_bytes
    from flatshard.runtime.bucket import bucket_bytes
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv(AHEAD, raising=False)
    for backend, want in (("torch", 1 << 20), ("shm", 0)):
        comm = SimpleNamespace(backend=backend, device=None, world_size=2)
        assert bucket_bytes(comm) == want and ahead_bytes(comm) == want, backend
    assert ahead_bytes(SimpleNamespace(backend="torch", device=None, world_size=1)) == 0
    monkeypatch.setenv(ENV, "4096")
    assert bucket_bytes(SimpleNamespace(backend="shm", device=None, world_size=2)) == 4096


def _reset_after_abort():
    """A backward that raised after some groups' reductions joined the
    bucket; reset_iter_state drops them without a collective, and the next
    step's gradients are that step's alone (as a fresh model's)."""
    rank = dist.get_rank()
    grads = {}
    for which in ("aborted", "fresh"):
        model = build(depth=4)
        _shard(model)
        x = torch.randn(2, 5, generator=torch.Generator().manual_seed(rank))
        with _env(**{ENV: str(1 << 20)}):  # read at the first forward
            model(x).sum().backward()
        for p in model.parameters():
            p.grad = None
        if which == "aborted":
            def stop(grad):
                raise RuntimeError("stop")
            # block 0's output: its gradient comes after the later groups reduced
            def hook(module, args, out):
                out.register_hook(stop)
            handle = model.blocks[0].register_forward_hook(hook)
            try:
                model(x).sum().backward()
            except RuntimeError as e:
                assert "stop" in str(e)
            handle.remove()
            root = model._fsdp_state()
            assert root.tree.bucket.members, "nothing joined the bucket before the error"
            model.reset_iter_state()
            assert not root.tree.bucket.members
            for p in model.parameters():
                p.grad = None
        model(x).sum().backward()
        grads[which] = [p.grad._local_tensor.clone() for p in model.parameters()]
    _bits_equal([grads["aborted"]], [grads["fresh"]])
    return True


def test_reset_iter_state_drops_the_bucket(dist_pool):
    assert dist_pool(2).run(_reset_after_abort, timeout=TIMEOUT) == [True, True]


def _engine_arguments():
    """The engine's own checks on what the adapters pass it."""
    model = build(depth=2)
    parts = _shard(model)
    model(torch.randn(2, 5)).sum().backward()
    a, b = (m._fsdp_state().group.c for m in parts[1:3])
    errors = []
    for call in (lambda: a.unshard(True, along=(b,)),      # along gathers now: not deferred
                 lambda: a.unshard(along=(object(),)),     # not a group
                 lambda: a.flush_bucket(_C.ReduceBucket(), (b,))):  # not its members
        try:
            call()
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    return errors


def test_engine_checks_its_arguments(dist_pool):
    for errors in dist_pool(2).run(_engine_arguments, timeout=TIMEOUT):
        assert len(errors) == 3, errors
        assert "defer" in errors[0] and "along[0]" in errors[1] and "bucket" in errors[2]


# ----------------------------------------------------------------------
# the FSDP1 wrapper: the same bucket, per flat group


def _train_fsdp1(bucket, strategy, orig, mp, accum, backend="shm", ahead=0, steps=2):
    from flatshard import FSDP, MixedPrecision, ModuleWrapPolicy, ShardingStrategy
    from toy_models import Block
    world, rank = dist.get_world_size(), dist.get_rank()
    env = {ENV: str(bucket)} if ahead is None else {ENV: str(bucket), AHEAD: str(ahead)}
    with _env(FLATSHARD_COMM_BACKEND=backend, **env):
        model = FSDP(build(depth=4), auto_wrap_policy=ModuleWrapPolicy({Block}),
                     sharding_strategy=ShardingStrategy[strategy], use_orig_params=orig,
                     mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16)
                     if mp else None)  # cast to bf16, reduced, landing in red_out
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(3)
        comm = next(m for m in model.modules() if m is not model and hasattr(m, "_unit"))
        comm = comm._unit.c.comm
        seen = []
        for _ in range(steps):
            start = comm.ledger()[-1]["seq"] if comm.ledger() else 0
            for _ in range(accum):  # gradients accumulate across backwards
                x = torch.randn(PER_RANK * world, 5, generator=g)
                y = torch.randn(PER_RANK * world, 3, generator=g)
                mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
                ((model(x[mine]) - y[mine]) ** 2).mean().backward()
            seen.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
            opt.step()
            opt.zero_grad()
            seen.append([p.detach().clone() for p in model.parameters()])
        ops = [(e["op"], e["unit"]) for e in comm.ledger() if e["seq"] > start]
    return seen, _count(ops, "reduce_scatter"), ops


FSDP1_CASES = [("FULL_SHARD", False, False, 1), ("FULL_SHARD", True, True, 2),
               ("SHARD_GRAD_OP", True, False, 2), ("SHARD_GRAD_OP", False, True, 1)]


def _compare_fsdp1(strategy, orig, mp, accum):
    plain, rs_plain, _ = _train_fsdp1(0, strategy, orig, mp, accum)
    bucketed, rs, _ = _train_fsdp1(1 << 20, strategy, orig, mp, accum)
    _bits_equal(plain, bucketed)
    return rs_plain, rs


@pytest.mark.parametrize("strategy,orig,mp,accum", FSDP1_CASES,
                         ids=[f"{s}-orig{int(o)}-{'bf16reduce' if m else 'f32'}-x{a}"
                              for s, o, m, a in FSDP1_CASES])
def test_fsdp1_reduction_bucket_changes_no_bit(dist_pool, strategy, orig, mp, accum):
    for rs_plain, rs in dist_pool(2).run(_compare_fsdp1, strategy, orig, mp, accum,
                                         timeout=TIMEOUT):
        # 4 block units and the root's (inp, head) per backward: each on its
        # own, or one bucket per backward
        assert rs_plain == 5 * accum and rs == accum, (rs_plain, rs)


# ----------------------------------------------------------------------
# gathering ahead (runtime/ahead.py), both APIs


def _gathers(ops):
    """How many units each all-gather of a step held (the ledger's "+k")."""
    return [int(u.rsplit(" +", 1)[1]) + 1 if " +" in u else 1 for o, u in ops if o == "all_gather"]


def _compare_ahead(api, backend, strategy):
    """Three steps with no unit gathered ahead, with a 1 MiB budget, and
    with the backend's default; bits and the last step's all-gathers."""
    out = {}
    for name, ahead in (("off", 0), ("on", 1 << 20), ("default", None)):
        if api == "fully_shard":
            seen, ops = _train(backend, 0, 0, steps=3, ahead=ahead)
        else:
            seen, _, ops = _train_fsdp1(0, strategy, False, False, 1, backend=backend,
                                        ahead=ahead, steps=3)
        out[name] = seen, _gathers(ops)
    _bits_equal(out["off"][0], out["on"][0])
    _bits_equal(out["off"][0], out["default"][0])
    return {k: v[1] for k, v in out.items()}


AHEAD_CASES = [("fully_shard", "torch", None), ("fully_shard", "shm", None),
               ("fsdp1", "torch", "FULL_SHARD"), ("fsdp1", "shm", "FULL_SHARD"),
               ("fsdp1", "torch", "SHARD_GRAD_OP")]


@pytest.mark.parametrize("api,backend,strategy", AHEAD_CASES,
                         ids=["-".join(filter(None, c)) for c in AHEAD_CASES])
def test_gather_ahead_changes_no_bit(dist_pool, api, backend, strategy):
    for got in dist_pool(2).run(_compare_ahead, api, backend, strategy, timeout=TIMEOUT):
        off, on = got["off"], got["on"]
        assert set(off) == {1}, off  # every unit on its own
        # the same units gathered, in fewer all-gathers: from the first unit
        # in forward (and from the last in backward) the model's small units
        # all fit in 1 MiB
        assert sum(on) == sum(off) and len(on) < len(off), (on, off)
        if strategy == "SHARD_GRAD_OP":  # kept from forward to backward: all in one
            assert on == [sum(off)], on
        # the default: 1 MiB on the torch backend, none on shm
        assert got["default"] == (on if backend == "torch" else off), got


def _ahead_budget(budget):
    """The units of each all-gather of a step's forward with `budget`, and
    each unit's gathered bytes in forward order."""
    with _env(FLATSHARD_COMM_BACKEND="torch", **{AHEAD: str(budget), ENV: "0"}):
        model = build(depth=4)
        parts = _shard(model)
        comm = parts[0]._fsdp_state().group.comm
        for _ in range(2):  # gathering ahead starts once two forwards ran in one order
            model(torch.randn(2, 5)).sum().backward()
        start = comm.ledger()[-1]["seq"]
        with torch.no_grad():
            model(torch.randn(2, 5))
    ops = [(e["op"], e["unit"]) for e in comm.ledger() if e["seq"] > start]
    sizes = [p._fsdp_state().group.full_alloc * 4 for p in parts]
    return _gathers(ops), sizes


def _runs(sizes, budget):
    """The documented rule: a unit gathers with those after it while their
    bytes together fit in the budget; the next run starts where it stopped."""
    out, i = [], 0
    while i < len(sizes):
        j, left = i + 1, budget
        while j < len(sizes) and sizes[j] <= left:
            left -= sizes[j]
            j += 1
        out.append(j - i)
        i = j
    return out


@pytest.mark.parametrize("budget", [1 << 20, 700, 100])
def test_gather_ahead_budget(dist_pool, budget):
    for runs, sizes in dist_pool(2).run(_ahead_budget, budget, timeout=TIMEOUT):
        assert runs == _runs(sizes, budget), (runs, sizes)
        if budget == 100:  # every unit is larger: each on its own
            assert runs == [1] * len(sizes)
