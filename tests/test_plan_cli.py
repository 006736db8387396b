"""`python -m flatshard plan`: the printed figures are the API's, the ranking
names the API's first fit, --model builds on the meta device, --plot writes
a PNG (or says to install matplotlib)."""
import subprocess
import sys

import pytest

from flatshard.__main__ import main
from flatshard.plan import plan, rank

GIB = 2 ** 30
ARGS = ["plan", "--params", "7e9", "--world", "8", "--mixed-precision", "bf16",
        "--layers", "32", "--hidden", "4096", "--seq", "4096", "--batch", "1", "--flash"]
KW = dict(params=7e9, world_size=8, mixed_precision="bf16", layers=32, hidden=4096, seq_len=4096,
          batch_size=1, flash_attention=True, comm_backend="nccl")


def _out(capsys, argv):
    main(argv)
    return capsys.readouterr().out


def test_table_prints_the_planned_bytes(capsys):
    out = _out(capsys, ARGS)
    for name, st in (("DDP", "NO_SHARD"), ("ZeRO-1", "SHARD_OPTIM"), ("ZeRO-2", "SHARD_GRAD_OP"),
                     ("ZeRO-3", "FULL_SHARD")):
        assert name in out.splitlines()[0]
        p = plan(strategy=st, **KW)
        assert f"{p.total('device') / GIB:,.2f}" in out.split("total device")[1].splitlines()[0]
        assert f"{p['moments'] / GIB:,.2f}" in out.split("optimizer moments")[1].splitlines()[0]


def test_explain_prints_every_formula(capsys):
    out = _out(capsys, ARGS + ["--strategy", "FULL_SHARD", "--explain"])
    p = plan(strategy="FULL_SHARD", **KW)
    for ln in p.lines:
        assert ln.formula in out
    assert p.comm_formula in out


def test_device_memory_ranks_and_names_the_first_fit(capsys):
    out = _out(capsys, ARGS + ["--device-memory", "40GiB", "--host-memory", "64GiB"])
    r = rank(device_bytes=40 * GIB, host_bytes=64 * GIB,
             strategies=["NO_SHARD", "SHARD_OPTIM", "SHARD_GRAD_OP", "FULL_SHARD"], **KW)
    assert r.first is not None
    assert f"first to fit in 40.00 GiB: {r.first.plan.name}" in out
    assert out.count(" yes") == len(r.fitting)


def test_model_from_meta_with_wrap_policy(capsys):
    out = _out(capsys, ["plan", "--model", "toy_models:Net", "--wrap", "toy_models:Block",
                        "--world", "4", "--strategy", "FULL_SHARD", "--explain"])
    import flatshard
    import torch
    from toy_models import Block, Net
    with torch.device("meta"):
        p = plan(Net(), world_size=4, auto_wrap_policy=flatshard.ModuleWrapPolicy({Block}),
                 comm_backend="nccl")
    assert f"{p.config['params']:,} parameters" in out


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is in the test extra")
    path = tmp_path / "plan.png"
    out = _out(capsys, ARGS + ["--device-memory", "80GiB", "--plot", str(path)])
    assert f"wrote {path}" in out
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10000


def test_plot_without_matplotlib_says_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if absent
    with pytest.raises(SystemExit) as e:
        main(ARGS + ["--plot", str(tmp_path / "x.png")])
    assert e.value.code == 1
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("argv,word", [
    (["--device-memory", "lots"], "memory size"),
    (["--model", "no_such_module:f"], "--model"),
])
def test_bad_arguments_exit_with_the_name(capsys, argv, word):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--world", "2"] + (["--params", "1e9"] if "--model" not in argv else [])
             + argv)
    assert e.value.code == 1 and word in capsys.readouterr().err


def test_runs_as_a_module():
    proc = subprocess.run([sys.executable, "-m", "flatshard", "plan", "--params", "1e9",
                           "--world", "2", "--strategy", "FULL_SHARD"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ZeRO-3" in proc.stdout and "total device" in proc.stdout


def test_bare_count_assumes_layers_and_says_so(capsys):
    # 7e9 parameters on 64 ranks: planned as one unit, ZeRO-3 would gather the
    # whole model and save nothing over ZeRO-2; split as Llama 7B (32 layers).
    out = _out(capsys, ["plan", "--params", "7e9", "--world", "64"])
    note = [ln for ln in out.splitlines() if ln.startswith("note: ")]
    assert note == ["note: assumed 32 equal units, one per layer of a transformer of about "
                    "this size (Llama 7B); give layers= (--layers) or units= for your model"]
    kw = dict(params=7e9, world_size=64, comm_backend="nccl")
    z3, z2 = plan(strategy="FULL_SHARD", **kw), plan(strategy="SHARD_GRAD_OP", **kw)
    assert z3.config["units"] == 32 and z3.notes == [note[0][len("note: "):]]
    # equal to the same count given as 32 units, and far below ZeRO-2
    given = plan(strategy="FULL_SHARD", units=32, **kw)
    assert given.notes == [] and given["params_gathered"] == z3["params_gathered"]
    gathered = out.split("gathered units")[1].split()[:4]
    assert gathered[3] == f"{z3['params_gathered'] / GIB:,.2f}"
    assert z3.total("device") < z2.total("device") / 4
    # the two largest units (current and prefetched) of 7e9/32 fp32 parameters, empty
    # root; each unit padded by less than 16 bytes per rank to split evenly over 64
    assert 0 <= z3["params_gathered"] - 2 * 7e9 / 32 * 4 < 2 * 64 * 16


def test_layers_or_units_given_assume_nothing(capsys):
    out = _out(capsys, ARGS)
    assert "note:" not in out
    assert plan(strategy="FULL_SHARD", **KW).config["units"] == 32
    one = plan(params=7e9, world_size=64, units=1)
    assert one.notes == [] and one.config["units"] == 1


@pytest.mark.parametrize("params,layers,name", [
    (1.5e8, 12, "GPT-3 Small"), (1e9, 24, "GPT-3 XL"), (7e9, 32, "Llama 7B"),
    (13e9, 40, "Llama 13B"), (65e9, 80, "Llama 2 70B"), (1e12, 126, "Llama 3.1 405B"),
    (7, 7, "GPT-3 Small")])
def test_typical_layers_nearest_on_a_log_scale(params, layers, name):
    from flatshard.plan.units import TYPICAL_LAYERS, typical_layers
    assert typical_layers(params) == (layers, name)
    # independent check: the table's entry with the smallest size ratio
    best = min(TYPICAL_LAYERS, key=lambda t: max(params / t[0], t[0] / params))
    assert best[2] == name and min(best[1], int(params)) == layers
