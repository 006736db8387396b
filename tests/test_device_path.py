"""The units' device path, run on CPU: a Comm(kind='device') over a host
backend with the host table (flatshard.runtime.device.host_device_comm).

On a CUDA device the units take their buffers from torch's allocator per
reduction, enqueue casts and accumulations through the device's table, lend
the backend a float32 workspace for low-precision reductions, and bind the
caller's stream before every collective (csrc/engine/unit.c). The host table
runs the same C paths with copy.h's loops, so training through it must give
bit-identical results to the plain host path, for every strategy, with
mixed precision, gradient accumulation and use_orig_params. Only the CUDA
table itself and NCCL underneath differ; those are tested on a GPU in
test_cuda.py."""
import pytest
import torch
import torch.distributed as dist

import flatshard
import flatshard.fsdp.api as ffsdp
import flatshard.fsdp.groups as fgroups
from flatshard import FSDP, MixedPrecision, ShardingStrategy
from flatshard.runtime.device import host_device_comm
from toy_models import Block, build


class _DeviceComms:
    """Make every wrapper built inside use a device Comm made by make(group,
    host Comm): by default the host table's over the host Comm (one per host
    Comm, as units of one group share their Comm)."""

    def __init__(self, make=None):
        self.make = make or (lambda group, host: host_device_comm(host))

    def __enter__(self):
        self.saved = fgroups.comm_for
        made = {}

        def comm_for(group, backend, device=None):
            host = self.saved(group, backend, device)
            if id(host) not in made:
                made[id(host)] = (host, self.make(group, host))
            return made[id(host)][1]

        fgroups.comm_for = comm_for
        return self

    def __exit__(self, *exc):
        fgroups.comm_for = self.saved


def _train(kw, device_path, steps=4, accumulate=False):
    """device_path: False (host Comms), True (the host table's device
    Comms) or a make(group, host Comm) for _DeviceComms."""
    torch.manual_seed(0)
    model = build()
    ctx = _DeviceComms(None if device_path is True else device_path) if device_path else None
    if ctx:
        ctx.__enter__()
    try:
        fs = FSDP(model, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                  device_id=torch.device("cpu"), **kw)
    finally:
        if ctx:
            ctx.__exit__()
    comms = {m._unit.c.comm.device for m in fs.modules() if isinstance(m, FSDP)}
    units = [m._unit for m in fs.modules() if isinstance(m, FSDP)]
    seen = []  # (own gather pending, another unit's pending) as each block computes

    def look(unit):
        def hook(module, args):
            seen.append((unit.c.gather_pending,
                         any(u.c.gather_pending for u in units if u is not unit)))
        return hook
    for m in fs.modules():
        if isinstance(m, FSDP) and m is not fs:
            m._fsdp_wrapped_module.register_forward_pre_hook(look(m._unit))
    opt = torch.optim.SGD(fs.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    saved_issue = ffsdp.RootState.reduce_issued
    reduced = []  # (the reduction in flight was still pending when the next was issued)

    def reduce_issued(root, unit):
        prev = root.inflight.owner
        reduced.append(prev is not None and prev is not unit and prev.c.reduce_pending)
        saved_issue(root, unit)
    ffsdp.RootState.reduce_issued = reduce_issued
    try:
        _steps(fs, opt, g, steps, accumulate, losses)
    finally:
        ffsdp.RootState.reduce_issued = saved_issue
    assert not any(u.c.reduce_pending for u in units)  # all waited for by the end of backward
    return _results(fs, losses, comms, seen, reduced)


def _steps(fs, opt, g, steps, accumulate, losses):
    for _ in range(steps):
        micro = 2 if accumulate else 1
        for i in range(micro):
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            with fs.no_sync() if i < micro - 1 else _nothing():
                loss = ((fs(x).float() - y) ** 2).mean()
                loss.backward()
            losses.append(loss.item())
        opt.step()
        opt.zero_grad()


def _results(fs, losses, comms, seen, reduced):
    with FSDP.summon_full_params(fs):
        full = [p.detach().clone() for p in fs.parameters()]
    state = {k: v.clone() for k, v in fs.state_dict().items()}
    ledger = [e["op"] for m in fs.modules() if isinstance(m, FSDP)
              for e in m._unit.c.comm.ledger()][-3:]
    return losses, full, state, sorted(map(str, comms)), ledger, seen, reduced


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


CASES = {
    "full_shard": dict(sharding_strategy=ShardingStrategy.FULL_SHARD),
    "shard_grad_op": dict(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP),
    "no_shard": dict(sharding_strategy=ShardingStrategy.NO_SHARD),
    "orig_params": dict(use_orig_params=True),
    "bf16_fp32_reduce": dict(mixed_precision=MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)),
    "bf16_bf16_reduce": dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                            buffer_dtype=torch.bfloat16)),
    "fp16": dict(mixed_precision=MixedPrecision(param_dtype=torch.float16,
                                                buffer_dtype=torch.float16)),
    "forward_prefetch": dict(forward_prefetch=True),
    "no_shard_bf16": dict(sharding_strategy=ShardingStrategy.NO_SHARD,
                          mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                         buffer_dtype=torch.bfloat16)),
    "zero1": dict(sharding_strategy=ShardingStrategy.SHARD_OPTIM),
    "zero1_bf16": dict(sharding_strategy=ShardingStrategy.SHARD_OPTIM,
                       mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                      buffer_dtype=torch.bfloat16)),
    # on a device: host shards staged for each gather, gradients copied out
    "cpu_offload": dict(cpu_offload=flatshard.CPUOffload(offload_params=True)),
    "cpu_offload_bf16": dict(cpu_offload=flatshard.CPUOffload(offload_params=True),
                             mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                            buffer_dtype=torch.bfloat16)),
    "backward_post": dict(backward_prefetch=flatshard.BackwardPrefetch.BACKWARD_POST,
                          mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                         buffer_dtype=torch.bfloat16)),
}


def _both(case, accumulate):
    if case == "hybrid":  # 2 "hosts" of 2 ranks: shard inside, all-reduce across
        import os
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        kw = dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                  mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                                 buffer_dtype=torch.bfloat16))
        try:
            return _both_kw(kw, accumulate)
        finally:
            del os.environ["LOCAL_WORLD_SIZE"]
    return _both_kw(CASES[case], accumulate)


def _both_kw(kw, accumulate, device_path=True):
    host = _train(kw, False, accumulate=accumulate)
    dev = _train(kw, device_path, accumulate=accumulate)
    same = host[0] == dev[0] and all(torch.equal(a, b) for a, b in zip(host[1], dev[1])) and \
        host[2].keys() == dev[2].keys() and all(torch.equal(host[2][k], dev[2][k])
                                                for k in host[2])
    return same, host[0], host[3], dev[3], dev[4], dev[5], (host[6], dev[6])


@pytest.mark.parametrize("case", sorted(CASES))
def test_device_path_trains_bit_identically_to_the_host_path(dist_pool, case):
    for same, losses, host_comms, dev_comms, ledger, seen, reduced in dist_pool(2).run(
            _both, case, False):
        assert host_comms == ["None"] and dev_comms == ["host"]
        assert same, case
        assert losses[-1] < losses[0]  # it trained
        assert ledger  # the device Comm keeps its own ledger
        # a unit computes only once its stream waited for its gather; a
        # prefetched one is still pending while the unit before it computes
        assert seen and not any(own for own, _ in seen)
        assert any(other for _, other in seen) == (case == "forward_prefetch")
        # reductions are deferred on a device only, one in flight: the next
        # unit's found the previous one still pending
        host_reduced, dev_reduced = reduced
        assert host_reduced == []
        if not case.startswith(("no_shard", "zero1")):  # (one unit; all-reduced in Python)
            assert dev_reduced and any(dev_reduced)


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("case", ["full_shard", "bf16_fp32_reduce", "no_shard", "cpu_offload",
                                  "hybrid"])
def test_device_path_with_accumulation_on_other_world_sizes(dist_pool, world, case):
    if world == 1 and case in ("full_shard", "hybrid"):
        case = "no_shard"  # one rank runs FULL_SHARD as NO_SHARD anyway
    # (CPUOffload accumulates inside no_sync only, as torch's rule says; one
    # rank with it still gathers: its shards live on the host)
    for same, *_ in dist_pool(world).run(_both, case, True):
        assert same


def _errors():
    from flatshard import _C
    from flatshard.runtime.comm import comm_for, all_reduce_
    host = comm_for(dist.group.WORLD, "torch")
    dev = host_device_comm(host)
    out = []
    try:  # a device Comm needs the allocator, and only it does
        _C.Unit("u", dev, _C.FULL_SHARD, [], 0)
    except TypeError as e:
        out.append(str(e))
    try:
        _C.Comm("device", 0, 1, capsule=host.capsule(), owner=host,
                device_api=_C.host_device_api, stream_fn=lambda: 0, empty=torch.empty)
    except ValueError as e:
        out.append(str(e))
    try:
        _C.Comm("device", host.rank, host.world_size, capsule=host.capsule(), owner=host,
                device_api=host.capsule(), stream_fn=lambda: 0, empty=torch.empty)
    except TypeError as e:
        out.append(str(e))

    def bad_stream():
        raise RuntimeError("no stream here")
    broken = _C.Comm("device", host.rank, host.world_size, capsule=host.capsule(), owner=host,
                     device_api=_C.host_device_api, stream_fn=bad_stream, empty=torch.empty)
    try:
        all_reduce_(broken, torch.ones(3))
    except RuntimeError as e:
        out.append(str(e))
    t = torch.ones(3)
    all_reduce_(dev, t)  # a working one
    out.append(t.tolist())
    # which device it moves, for comm.py's tensor checks: given, else unknown
    on3 = _C.Comm("device", host.rank, host.world_size, capsule=host.capsule(), owner=host,
                  device_api=_C.host_device_api, stream_fn=lambda: 0, empty=torch.empty,
                  device_index=3)
    out.append((on3.device_index, dev.device_index, host.device_index))
    return out


def test_device_comm_construction_errors(dist_pool):
    for msgs in dist_pool(2).run(_errors):
        assert "needs empty=callable" in msgs[0]
        assert "rank" in msgs[1] and "not 0 of 1" in msgs[1]
        assert "flatshard.fs_device_api" in msgs[2]  # the wrong capsule is named
        assert msgs[3] == "no stream here"
        assert msgs[4] == [2.0, 2.0, 2.0]
        assert msgs[5] == (3, None, None)


# ---------------------------------------------------------------------------
# fully_shard: the engine's groups (csrc/engine/shard_group.c) through the device table

def _last_dim(p):
    from torch.distributed.tensor import Shard
    return Shard(p.dim() - 1)


def _fully_shard_train(device_path, mp, raf, prefetch=False, last_dim=False):
    """device_path: False, True (the host table) or make(group, host Comm).
    prefetch: each block prefetches the next in forward and the one before
    in backward (deferred all-gathers on a device). last_dim: every
    parameter sharded on its last dim (strided copies in the engine)."""
    import flatshard.fsdp2.mesh as fmesh  # where fully_shard makes its Comms
    from flatshard import MixedPrecisionPolicy, fully_shard
    torch.manual_seed(0)
    model = build()
    saved = fmesh.comm_for
    made = {}
    make = device_path if callable(device_path) else lambda group, host: host_device_comm(host)

    def comm_for(group, backend, device=None):
        host = saved(group, backend, device)
        if id(host) not in made:
            made[id(host)] = (host, make(group, host))
        return made[id(host)][1]

    if device_path:
        fmesh.comm_for = comm_for
    try:
        kw = dict(reshard_after_forward=raf, shard_placement_fn=_last_dim if last_dim else None)
        if mp:  # "bf16": reduced in float32; "bf16_reduce": in bfloat16 (staged in float32)
            kw["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16,
                reduce_dtype=torch.float32 if mp == "bf16" else None)
        for b in list(model.blocks) + [model.head]:  # head: its input cast to bf16
            fully_shard(b, **kw)
        fully_shard(model, **kw)
        if prefetch:
            mods = list(model.blocks) + [model.head]
            for a, b in zip(mods, mods[1:]):
                a.set_modules_to_forward_prefetch([b])
                b.set_modules_to_backward_prefetch([a])
    finally:
        fmesh.comm_for = saved
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(3):
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.full_tensor() for k, v in model.state_dict().items()
             if hasattr(v, "full_tensor")}
    from flatshard.fsdp2.state import state_of
    groups = [state_of(m).group for m in model.modules()
              if state_of(m) is not None and state_of(m).group is not None]
    deferred = (sum(g.n_deferred for g in groups), sum(g.n_deferred_reduces for g in groups))
    return losses, state, len(made), deferred


def _fully_shard_both(mp, raf, device_path=True, prefetch=False, last_dim=False):
    host = _fully_shard_train(False, mp, raf, prefetch, last_dim)
    dev = _fully_shard_train(device_path, mp, raf, prefetch, last_dim)
    same = host[0] == dev[0] and all(torch.equal(host[1][k], dev[1][k]) for k in host[1])
    return same, dev[2], host[0], (host[3], dev[3])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mp,raf,last_dim", [(None, True, False), ("bf16", True, False),
                                             ("bf16_reduce", True, False), (None, 2, False),
                                             ("bf16", True, True), (None, False, True)])
def test_fully_shard_device_path_trains_bit_identically(dist_pool, world, mp, raf, last_dim):
    if raf == 2 and world != 2:
        pytest.skip("reshard_after_forward=2 needs an even world")
    for same, n_device_comms, losses, _ in dist_pool(world).run(_fully_shard_both, mp, raf,
                                                                True, False, last_dim):
        assert n_device_comms >= 1 and same
        assert losses[-1] < losses[0]


@pytest.mark.parametrize("mp", [None, "bf16_reduce"])
def test_fully_shard_prefetch_defers_gathers_on_a_device(dist_pool, mp):
    """set_modules_to_forward/backward_prefetch: on a device Comm the
    prefetched all-gathers are deferred (the copy-out waits for them at the
    module's own unshard); on a host Comm they complete at once."""
    for same, _, losses, (host_deferred, dev_deferred) in dist_pool(2).run(
            _fully_shard_both, mp, True, True, True):
        assert same and losses[-1] < losses[0]
        assert host_deferred == (0, 0) and dev_deferred[0] > 0 and dev_deferred[1] > 0
