"""The FSDP wrapper on a CUDA device (flatshard's NCCL backend, the CUDA
table of the units' device path, the CUDA optimizers and clipping).

World size 1 in this process (one GPU is enough; a process group named
"cpu:gloo,cuda:nccl" so that torch's own FSDP, the reference, runs too), and
two ranks where two GPUs are present. References: the same model trained by
plain torch on the same device, and torch FSDP1 with the same
MixedPrecision. Without a GPU every test here skips; the same C paths run on
CPU in test_device_path.py."""
import copy

import pytest
import torch
import torch.distributed as dist

import flatshard
import flatshard.optim
from flatshard import FSDP, MixedPrecision, ShardingStrategy
from toy_models import Block, build

GPU = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not GPU, reason="needs a CUDA device visible to torch")
TOL = 1e-5


@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda", torch.cuda.current_device())
    path = tmp_path_factory.mktemp("store") / "file"
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{path}", rank=0,
                            world_size=1)
    yield dev
    dist.destroy_process_group()


def _batches(dev, steps=4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 5, generator=g).to(dev), torch.randn(8, 3, generator=g).to(dev))
            for _ in range(steps)]


def _run(model, opt, batches, clip=None):
    losses, norms = [], []
    for x, y in batches:
        loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
        if clip is not None:
            norms.append(float(clip(model)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _params_rel(a, b):
    return max(((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()).item()
               for k in b if b[k].numel() and b[k].is_floating_point())


@pytest.mark.parametrize("use_orig", [False, True])
def test_fp32_matches_plain_torch_on_the_gpu(world1, use_orig):
    ref = build().to(world1)
    ours = FSDP(build().to(world1), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                device_id=world1, use_orig_params=use_orig)
    assert {m._unit.c.comm.device for m in ours.modules() if isinstance(m, FSDP)} == \
        {"cuda" if world1.type == "cuda" else None}
    batches = _batches(world1)
    mine = _run(ours, torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9), batches)
    theirs = _run(ref, torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9), batches)
    assert _rel(mine[0], theirs[0]) <= TOL
    assert _params_rel(ours.state_dict(), ref.state_dict()) <= TOL
    for v in ours.state_dict().values():
        assert v.device == world1


def test_zero1_on_the_gpu_matches_plain_torch(world1):
    """SHARD_OPTIM: whole parameters and gradients on the device, the
    optimizer over this rank's shard, parameters gathered after each step."""
    ref = build().to(world1)
    ours = FSDP(build().to(world1), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                device_id=world1, sharding_strategy=ShardingStrategy.SHARD_OPTIM)
    batches = _batches(world1)
    mine = _run(ours, flatshard.optim.AdamW(ours.parameters(), lr=0.01), batches)
    theirs = _run(ref, torch.optim.AdamW(ref.parameters(), lr=0.01), batches)
    assert _rel(mine[0], theirs[0]) <= TOL
    assert _params_rel(ours.state_dict(), ref.state_dict()) <= TOL


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16])
def test_bf16_mixed_precision_matches_torch_fsdp(world1, strategy, reduce_dtype):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMP
    from torch.distributed.fsdp import ShardingStrategy as TS
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    kw = dict(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, buffer_dtype=torch.bfloat16)
    # FULL_SHARD also prefetches forward (deferred all-gathers); both defer reductions
    fwd = strategy == "FULL_SHARD"
    ours = FSDP(build().to(world1), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                device_id=world1, sharding_strategy=ShardingStrategy[strategy],
                mixed_precision=MixedPrecision(**kw), forward_prefetch=fwd)
    theirs = TorchFSDP(build().to(world1), auto_wrap_policy=ModuleWrapPolicy({Block}),
                       device_id=world1, sharding_strategy=TS[strategy],
                       mixed_precision=TorchMP(**kw), forward_prefetch=fwd)
    batches = _batches(world1)
    mine = _run(ours, torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9), batches)
    ref = _run(theirs, torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9), batches)
    assert _rel(mine[0], ref[0]) <= TOL
    assert _params_rel(ours.state_dict(), theirs.state_dict()) <= TOL
    # the gathered bf16 buffers are given back after each step, and nothing is left pending
    assert flatshard.memory_stats(ours)["unsharded"] == 0
    units = [m._unit.c for m in ours.modules() if isinstance(m, FSDP)]
    assert not any(u.gather_pending or u.reduce_pending for u in units)


def test_cuda_optimizers_and_clipping_match_torch(world1):
    ref = build().to(world1)
    ours = FSDP(build().to(world1), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                device_id=world1, use_orig_params=True)
    batches = _batches(world1, steps=5)
    mine = _run(ours, flatshard.optim.AdamW(ours.parameters(), lr=0.01, weight_decay=0.1),
                batches, clip=lambda m: m.clip_grad_norm_(0.5))
    theirs = _run(ref, torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1), batches,
                  clip=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
    assert _rel(mine[1], theirs[1]) <= TOL  # the norms
    assert _rel(mine[0], theirs[0]) <= TOL
    assert _params_rel(ours.state_dict(), ref.state_dict()) <= TOL


def test_sgd_and_inf_norm_on_the_gpu(world1):
    ref = build().to(world1)
    ours = FSDP(build().to(world1), device_id=world1)
    batches = _batches(world1)
    kw = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)
    mine = _run(ours, flatshard.optim.SGD(ours.parameters(), **kw), batches,
                clip=lambda m: m.clip_grad_norm_(0.1, norm_type=float("inf")))
    theirs = _run(ref, torch.optim.SGD(ref.parameters(), **kw), batches,
                  clip=lambda m: torch.nn.utils.clip_grad_norm_(
                      [p for p in m.parameters() if p.numel()], 0.1, norm_type=float("inf")))
    assert _rel(mine[1], theirs[1]) <= TOL
    assert _params_rel(ours.state_dict(), ref.state_dict()) <= TOL


@pytest.mark.parametrize("mp,last_dim", [(False, False), (True, False), (False, True),
                                         (True, True)])
def test_fully_shard_matches_torch_on_the_gpu(world1, mp, last_dim):
    """flatshard.fully_shard on a CUDA mesh against torch's fully_shard (the
    same mixed precision policy) and, in fp32, plain torch. last_dim: every
    parameter sharded on its last dim (the engine's strided copies)."""
    from torch.distributed.tensor import Shard
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy as TorchMP
        from torch.distributed._composable.fsdp import fully_shard as torch_fully_shard
    def model_for_both():  # torch's fully_shard refuses zero-size parameters: a buffer here
        model = build()
        for b in model.blocks:
            del b.ff.empty
            b.ff.register_buffer("empty", torch.zeros(0, 4))
        return model.to(world1)

    models = []
    for shard, policy in ((flatshard.fully_shard, flatshard.MixedPrecisionPolicy),
                          (torch_fully_shard, TorchMP)):
        model = model_for_both()
        kw = dict(mp_policy=policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)) \
            if mp else {}
        if last_dim:
            kw["shard_placement_fn"] = lambda p: Shard(p.dim() - 1)
        for b in list(model.blocks) + [model.head]:
            shard(b, **kw)
        shard(model, **kw)
        models.append(model)
    plain = model_for_both()
    batches = _batches(world1)
    runs = [_run(m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), batches)
            for m in models + ([] if mp else [plain])]
    assert _rel(runs[0][0], runs[1][0]) <= TOL
    full = [{k: v.full_tensor() if hasattr(v, "full_tensor") else v
             for k, v in m.state_dict().items()} for m in models]
    assert _params_rel(full[0], full[1]) <= TOL
    if not mp:
        assert _params_rel(full[0], plain.state_dict()) <= TOL


def test_summon_and_state_dict_keys_on_the_gpu(world1):
    plain = build().to(world1)
    ours = FSDP(copy.deepcopy(plain), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                device_id=world1, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    sd = ours.state_dict()
    assert list(sd) == list(plain.state_dict())
    want = dict(plain.named_parameters())
    with FSDP.summon_full_params(ours):
        inside = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in ours.named_parameters()}
        assert set(inside) == set(want)
        for n, p in inside.items():  # the fp32 masters, whole, on the device
            assert p.dtype == torch.float32 and torch.equal(p, want[n]), n


@pytest.mark.parametrize("mp", [False, True])
def test_cpu_offload_on_the_gpu_matches_plain_torch(world1, mp):
    """CPUOffload(offload_params=True): shards and gradients in pinned host
    memory, the optimizer on the host, the same training as plain torch."""
    ref = build().to(world1)
    kw = dict(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
                                             buffer_dtype=torch.bfloat16)) if mp else {}
    ours = FSDP(build().to(world1), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                device_id=world1, cpu_offload=flatshard.CPUOffload(offload_params=True), **kw)
    shards = list(ours.parameters())
    assert all(p.device.type == "cpu" and (p.is_pinned() or not GPU) for p in shards)
    batches = _batches(world1)
    mine = _run(ours, flatshard.optim.AdamW(shards, lr=0.01, weight_decay=0.1), batches,
                clip=lambda m: m.clip_grad_norm_(0.5))
    theirs = _run(ref, torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1), batches,
                  clip=lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5))
    tol = 5e-2 if mp else TOL  # bf16 compute against fp32: the same training, loosely
    assert _rel(mine[0], theirs[0]) <= tol and _rel(mine[1], theirs[1]) <= tol
    sd = ours.state_dict()
    assert _params_rel(sd, ref.state_dict()) <= tol
    assert all(p.grad is None or p.grad.device.type == "cpu" for p in shards)


def test_the_wrapper_refuses_what_the_cuda_path_lacks(world1):
    with pytest.raises(flatshard.NotBuiltError, match="cpu_offload"):
        FSDP(build().to(world1), device_id=world1, sharding_strategy=ShardingStrategy.NO_SHARD,
             cpu_offload=flatshard.CPUOffload(offload_params=True))
    with pytest.raises(flatshard.NotBuiltError, match="cpu_offload.*SHARD_OPTIM"):
        FSDP(build().to(world1), device_id=world1, sharding_strategy=ShardingStrategy.SHARD_OPTIM,
             cpu_offload=flatshard.CPUOffload(offload_params=True))
    with pytest.raises(flatshard.ConfigError, match="comm_backend='shm'"):
        FSDP(build().to(world1), device_id=world1, comm_backend="shm")
    with pytest.raises(flatshard.ConfigError, match="device_id"):
        FSDP(build(), device_id=world1)  # the module is still on the CPU


def _two_gpu_worker(rank, path, results):
    torch.cuda.set_device(rank)
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"file://{path}", rank=rank,
                            world_size=2)
    try:
        dev = torch.device("cuda", rank)
        out = {}
        for name, kw in (("full", {}), ("bf16", dict(mixed_precision=MixedPrecision(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                buffer_dtype=torch.bfloat16)))):
            model = FSDP(build().to(dev), auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                         device_id=dev, **kw)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            losses = []
            for x, y in _batches(dev):
                half = slice(4 * rank, 4 * rank + 4)  # each rank its half of the batch
                loss = ((model(x[half]).float() - y[half]) ** 2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            out[name] = (losses, {k: v.cpu() for k, v in model.state_dict().items()})
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_match_one_process(tmp_path):
    import torch.multiprocessing as mp
    results = mp.Manager().dict()
    mp.spawn(_two_gpu_worker, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
    ref = build().cuda()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    ref_losses = []
    for x, y in _batches(torch.device("cuda")):
        halves = [((ref(x[s]) - y[s]) ** 2).mean() for s in (slice(0, 4), slice(4, 8))]
        ((halves[0] + halves[1]) / 2).backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append([h.item() for h in halves])
    sd = {k: v.cpu() for k, v in ref.state_dict().items()}
    for rank in range(2):
        losses, state = results[rank]["full"]
        assert _rel(losses, [r[rank] for r in ref_losses]) <= TOL
        assert _params_rel(state, sd) <= TOL
        losses, state = results[rank]["bf16"]  # bf16 compute: loose, but the same training
        assert _rel(losses, [r[rank] for r in ref_losses]) <= 5e-2
