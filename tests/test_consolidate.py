"""flatshard.consolidate / `python -m flatshard consolidate`: checkpoints saved
on 2 and 3 ranks (flatshard's, and plain DCP of a SHARDED state dict) become
one .pt or .safetensors file, written in this process with no process group,
that loads into the plain model bit-identical to its full state dict; the .pt
is exactly what torch.save writes; peak memory stays near one parameter; bad
arguments are refused naming them, and a failed run leaves no partial file."""
import json
import os
import subprocess
import sys
import warnings

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

import flatshard
from flatshard import FSDP, StateDictType
from flatshard.__main__ import main
from parity import batches, optimizer, policy
from toy_models import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Causal(nn.Module):
    """Its body is a module called "model", as in Hugging Face models: a bare
    state dict's keys start with "model." without being nested under it."""

    def __init__(self, seed):
        super().__init__()
        self.model = build(seed=seed, nested=True, tied=True, frozen=True)
        self.lm_head = nn.Linear(3, 2)

    def forward(self, x):
        return self.lm_head(self.model(x))


def _raw(t):
    return t.reshape(-1).view(torch.uint8)


def _same(got, want):
    """Same keys, and every tensor bit-identical (dtype, shape and bytes)."""
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(_raw(got[k]), _raw(v)), k


def _dcp_save(state, path):
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)


# ---------------------------------------------------------------------------
# checkpoints saved on several ranks


def _save(root):
    """One training step, then the same model three ways: save_checkpoint (with
    optimizer and extra), DCP of {"model": SHARDED}, DCP of the bare SHARDED
    state dict. Returns rank 0's full state dict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = FSDP(Causal(seed=0), auto_wrap_policy=policy("nested"))
    opt = optimizer("adamw", model.parameters())
    x, y = batches(1, 2, world, seed=world)[0]
    ((model(x[2 * rank:2 * rank + 2]) - y[2 * rank:2 * rank + 2, :2]) ** 2).mean().backward()
    opt.step()
    flatshard.save_checkpoint(os.path.join(root, "run"), model, opt, extra={"step": 1})
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = model.state_dict()
    dcp.save({"model": sharded}, checkpoint_id=os.path.join(root, "dcp"))
    dcp.save(sharded, checkpoint_id=os.path.join(root, "bare"))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        full = model.state_dict()
    return dict(full) if rank == 0 else None


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_checkpoints_consolidate_into_the_plain_model(dist_pool, tmp_path, world):
    full = dist_pool(world).run(_save, str(tmp_path))[0]
    assert any(k.startswith("model.") for k in full) and "lm_head.weight" in full
    assert not dist.is_initialized()  # consolidating needs no process group
    for name in ["run", "dcp", "bare"]:
        pt = flatshard.consolidate(tmp_path / name, tmp_path / f"{name}.pt")
        got = torch.load(pt, weights_only=True)
        _same(got, full)  # the model's entries and nothing else: no optimizer state, no extra
        plain = Causal(seed=7)
        plain.load_state_dict(got)  # strict: every key of the plain model, no other
        _same(plain.state_dict(), full)

        st = tmp_path / f"{name}.safetensors"
        flatshard.consolidate(tmp_path / name, st)
        _same(safetensors.torch.load_file(st), full)
        plain = Causal(seed=7)
        plain.load_state_dict(safetensors.torch.load_file(st))
        _same(plain.state_dict(), full)
    # save_checkpoint's directory and the checkpoint LATEST names read the same.
    ckpt = flatshard.latest_checkpoint(str(tmp_path / "run"))
    _same(torch.load(flatshard.consolidate(ckpt, tmp_path / "ckpt.pt"), weights_only=True), full)


# ---------------------------------------------------------------------------
# formats


DTYPES = {"f32": torch.randn(5, 3), "bf16": torch.randn(4).bfloat16(),
          "f16": torch.randn(2, 2).half(), "f64": torch.randn(3).double(),
          "i64": torch.arange(6), "i8": torch.tensor([-3, 4], dtype=torch.int8),
          "u8": torch.tensor([250], dtype=torch.uint8), "bool": torch.tensor([True, False]),
          "u16": torch.tensor([1, 60000], dtype=torch.uint16),
          "f8": torch.randn(3).to(torch.float8_e4m3fn), "c64": torch.randn(2, dtype=torch.cfloat),
          "nan": torch.tensor([float("nan"), -0.0]), "scalar": torch.tensor(3.5),
          "empty": torch.empty(0, 4)}


def test_pt_is_what_torch_save_writes_and_safetensors_what_the_library_reads(tmp_path):
    _dcp_save({"model": DTYPES, "optim": {"x": torch.ones(2)}}, tmp_path / "ckpt")
    pt = flatshard.consolidate(tmp_path / "ckpt", tmp_path / "out.pt")
    torch.save(DTYPES, tmp_path / "ref.pt")
    ours, ref = (torch._C.PyTorchFileReader(str(p)) for p in (pt, tmp_path / "ref.pt"))
    assert ours.get_all_records() == ref.get_all_records()
    assert ours.get_record("data.pkl") == ref.get_record("data.pkl")  # byte for byte
    for n in range(len(DTYPES)):
        assert ours.get_record(f"data/{n}") == ref.get_record(f"data/{n}")
    _same(torch.load(pt, weights_only=True, mmap=True), DTYPES)

    st = flatshard.consolidate(tmp_path / "ckpt", tmp_path / "out.bin", fmt="safetensors")
    _same(safetensors.torch.load_file(st), DTYPES)
    with safetensors.safe_open(st, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    with open(st, "rb") as f:  # the layout the library writes: data starts 8-byte aligned
        n = int.from_bytes(f.read(8), "little")
        assert n % 8 == 0 and list(json.loads(f.read(n)))[:2] == ["f32", "bf16"]


# ---------------------------------------------------------------------------
# memory


def _save_big(path):
    torch.manual_seed(0)
    plain = nn.Sequential(*[nn.Linear(4096, 2048, bias=False) for _ in range(8)])  # 32 MB each
    model = FSDP(plain, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    flatshard.save_checkpoint(path, model)


MEASURE = """
import resource, sys, warnings
import torch, torch.distributed.checkpoint as dcp
import flatshard
def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
big, small, out = sys.argv[1:]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    dcp.save({"model": {"w": torch.ones(2)}}, checkpoint_id=small, no_dist=True)
for fmt in ("pt", "safetensors"):  # import and warm up every code path first
    flatshard.consolidate(small, out + "." + fmt)
base = peak()
growth = []
for fmt in ("pt", "safetensors"):
    flatshard.consolidate(big, out + "." + fmt, overwrite=True)
    growth.append(peak() - base)
print(*growth)
"""


def test_peak_memory_stays_near_one_parameter(dist_pool, tmp_path):
    dist_pool(2).run(_save_big, str(tmp_path / "big"))
    # glibc's default raises its mmap threshold as big blocks are freed, then keeps up
    # to tens of MB of freed heap resident: a fixed threshold returns every freed
    # block, so what is measured is what consolidate holds.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(1 << 20))
    proc = subprocess.run([sys.executable, "-c", MEASURE, str(tmp_path / "big"),
                           str(tmp_path / "small"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    param = 4096 * 2048 * 4  # the model: 8 of them
    growth = [int(g) / param for g in proc.stdout.split()]
    print(f"peak RSS growth (.pt, .safetensors), in parameters: {growth}")
    # One tensor, plus the shard DCP reads (half a tensor here) and its bytes.
    assert max(growth) < 2
    assert os.path.getsize(tmp_path / "out.safetensors") > 8 * param


# ---------------------------------------------------------------------------
# arguments, errors and atomic writes


@pytest.fixture
def ckpt(tmp_path):
    _dcp_save({"model": {"w": torch.ones(3)}}, tmp_path / "ckpt")
    return str(tmp_path / "ckpt")


def test_bad_arguments_are_refused_naming_them(ckpt, tmp_path):
    out = str(tmp_path / "out.pt")
    with pytest.raises(FileNotFoundError, match=r"in_dir='.*nope' does not exist"):
        flatshard.consolidate(tmp_path / "nope", out)
    with pytest.raises(NotADirectoryError, match=r"in_dir='.*metadata' is not a directory"):
        flatshard.consolidate(os.path.join(ckpt, ".metadata"), out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(flatshard.ConfigError, match=r"in_dir='.*empty'.*not a checkpoint: it "
                       "has neither a LATEST file .* nor .metadata"):
        flatshard.consolidate(tmp_path / "empty", out)
    with pytest.raises(flatshard.ConfigError, match=r"out_path='.*out.npz'.*suffix picks the "
                       r"format, one of .pt, .pth, .safetensors. Or name the format"):
        flatshard.consolidate(ckpt, tmp_path / "out.npz")
    with pytest.raises(flatshard.ConfigError, match="fmt='npz' is not allowed; 'pt'"):
        flatshard.consolidate(ckpt, out, fmt="npz")
    with pytest.raises(FileNotFoundError, match="out_path=.*its directory does not exist"):
        flatshard.consolidate(ckpt, tmp_path / "no" / "out.pt")
    _dcp_save({"model": {"w": torch.ones(1), "note": "hi"}}, tmp_path / "obj")
    with pytest.raises(flatshard.ConfigError, match="model entry 'model.note' is not a tensor"):
        flatshard.consolidate(tmp_path / "obj", out)
    _dcp_save({"model": {"z": torch.ones(1, dtype=torch.cdouble)}}, tmp_path / "c128")
    with pytest.raises(flatshard.ConfigError, match="entry 'z' is torch.complex128, which "
                       "safetensors cannot hold. Write a .pt"):
        flatshard.consolidate(tmp_path / "c128", tmp_path / "out.safetensors")
    assert sorted(os.listdir(tmp_path)) == ["c128", "ckpt", "empty", "obj"]  # nothing written


def test_existing_output_is_replaced_only_when_asked_and_never_left_partial(ckpt, tmp_path):
    out = tmp_path / "out.pt"
    out.write_bytes(b"previous")
    with pytest.raises(FileExistsError, match=r"out_path='.*out.pt' exists; pass "
                       r"overwrite=True \(--force\)"):
        flatshard.consolidate(ckpt, out)
    for shard in [f for f in os.listdir(ckpt) if f.endswith(".distcp")]:
        os.remove(os.path.join(ckpt, shard))  # the data is gone: reading fails midway
    # (no manifest here: DCP's own failure, as an Exception naming the file)
    with pytest.raises(flatshard.CheckpointDamaged, match="__0_0.distcp: FileNotFoundError"):
        flatshard.consolidate(ckpt, out, overwrite=True)
    with pytest.raises(flatshard.CheckpointDamaged, match="No such file"):
        flatshard.consolidate(ckpt, tmp_path / "out.safetensors")
    assert out.read_bytes() == b"previous" and os.listdir(tmp_path) == ["ckpt", "out.pt"]


def test_command_line(ckpt, tmp_path, capsys):
    out = str(tmp_path / "model.safetensors")
    main(["consolidate", ckpt, out])
    assert capsys.readouterr().out.startswith(f"flatshard: wrote {out} (")
    with pytest.raises(SystemExit) as e:
        main(["consolidate", ckpt, out])
    assert e.value.code == 1
    assert "consolidate: error: flatshard: out_path=" in capsys.readouterr().err
    main(["consolidate", ckpt, out, "--force"])
    main(["consolidate", ckpt, str(tmp_path / "model.ckpt"), "--format", "pt"])
    assert torch.equal(torch.load(tmp_path / "model.ckpt", weights_only=True)["w"],
                       torch.ones(3))
    for argv, message in [([str(tmp_path / "nope"), out], "in_dir="),
                          ([ckpt, out, "--format", "npz"], "argument --format: invalid choice"),
                          ([ckpt], "the following arguments are required: out_path")]:
        with pytest.raises(SystemExit) as e:
            main(["consolidate"] + argv)
        assert e.value.code != 0 and message in capsys.readouterr().err
    # The real entry point, in a process of its own.
    proc = subprocess.run([sys.executable, "-m", "flatshard", "consolidate", ckpt,
                           str(tmp_path / "cli.pt")], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert torch.equal(torch.load(tmp_path / "cli.pt", weights_only=True)["w"], torch.ones(3))


def test_doctor_reports_the_build():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "flatshard", "doctor"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from flatshard import _C
    assert f"CPU SIMD: optimizers {_C.simd_level()}, reductions " in out.stdout
    assert f"torch {torch.__version__}" in out.stdout and "shm (available" in out.stdout
    from flatshard import torch_facts  # the torch rules and names in force
    for line in torch_facts.report():
        assert line in out.stdout
