"""The planner's model-state bytes, computed from a meta-device copy of the
model before wrapping, equal the bytes flatshard really allocates (torch's
own storages, memory_stats) after training steps, for each strategy (ZeRO-1
to 3 and DDP) at 1, 2 and 4 ranks on small uneven models; and the gathered
peak recorded by hooks equals the planner's on uniform blocks."""
import pytest
import torch
import torch.distributed as dist

import flatshard
from flatshard import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
from flatshard.plan import plan, watch
from toy_models import Block, build

CASES = {
    "plain": dict(),
    "frozen+tied+nested": dict(frozen=True, tied=True, nested=True),
}


def _measure(strategy, case, optimizer, param_dtype, reduce_dtype=None, hybrid_group=None):
    kw = CASES[case]
    policy = flatshard.ModuleWrapPolicy({Block})
    world = dist.get_world_size()
    with torch.device("meta"):
        meta = build(**kw)
    mp = (MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                         buffer_dtype=param_dtype) if param_dtype else None)
    extra = dict(hybrid_group=hybrid_group) if hybrid_group else {}
    predicted = plan(meta, world_size=world, strategy=strategy, auto_wrap_policy=policy,
                     optimizer=optimizer, mixed_precision=mp, comm_backend="torch", **extra)
    import os
    if hybrid_group:  # the wrapper takes the ranks per host from torchrun's variable
        os.environ["LOCAL_WORLD_SIZE"] = str(hybrid_group)
    try:
        model = FSDP(build(**kw), auto_wrap_policy=policy,
                     sharding_strategy=ShardingStrategy[strategy], device_id=torch.device("cpu"),
                     mixed_precision=mp, comm_backend="torch")
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
    w = watch(model)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2) if optimizer == "adamw" else
           torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9))
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 5, generator=gen)).float().pow(2).mean().backward()
        opt.step()
    mem = flatshard.memory_stats(model, opt)
    w.remove()
    return {"predicted": {"params": predicted["params"], "grads": predicted["grads"],
                          "optim": predicted["master"] + predicted["moments"]
                          + predicted["optim_steps"],
                          "gathered": predicted["params_gathered"]},
            "measured": {"params": mem["params"], "grads": mem["grads"], "optim": mem["optim"],
                         "gathered": w.gathered_peak},
            "watch_report": w.report(opt),
            "predict_notes": flatshard.plan.predict(model, opt).notes}


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "SHARD_OPTIM"])
def test_model_states_predicted_equal_measured(dist_pool, world, strategy):
    for case in CASES:
        res = dist_pool(world).run(_measure, strategy, case, "adamw", None, timeout=300)
        for r in res:
            pred, meas = r["predicted"], r["measured"]
            for k in ("params", "grads", "optim"):
                assert pred[k] == meas[k], (case, k, pred, meas)
            assert pred["params"] > 0 and pred["grads"] > 0 and pred["optim"] > 0
            if case == "plain":  # identical blocks: the peak the planner names is reached
                assert pred["gathered"] == meas["gathered"], (pred, meas)
            else:  # an upper bound over the two largest units
                assert meas["gathered"] <= pred["gathered"]
            assert "MISMATCH" not in r["watch_report"], r["watch_report"]
            # the wrapped model's units are known: nothing assumed about them
            assert not any("assumed" in n for n in r["predict_notes"]), r["predict_notes"]


@pytest.mark.parametrize("world,strategy,reduce_dtype", [
    (1, "FULL_SHARD", None), (2, "FULL_SHARD", None), (4, "FULL_SHARD", torch.float32),
    (2, "SHARD_GRAD_OP", None), (1, "SHARD_GRAD_OP", None), (2, "SHARD_OPTIM", torch.float32),
    (2, "NO_SHARD", None), (1, "NO_SHARD", torch.float32)])
def test_mixed_precision_and_sgd_predicted_equal_measured(dist_pool, world, strategy,
                                                          reduce_dtype):
    res = dist_pool(world).run(_measure, strategy, "plain", "sgd_momentum", torch.bfloat16,
                               reduce_dtype, timeout=300)
    for r in res:
        pred, meas = r["predicted"], r["measured"]
        assert pred == meas, (pred, meas)
        assert "MISMATCH" not in r["watch_report"], r["watch_report"]


def test_example_reports_predicted_against_measured():
    """FLATSHARD_MEMORY_REPORT=1 on examples/train_small.py: every rank
    prints its table after the first step, and every category matches."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, OMP_NUM_THREADS="1", FLATSHARD_MEMORY_REPORT="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "examples/train_small.py", "--steps", "2"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"flatshard memory, rank {rank}: predicted vs measured" in proc.stdout
    rows = [ln for ln in proc.stdout.splitlines()
            if ln.strip().startswith(("params", "grads", "optim", "gathered peak"))]
    assert len(rows) == 8 and all(ln.rstrip().endswith("ok") for ln in rows), proc.stdout


def _check_and_refusals():
    from flatshard import NotBuiltError
    from flatshard.plan import check
    policy = flatshard.ModuleWrapPolicy({Block})
    model = FSDP(build(), auto_wrap_policy=policy, device_id=torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    text = check(model, opt)  # model states only, no watch needed
    refused = []
    amsgrad = torch.optim.Adam(model.parameters(), amsgrad=True)
    orig = FSDP(build(), auto_wrap_policy=policy, device_id=torch.device("cpu"),
                use_orig_params=True)
    for m, o in ((model, amsgrad), (orig, opt)):
        try:
            check(m, o)
        except NotBuiltError as e:
            refused.append(str(e))
    return text, refused


def test_check_after_a_step_and_what_it_refuses(dist_pool):
    for text, refused in dist_pool(2).run(_check_and_refusals, timeout=300):
        rows = text.splitlines()[1:]
        assert [r.split()[0] for r in rows] == ["params", "grads", "optim"]
        assert all(r.rstrip().endswith("ok") for r in rows), text
        assert len(refused) == 2
        assert "amsgrad" in refused[0] and "use_orig_params" in refused[1]


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_hybrid_shard_predicted_equal_measured(dist_pool, param_dtype):
    """HYBRID_SHARD over 2 groups of 2 ranks: each rank holds what FULL_SHARD
    over 2 ranks holds."""
    for case in CASES:
        res = dist_pool(4).run(_measure, "HYBRID_SHARD", case, "adamw", param_dtype, None, 2,
                               timeout=300)
        for r in res:
            pred, meas = r["predicted"], r["measured"]
            for k in ("params", "grads", "optim"):
                assert pred[k] == meas[k], (case, k, pred, meas)
            if case == "plain":  # identical blocks: the peak the planner names is reached
                assert pred["gathered"] == meas["gathered"], (pred, meas)
            else:  # an upper bound over the two largest units
                assert meas["gathered"] <= pred["gathered"]
            assert "MISMATCH" not in r["watch_report"], r["watch_report"]


def test_measure_runtime_warms_up_without_touching_the_random_state():
    """measure_runtime() reads the resident bytes after two throwaway training
    steps: at least what the plain reading gives, the global random state as
    it was (the model built next initialises as without it), and `warm`
    checked by name."""
    from flatshard.memory import resident_bytes
    from flatshard.plan import measure_runtime
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    cold = resident_bytes()[0]
    warm = measure_runtime()
    assert torch.equal(torch.rand(4), expected)
    assert warm > 0 and cold > 0
    # freed and trimmed before the reading: not more than the warm-up's
    # tensors and the code it paged in (a few MiB of a two-layer model)
    assert warm <= cold + (256 << 20)
    assert measure_runtime(warm=False) > 0
    with pytest.raises(TypeError, match="warm"):
        measure_runtime(warm="yes")
