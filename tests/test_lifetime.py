"""A wrapped model is freed when the user drops it, as the same model wrapped
by torch is: after training steps (gradient hooks registered, engine groups
holding the parameters), `del model` and one collection leave no module,
parameter, engine group or gradient alive ([Note: hooks hold their state
weakly] in runtime/grad_hooks.py). The reference is torch's own fully_shard
and FSDP1, checked the same way in the same process."""
import gc
import weakref

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from flatshard import CPUOffload, FullyShardedDataParallel, fully_shard

TIMEOUT = 180


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5), nn.Linear(5, 3))


def _wrap(kind):
    import torch.distributed as dist
    model = _net()
    if kind in ("fully_shard", "torch-fully_shard"):
        shard = fully_shard if kind == "fully_shard" else torch_fully_shard
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in (model[0], model[2], model[3]):
            shard(m, mesh=mesh)
        shard(model, mesh=mesh)
        return model
    if kind == "fsdp1-offload":
        return FullyShardedDataParallel(model, cpu_offload=CPUOffload(offload_params=True))
    extra = {} if kind == "fsdp1" else {"device_id": torch.device("cpu")}
    wrapper = FullyShardedDataParallel if kind == "fsdp1" else TorchFSDP
    return wrapper(model, auto_wrap_policy=lambda module, recurse, nonwrapped_numel:
                   recurse or isinstance(module, nn.Linear), use_orig_params=True, **extra)


def _train_and_drop(kind):
    """Three optimizer steps, then every reference dropped: -> what is still
    alive after one collection (names), and the first loss."""
    model = _wrap(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(3):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    refs = {"model": weakref.ref(model)}
    for i, p in enumerate(model.parameters()):
        refs[f"parameter {i}"] = weakref.ref(p)
    for i, m in enumerate(model.modules()):
        refs[f"module {i}"] = weakref.ref(m)
    del model, opt, loss, p, m
    gc.collect()
    return sorted(name for name, r in refs.items() if r() is not None), losses[0]


def _alive(kinds):
    return {kind: _train_and_drop(kind) for kind in kinds}


def test_models_are_freed_like_torchs(dist_pool):
    kinds = ["torch-fully_shard", "fully_shard", "torch-fsdp1", "fsdp1", "fsdp1-offload"]
    for res in dist_pool(2).run(_alive, kinds, timeout=TIMEOUT):
        assert res["torch-fully_shard"][0] == [], res  # the reference holds
        assert res["torch-fsdp1"][0] == [], res
        for kind in ("fully_shard", "fsdp1", "fsdp1-offload"):
            assert res[kind][0] == [], (kind, res[kind])
        # the same training as torch's (the test trains, not only builds)
        assert res["fully_shard"][1] == res["torch-fully_shard"][1]
        assert res["fsdp1"][1] == res["torch-fsdp1"][1]


def _engine_groups_freed():
    """The engine objects themselves (no weak references to them): the live
    ones of each type counted before, while a model lives, and after."""
    from flatshard import _C

    def count():
        gc.collect()
        return sum(1 for o in gc.get_objects() if type(o) in (_C.ShardGroup, _C.Unit))
    before = count()
    models = [_wrap("fully_shard"), _wrap("fsdp1")]
    for m in models:
        m(torch.randn(2, 8)).sum().backward()
    during = count()
    del models, m
    _train_and_drop("fully_shard")
    _train_and_drop("fsdp1")
    return before, during, count()


def test_engine_groups_are_collected(dist_pool):
    for before, during, after in dist_pool(2).run(_engine_groups_freed, timeout=TIMEOUT):
        assert during >= before + 6, (before, during)  # 3 groups + 3 units (+ the root's)
        assert after == before, (before, during, after)


def _offload_pipeline_freed(api):
    """overlap_offload's pipeline (its hooks on every parameter) with the
    host-emulated device path of test_offload_pipeline: the model, its
    pipeline and the optimizer are freed once dropped."""
    import test_offload_pipeline as top
    import flatshard
    from flatshard.optim import AdamW
    model = top._build(api, True)
    opt = AdamW(model.parameters(), lr=0.02, threads=1)
    pipe = flatshard.overlap_offload(model, opt, flatshard.OverlapOffload(max_units_in_flight=2))
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        model(torch.randn(4, 5, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    refs = {"model": weakref.ref(model), "pipeline": weakref.ref(pipe),
            "optimizer": weakref.ref(opt)}
    refs.update({f"parameter {i}": weakref.ref(p) for i, p in enumerate(model.parameters())})
    del model, opt, pipe
    gc.collect()
    return sorted(name for name, r in refs.items() if r() is not None)


def test_overlap_offload_is_freed(dist_pool):
    for api in ("fsdp", "fully_shard"):
        for alive in dist_pool(2).run(_offload_pipeline_freed, api, timeout=TIMEOUT):
            assert alive == [], (api, alive)
