"""Sharded checkpoints through torch.distributed.checkpoint: saved on N ranks
and loaded on M (N, M in 1..4) with bit-identical parameters; checkpoints of
torch's FSDP1 and FSDP2 loaded by flatshard and the other way round;
save_checkpoint / load_checkpoint with optimizer state resuming exactly; a
rank killed in the middle of a save leaves the previous checkpoint loadable;
a checkpoint that does not fit the model is refused naming the keys."""
import contextlib
import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

import flatshard
from flatshard import FSDP, ShardingStrategy, StateDictType
from parity import batches, optimizer, policy, train_steps as _steps
from toy_models import build

MODEL = {"nested": True, "tied": True, "frozen": True}


def _wrap(strategy="FULL_SHARD", use_orig=False, seed=0, **kw):
    return FSDP(build(seed=seed, **{**MODEL, **kw}), sharding_strategy=ShardingStrategy[strategy],
                auto_wrap_policy=policy("nested"), use_orig_params=use_orig)


def _full(model, opt=None):
    """Rank 0's full model (and optimizer) state, to compare across runs."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        sd = model.state_dict()
        osd = FSDP.optim_state_dict(model, opt) if opt is not None else None
    return (sd, osd) if dist.get_rank() == 0 else None


def _same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


# ---------------------------------------------------------------------------
# plain DCP on SHARDED_STATE_DICT: N ranks -> M ranks


def _dcp_save(path):
    model = _wrap()
    _steps(model, optimizer("adamw", model.parameters()),
           batches(2, 2, dist.get_world_size(), seed=dist.get_world_size()))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict()}, checkpoint_id=path)
    return _full(model)


def _dcp_load_each(paths, strategy, use_orig):
    out = []
    for path in paths:
        model = _wrap(strategy, use_orig, seed=3)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict()}
            dcp.load(state, checkpoint_id=path)
            model.load_state_dict(state["model"])
        out.append(_full(model))
    return out


def test_dcp_checkpoints_reshard_from_any_world_to_any_world(dist_pool, tmp_path):
    saved = {n: dist_pool(n).run(_dcp_save, str(tmp_path / f"w{n}"))[0] for n in (1, 2, 3, 4)}
    paths = [str(tmp_path / f"w{n}") for n in saved]
    for m, (strategy, use_orig) in zip((1, 2, 3, 4), [("FULL_SHARD", False),
                                                      ("SHARD_GRAD_OP", True),
                                                      ("FULL_SHARD", True),
                                                      ("NO_SHARD", False)]):
        loaded = dist_pool(m).run(_dcp_load_each, paths, strategy, use_orig)[0]
        for n, got in zip(saved, loaded):
            assert _same(got[0], saved[n][0]), f"saved on {n} ranks, loaded on {m}"
    # The four saves really differ (each world trained on its own data).
    assert not torch.equal(saved[1][0]["head.weight"], saved[2][0]["head.weight"])


# ---------------------------------------------------------------------------
# torch FSDP1 and FSDP2 checkpoints, both ways


def _mlp(seed):
    """No zero-size parameter: torch FSDP1's own sharded loading raises
    ZeroDivisionError on a parameter whose first dimension is 0."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3))


def _torch_sharded(kind, plain):
    """plain wrapped by torch FSDP1, or FSDP2 (fully_shard), one unit per block."""
    from torch.distributed import fsdp as tfsdp
    units = list(plain.blocks) if hasattr(plain, "blocks") else [plain[1]]
    if kind == "fsdp1":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return tfsdp.FullyShardedDataParallel(
            plain, auto_wrap_policy=ModuleWrapPolicy({type(units[0])}),
            device_id=torch.device("cpu"))
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for m in units:
        tfsdp.fully_shard(m, mesh=mesh)
    return tfsdp.fully_shard(plain, mesh=mesh)


def _plain_of(model_name, seed):
    return _mlp(seed) if model_name == "mlp" else build(seed=seed, nested=True)


def _sharded_io(model, save, path):
    """dcp.save / dcp.load {"model": SHARDED state dict} of a flatshard or torch model."""
    from torch.distributed import fsdp as tfsdp
    TorchFSDP = tfsdp.FullyShardedDataParallel
    ctx = (TorchFSDP.state_dict_type(model, tfsdp.StateDictType.SHARDED_STATE_DICT)
           if isinstance(model, TorchFSDP) else
           FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
           if isinstance(model, FSDP) else contextlib.nullcontext())
    with ctx:
        state = {"model": model.state_dict()}
        if save:
            dcp.save(state, checkpoint_id=path)
            return
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])


def _interop_save(who, model_name, path):
    plain = _plain_of(model_name, seed=2)
    model = FSDP(plain, auto_wrap_policy=policy("nested")) if who == "flatshard" \
        else _torch_sharded(who, plain)
    _sharded_io(model, True, path)


def _interop_load(who, model_name, path):
    plain = _plain_of(model_name, seed=5)
    if who == "flatshard":  # load_checkpoint reads any DCP checkpoint of {"model": ...}
        model = FSDP(plain, auto_wrap_policy=policy("nested"))
        flatshard.load_checkpoint(path, model)
    else:
        model = _torch_sharded(who, plain)
        _sharded_io(model, False, path)
    want = _plain_of(model_name, seed=2).state_dict()
    if who == "fsdp1":
        from torch.distributed import fsdp as tfsdp
        with tfsdp.FullyShardedDataParallel.state_dict_type(
                model, tfsdp.StateDictType.FULL_STATE_DICT):
            got = model.state_dict()
    else:
        got = {k: v.full_tensor() if hasattr(v, "full_tensor") else v
               for k, v in model.state_dict().items()}
    return sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())


@pytest.mark.parametrize("theirs", ["fsdp1", "fsdp2"])
def test_torch_fsdp_checkpoints_load_into_flatshard_and_back(dist_pool, tmp_path, theirs):
    # torch on 2 ranks -> flatshard on 3, and flatshard on 3 -> torch on 2.
    dist_pool(2).run(_interop_save, theirs, "toy", str(tmp_path / "theirs"))
    assert dist_pool(3).run(_interop_load, "flatshard", "toy", str(tmp_path / "theirs")) == \
        [True] * 3
    back = "mlp" if theirs == "fsdp1" else "toy"
    dist_pool(3).run(_interop_save, "flatshard", back, str(tmp_path / "ours"))
    assert dist_pool(2).run(_interop_load, theirs, back, str(tmp_path / "ours")) == [True] * 2


def _resume_through_load_sharded_optimizer_state_dict(path, use_orig):
    """torch's documented SHARDED resume of FSDP1: dcp.save of the model and
    FSDP.optim_state_dict, then dcp.load of the model,
    load_sharded_optimizer_state_dict (ShardedTensors chunked over the
    ranks) and FSDP.optim_state_dict_to_load."""
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    data = batches(5, 2, dist.get_world_size(), seed=4)
    straight = _wrap(use_orig=use_orig)
    want = _steps(straight, optimizer("adamw", straight.parameters()), data)
    first = _wrap(use_orig=use_orig)
    opt = optimizer("adamw", first.parameters())
    got = _steps(first, opt, data[:2])
    with FSDP.state_dict_type(first, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": first.state_dict(), "optim": FSDP.optim_state_dict(first, opt)},
                 checkpoint_id=path)
    again = _wrap(use_orig=use_orig, seed=5)
    opt2 = optimizer("adamw", again.parameters())
    with FSDP.state_dict_type(again, StateDictType.SHARDED_STATE_DICT):
        state = {"model": again.state_dict()}
        dcp.load(state, checkpoint_id=path)
        again.load_state_dict(state["model"])
        osd = load_sharded_optimizer_state_dict(model_state_dict=state["model"],
                                                optimizer_key="optim",
                                                storage_reader=dcp.FileSystemReader(path))
        opt2.load_state_dict(FSDP.optim_state_dict_to_load(again, opt2, osd["optim"]))
    got += _steps(again, opt2, data[2:])
    return got == want, got, want


@pytest.mark.parametrize("use_orig", [False, True])
def test_resume_through_torchs_load_sharded_optimizer_state_dict(dist_pool, tmp_path, use_orig):
    for same, got, want in dist_pool(2).run(_resume_through_load_sharded_optimizer_state_dict,
                                            str(tmp_path / "ckpt"), use_orig):
        assert same, (got, want)


# ---------------------------------------------------------------------------
# save_checkpoint / load_checkpoint with the optimizer


def _train_and_save(path, use_orig):
    world = dist.get_world_size()
    data = batches(5, 2, world, seed=21)
    straight = _wrap(use_orig=use_orig)
    want = _steps(straight, optimizer("adamw", straight.parameters()), data)
    model = _wrap(use_orig=use_orig)
    opt = optimizer("adamw", model.parameters())
    _steps(model, opt, data[:3])
    where = flatshard.save_checkpoint(path, model, opt, extra={"step": 3, "seen": torch.ones(2)})
    return want, _full(model, opt), where


def _load_and_continue(path, use_orig):
    world = dist.get_world_size()
    data = batches(5, 2, world, seed=21)
    model = _wrap(use_orig=use_orig, seed=8)
    opt = optimizer("adamw", model.parameters())
    extra = flatshard.load_checkpoint(path, model, opt)
    full = _full(model, opt)
    return extra, full, _steps(model, opt, data[extra["step"]:])


@pytest.mark.parametrize("use_orig", [False, True])
def test_checkpoint_resumes_exactly_and_reshards_optimizer_state(dist_pool, tmp_path, use_orig):
    path = str(tmp_path / "run")
    want, saved, where = dist_pool(2).run(_train_and_save, path, use_orig)[0]
    assert where == os.path.join(path, "ckpt-000001")
    assert sorted(os.listdir(path)) == ["LATEST", "ckpt-000001"]
    extra, full, losses = dist_pool(2).run(_load_and_continue, path, use_orig)[0]
    assert losses == want[3:]  # bit-exact continuation on the same world size
    assert extra["step"] == 3 and torch.equal(extra["seen"], torch.ones(2))
    assert _same(full, saved)
    for world in (1, 3):  # other world sizes: parameters and optimizer state identical
        _, full, _ = dist_pool(world).run(_load_and_continue, path, use_orig)[0]
        assert _same(full, saved), world


# ---------------------------------------------------------------------------
# a rank killed in the middle of a save


def _first_checkpoint(path):
    model = _wrap()
    opt = optimizer("sgd", model.parameters())
    _steps(model, opt, batches(1, 2, 2, seed=1))
    flatshard.save_checkpoint(path, model, opt)
    return _full(model, opt)


def _save_and_die(path):
    model = _wrap()
    opt = optimizer("sgd", model.parameters())
    flatshard.load_checkpoint(path, model, opt)
    _steps(model, opt, batches(1, 2, 2, seed=2))
    if dist.get_rank() == 1:
        write = dcp.FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write(self, plan, planner).wait()  # this rank's shard is on disk...
            os.kill(os.getpid(), signal.SIGKILL)  # ...and the rank dies before the metadata
        dcp.FileSystemWriter.write_data = write_then_die
    flatshard.save_checkpoint(path, model, opt)


def _load_after_crash(path):
    leftovers = sorted(os.listdir(path))
    model = _wrap(seed=5)
    opt = optimizer("sgd", model.parameters())
    flatshard.load_checkpoint(path, model, opt)
    full = _full(model, opt)
    flatshard.save_checkpoint(path, model, opt)  # the next save clears the debris
    return leftovers, full, sorted(os.listdir(path))


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(dist_pool, tmp_path):
    path = str(tmp_path / "run")
    first = dist_pool(2).run(_first_checkpoint, path)[0]
    with pytest.raises(AssertionError, match="rank 1 died"):
        dist_pool(2).run(_save_and_die, path)
    leftovers, full, after = dist_pool(2).run(_load_after_crash, path)[0]
    assert leftovers == [".tmp-ckpt-000002", "LATEST", "ckpt-000001"]
    assert _same(full, first)
    assert after == ["LATEST", "ckpt-000002"]


# ---------------------------------------------------------------------------
# a checkpoint that does not fit the model


def _mismatch(path):
    model = _wrap()
    flatshard.save_checkpoint(path, model)
    out = []
    for kw in [{"d": 9}, {"tied": False}, {"dtype": torch.float64}]:
        dtype = kw.pop("dtype", None)
        inner = build(seed=4, **{**MODEL, **kw})
        other = FSDP(inner.to(dtype) if dtype else inner, auto_wrap_policy=policy("nested"))
        before = _full(other)
        try:
            flatshard.load_checkpoint(path, other)
            out.append("loaded")
        except flatshard.StateDictError as e:
            out.append(str(e))
        after = _full(other)
        assert after is None or _same(after, before)  # nothing loaded
    opt = optimizer("sgd", model.parameters())
    try:
        flatshard.load_checkpoint(path, model, opt)
    except flatshard.StateDictError as e:
        out.append(str(e))
    assert not opt.state  # still fresh: no made-up first step left behind
    return out


def test_mismatching_checkpoints_name_the_first_keys(dist_pool, tmp_path):
    shape, names, dtype, no_optim = dist_pool(2).run(_mismatch, str(tmp_path / "run"))[0]
    assert "shape mismatch for model.inp.weight: [7, 5] in the checkpoint, [9, 5]" in shape
    assert 'Unexpected key(s): "model.out.weight"' in names
    assert "dtype mismatch for model.inp.weight: torch.float32 in the checkpoint" in dtype
    assert 'Missing key(s): "optim.param_groups.0.lr"' in no_optim  # saved without one
