"""flatshard.use_for_torch_fsdp(): code that imports torch's FSDP APIs runs on
flatshard, and restore_torch_fsdp() puts torch's back.

  every path torch has the names at (read from the torch installed) holds
  flatshard's object while the switch is on, and torch's very object after
  the undo; an import executed after the switch gets flatshard's; a module
  imported before it that bound torch's names gets flatshard's too;
  torch's policies that flatshard takes as they are stay torch's;
  refused, naming what, while a module wrapped by torch's fully_shard or
  FSDP1 class is alive; accepted once it is dropped;
  one line on rank 0 only;
  accelerate's FSDP2 loop (Accelerator, FullyShardedDataParallelPlugin with
  fsdp_version=2, transformer-based wrapping) on 2 gloo ranks, with the
  switch and with torch's own fully_shard in the same run: the same losses
  bit for bit, and the switched model's modules are flatshard's FSDPModule;
  in fp32, and in bf16 with save_state / load_state (sharded) and the full
  state dict (get_state_dict) equal to torch's too;
  torch's FSDP1 class with torch's option objects built before the switch,
  against torch's FSDP1 in the same run;
  `python -m flatshard run` (-m MODULE in this process; a script on the
  pool's 2 ranks, as torchrun's ranks run it).

Each case undoes the switch before it returns: the pool's ranks are shared
with the other test modules."""
import contextlib
import importlib
import io
import os
import sys
import types

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flatshard
from flatshard import ConfigError
from flatshard.__main__ import main as flatshard_main
from parity import RTOL
from test_fully_shard_torch_flows import Block, Net as FlowsNet

TIMEOUT = 240

# Where torch exposes its FSDP APIs (those present in the installed torch).
PATHS = ["torch.distributed.fsdp", "torch.distributed.fsdp.api", "torch.distributed.fsdp.wrap",
         "torch.distributed.fsdp.fully_sharded_data_parallel",
         "torch.distributed.fsdp._fully_shard", "torch.distributed.fsdp._fully_shard._fully_shard",
         "torch.distributed._composable.fsdp", "torch.distributed._composable.fsdp.fully_shard"]
# Names each is expected to hand over, where the path has them: FSDP1's class
# and options, fully_shard's API, the wrap policies, the state-dict types.
SWAPPED = ["FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "MixedPrecision",
           "CPUOffload", "StateDictType", "FullStateDictConfig", "ShardedStateDictConfig",
           "FullOptimStateDictConfig", "StateDictSettings", "OptimStateKeyType", "fully_shard",
           "FSDPModule", "register_fsdp_forward_method", "UnshardHandle", "ModuleWrapPolicy",
           "CustomPolicy", "transformer_auto_wrap_policy", "size_based_auto_wrap_policy",
           "lambda_auto_wrap_policy"]
# torch's objects that flatshard takes as they are: still torch's.
KEPT = ["MixedPrecisionPolicy", "CPUOffloadPolicy", "OffloadPolicy", "FlatParameter",
        "enable_wrap", "always_wrap_policy"]


def _snapshot():
    return {(p, n): getattr(importlib.import_module(p), n) for p in PATHS
            for n in SWAPPED + KEPT if hasattr(importlib.import_module(p), n)}


@contextlib.contextmanager
def _switched():
    switch = flatshard.use_for_torch_fsdp(announce=False)
    try:
        yield switch
    finally:
        switch.restore()


def test_every_path_holds_flatshards_objects_until_restored():
    before = _snapshot()
    assert flatshard.torch_fsdp_switch() is None
    framework = types.ModuleType("a_framework")  # bound torch's names at its import
    exec("from torch.distributed.fsdp import fully_shard, FSDPModule\n"
         "from torch.distributed.fsdp import FullyShardedDataParallel as FSDP", vars(framework))
    sys.modules["a_framework"] = framework
    try:
        with _switched() as switch:
            assert flatshard.use_for_torch_fsdp() is switch  # again: the same switch
            for (path, name), theirs in before.items():
                now = getattr(importlib.import_module(path), name)
                want = theirs if name in KEPT else getattr(flatshard, name)
                assert now is want, (path, name)
                if name not in KEPT:
                    assert now is not theirs
            scope = {}
            exec("from torch.distributed.fsdp import fully_shard, FSDPModule\n"
                 "from torch.distributed._composable.fsdp import fully_shard as composable\n"
                 "from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy", scope)
            assert scope["fully_shard"] is flatshard.fully_shard
            assert scope["composable"] is flatshard.fully_shard
            assert scope["FSDPModule"] is flatshard.FSDPModule
            assert scope["transformer_auto_wrap_policy"] is flatshard.transformer_auto_wrap_policy
            assert framework.fully_shard is flatshard.fully_shard
            assert framework.FSDP is flatshard.FSDP
            # torch's state-dict helpers keep torch's FSDP1 class (their FSDP1
            # path reads torch's own unit state).
            import torch.distributed.checkpoint.state_dict as dcp_sd
            assert dcp_sd.FSDP is before[("torch.distributed.fsdp", "FullyShardedDataParallel")]
        assert flatshard.torch_fsdp_switch() is None
        assert _snapshot() == before
        assert framework.fully_shard is before[("torch.distributed.fsdp", "fully_shard")]
        flatshard.restore_torch_fsdp()  # off already: nothing happens
        assert _snapshot() == before
    finally:
        del sys.modules["a_framework"]


def test_bad_argument():
    with pytest.raises(ConfigError, match="announce"):
        flatshard.use_for_torch_fsdp(announce="yes")
    assert flatshard.torch_fsdp_switch() is None


# ------------------------------------------------------------ on 2 ranks --

class Net(FlowsNet):
    """test_fully_shard_torch_flows' model (uneven shards on 2 ranks), with the
    block class accelerate's auto-wrap policy reads."""
    _no_split_modules = ["Block"]


def _net():
    torch.manual_seed(0)
    return Net()


def _refusals():
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    out = []
    for build in (lambda: torch_fully_shard(_net()),
                  lambda: TorchFSDP(_net(), device_id=torch.device("cpu"))):
        model = build()
        try:
            flatshard.use_for_torch_fsdp(announce=False)
            out.append(None)
        except ConfigError as e:
            out.append(str(e))
        flatshard.restore_torch_fsdp()
        del model
    with _switched() as switch:  # nothing of torch's alive now
        out.append(switch.active)
    return out


def test_refused_while_torch_wraps_a_live_module(dist_pool):
    for fs, fsdp1, then in dist_pool(2).run(_refusals, timeout=TIMEOUT):
        assert fs and "torch's own FSDP already wraps" in fs and "FSDPNet" in fs
        assert fsdp1 and "FullyShardedDataParallel" in fsdp1 and "use_for_torch_fsdp" in fsdp1
        assert then is True


def _announce():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        switch = flatshard.use_for_torch_fsdp()
    switch.restore()
    return err.getvalue()


def test_one_line_on_rank_0(dist_pool):
    first, second = dist_pool(2).run(_announce, timeout=TIMEOUT)
    assert second == ""
    assert first.count("\n") == 1 and first.startswith("flatshard: torch's FSDP APIs now run on "
                                                       "flatshard")
    for name in ("FullyShardedDataParallel", "fully_shard", "FSDPModule", "StateDictType"):
        assert name in first


@pytest.mark.parametrize("env,says", [({"RANK": "0", "LOCAL_RANK": "1"}, True),
                                       ({"RANK": "1"}, False), ({"LOCAL_RANK": "1"}, False),
                                       ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False), ({}, True)])
def test_rank_0_before_the_process_group_exists(monkeypatch, capsys, env, says):
    # Lightning's own launcher starts the other ranks with LOCAL_RANK (and
    # NODE_RANK) set, no RANK; torchrun sets RANK.
    assert not dist.is_initialized()
    for name in ("RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    flatshard.use_for_torch_fsdp().restore()
    assert ("torch's FSDP APIs now run on flatshard" in capsys.readouterr().err) is says


@contextlib.contextmanager
def _accelerate_env():
    """accelerate reads the ranks from the environment; its state is a
    process-wide singleton: both are put back afterwards."""
    from accelerate.state import AcceleratorState
    saved = dict(os.environ)
    os.environ.update(RANK=str(dist.get_rank()), WORLD_SIZE=str(dist.get_world_size()),
                      LOCAL_RANK=str(dist.get_rank()),
                      LOCAL_WORLD_SIZE=str(dist.get_world_size()))
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        os.environ.clear()
        os.environ.update(saved)


def _accelerate_fsdp2(mixed_precision, ckpt_dir, steps=4):
    """accelerate's FSDP2 loop as its docs write it. accelerate picks FSDP
    only on accelerator devices; on CPU its state is set to FSDP by hand,
    after which prepare() takes its FSDP2 path (fully_shard per Block, on
    the tail and on the root). With ckpt_dir: save_state (sharded: DCP)
    after the first step, the full state dict at the end, then load_state and one more
    forward (whose loss is the first step's model's)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType
    with _accelerate_env():
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2,
                                                auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=["Block"],
                                                state_dict_type="SHARDED_STATE_DICT")
        accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, mixed_precision=mixed_precision)
        state = AcceleratorState()
        state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        if mixed_precision != "no":  # what accelerate's state does when it picks FSDP
            plugin.set_mixed_precision(mixed_precision)
        model = _net()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model, opt = accelerator.prepare(model, opt)
        from torch.distributed.fsdp import FSDPModule  # what accelerate checks against
        sharded = [isinstance(m, FSDPModule) for m in (model, *model.blocks)]
        ours = [isinstance(m, flatshard.FSDPModule) for m in (model, *model.blocks)]
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        losses, full = [], None
        for step in range(steps):
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if ckpt_dir and step == 0:
                accelerator.save_state(ckpt_dir)
        if ckpt_dir:
            full = {k: v.float() for k, v in accelerator.get_state_dict(model).items()}
            accelerator.load_state(ckpt_dir)
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            losses.append(nn.functional.mse_loss(model(x), y).item())
        return losses, sharded, ours, full


def _accelerate_both(mixed_precision, ckpt_dir):
    with _switched():
        ours = _accelerate_fsdp2(mixed_precision, ckpt_dir and os.path.join(ckpt_dir, "ours"))
    return ours, _accelerate_fsdp2(mixed_precision, ckpt_dir and os.path.join(ckpt_dir, "torch"))


@pytest.mark.parametrize("mixed_precision,checkpoint", [("no", False), ("bf16", True)],
                         ids=["fp32", "bf16-save-load-full-state-dict"])
def test_accelerate_fsdp2_loop_matches_torch(dist_pool, tmp_path, mixed_precision, checkpoint):
    ckpt_dir = str(tmp_path) if checkpoint else None
    for rank, ((losses, sharded, ours, full), (ref, ref_sharded, ref_ours, ref_full)) in \
            enumerate(dist_pool(2).run(_accelerate_both, mixed_precision, ckpt_dir,
                                       timeout=TIMEOUT)):
        assert losses == ref  # the same arithmetic: equal bit for bit
        assert losses[3] < losses[0]
        assert sharded == ours == [True, True, True]
        assert ref_sharded == [True, True, True] and ref_ours == [False, False, False]
        if checkpoint and rank == 0:  # accelerate gathers the full state dict on rank 0
            assert sorted(full) == sorted(ref_full) and len(full) == 12
            assert all(torch.equal(full[k], ref_full[k]) for k in full)


def _fsdp1_with_torch_options(steps=3):
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    strategy, policy = ShardingStrategy.SHARD_GRAD_OP, ModuleWrapPolicy({Block})  # torch's

    def train(cls):
        model = cls(_net(), sharding_strategy=strategy, auto_wrap_policy=policy,
                    device_id=torch.device("cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        g = torch.Generator().manual_seed(1 + dist.get_rank())
        losses = []
        for _ in range(steps):
            x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, type(model) is flatshard.FSDP

    with _switched():
        import torch.distributed.fsdp as tfsdp
        ours = train(tfsdp.FullyShardedDataParallel)
    return ours, train(TorchFSDP)


def test_fsdp1_class_with_torchs_options_built_before(dist_pool):
    for (losses, is_ours), (ref, ref_is_ours) in \
            dist_pool(2).run(_fsdp1_with_torch_options, timeout=TIMEOUT):
        assert is_ours and not ref_is_ours
        assert losses == pytest.approx(ref, rel=RTOL)


# ------------------------------------------------------------ launcher --

def test_run_module_in_this_process(tmp_path, monkeypatch):
    (tmp_path / "tiny_train.py").write_text(
        "import sys\n"
        "from torch.distributed.fsdp import fully_shard, FSDPModule\n"
        "import flatshard\n"
        "RESULT = (__name__, sys.argv[1:], fully_shard is flatshard.fully_shard,\n"
        "          FSDPModule is flatshard.FSDPModule)\n"
        "sys.modules['tiny_train_result'] = RESULT\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    try:
        flatshard_main(["run", "-m", "tiny_train", "--lr", "0.1", "-h"])
        assert flatshard.torch_fsdp_switch() is not None
    finally:
        flatshard.restore_torch_fsdp()
        result = sys.modules.pop("tiny_train_result", None)
    assert result == ("__main__", ["--lr", "0.1", "-h"], True, True)


def test_run_refuses_a_missing_script(capsys):
    with pytest.raises(SystemExit) as e:
        flatshard_main(["run", "no_such_script.py"])
    assert e.value.code == 1 and "no such script 'no_such_script.py'" in capsys.readouterr().err
    assert flatshard.torch_fsdp_switch() is None


SCRIPT = """
import sys
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard  # torch's names, as written

import flatshard

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
fully_shard(model[0])
fully_shard(model)
model(torch.randn(3, 4)).sum().backward()
RESULT = (__name__, sys.argv[1:], sys.path[0], isinstance(model, flatshard.FSDPModule),
          isinstance(model, FSDPModule), [p.grad is not None for p in model.parameters()])
sys.modules["launched_script_result"] = RESULT
"""


def _launch(script):
    """`python -m flatshard run SCRIPT --steps 1` in this rank, whose process
    group the script uses (torchrun would have started it; the pool's ranks
    have one already). What run changes in the process is put back."""
    argv, path = list(sys.argv), list(sys.path)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            flatshard_main(["run", script, "--steps", "1"])
        return sys.modules.pop("launched_script_result"), err.getvalue()
    finally:
        flatshard.restore_torch_fsdp()
        sys.argv[:], sys.path[:] = argv, path


def test_run_a_script_on_2_ranks(dist_pool, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (first, line0), (second, line1) = dist_pool(2).run(_launch, str(script), timeout=TIMEOUT)
    assert first == second == ("__main__", ["--steps", "1"], str(tmp_path), True, True,
                               [True] * 4)
    assert line0.count("torch's FSDP APIs now run on flatshard") == 1 and line1 == ""
