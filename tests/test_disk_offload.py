"""Disk-offloaded Adam/AdamW (flatshard.optim.DiskOffload): the same update as
the in-memory C optimizer, bit for bit (the update is elementwise: chunking
changes nothing), hence torch's within parity.py's tolerance; checkpoints
that survive a killed process; FSDP training on 1, 2 and 4 ranks."""
import copy
import hashlib
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import flatshard
import flatshard.optim as fo
import parity
from flatshard import _C

SIZES = [0, 1, 7, 8, 9, 31, 257]  # around chunk sizes of 1 and 8 elements, a prime


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g)) for n in SIZES]


def _train(opts_and_params, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for s in range(steps):
        grads = [torch.randn(n, generator=g) for n in SIZES]
        for opt, params in opts_and_params:
            for i, (p, gr) in enumerate(zip(params, grads)):
                p.grad = None if (s == 1 and i == 2) else gr.clone()  # one step without grad
            opt.step()


@pytest.mark.parametrize("cls,chunk_bytes,buffers", [("AdamW", 8, 2), ("AdamW", 64, 5),
                                                     ("Adam", 1 << 20, 2)])
def test_same_as_in_memory_optimizer_bit_for_bit(tmp_path, cls, chunk_bytes, buffers):
    a, b, ref = _params(), _params(), _params()
    groups = lambda ps: [{"params": ps[:4]}, {"params": ps[4:], "lr": 0.003}]  # noqa: E731
    kw = dict(lr=0.01, weight_decay=0.1, maximize=cls == "Adam")
    disk = getattr(fo, cls)(groups(a), **kw, offload=fo.DiskOffload(str(tmp_path), chunk_bytes,
                                                                    buffers))
    mem = getattr(fo, cls)(groups(b), **kw)
    theirs = getattr(torch.optim, cls)(groups(ref), **kw)
    _train([(disk, a), (mem, b), (theirs, ref)], steps=4)
    for pa, pb, pr in zip(a, b, ref):
        assert torch.equal(pa, pb)
        torch.testing.assert_close(pa, pr, rtol=parity.RTOL, atol=parity.SCALE_ATOL)
        if pb in mem.state:
            got = disk.offloaded_state(pa)
            assert torch.equal(got["exp_avg"], mem.state[pb]["exp_avg"])
            assert torch.equal(got["exp_avg_sq"], mem.state[pb]["exp_avg_sq"])
            assert disk.state[pa]["step"].item() == mem.state[pb]["step"].item()
    # one generation file, of both moments of every parameter
    files = [f for f in os.listdir(tmp_path) if f.endswith(".bin")]
    assert len(files) == 1 and os.path.getsize(tmp_path / files[0]) == 8 * sum(SIZES)
    assert disk._disk.bytes_read == disk._disk.bytes_written == 8 * sum(SIZES)


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_checkpoint_file_is_never_modified_and_resumes(tmp_path):
    a, b = _params(), _params()
    off = fo.DiskOffload(str(tmp_path), chunk_bytes=64)
    disk, mem = fo.AdamW(a, lr=0.01, offload=off), fo.AdamW(b, lr=0.01)
    _train([(disk, a), (mem, b)], steps=2)
    sd = copy.deepcopy(disk.state_dict())  # torch's state dicts alias the live state
    saved = [p.detach().clone() for p in a]
    path = tmp_path / sd["disk_offload"]["file"]
    digest = _sha(path)
    _train([(disk, a), (mem, b)], steps=3, seed=2)  # the run goes on past the checkpoint
    assert _sha(path) == digest
    del disk  # releases the directory
    # resume from the checkpoint, redo the same 3 steps: the same result
    c = [torch.nn.Parameter(t.clone()) for t in saved]
    resumed = fo.AdamW(c, lr=0.01, offload=off)
    resumed.load_state_dict(sd)
    _train([(resumed, c)], steps=3, seed=2)
    for pc, pb in zip(c, b):
        assert torch.equal(pc, pb)


_CHILD = textwrap.dedent("""
    import hashlib, os, sys, torch
    import flatshard.optim as fo
    d, ckpt = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 64))
    opt = fo.AdamW(model.parameters(), lr=1e-3, offload=fo.DiskOffload(d, chunk_bytes=4096))
    def step(i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, 64, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    for i in range(3):
        step(i)
    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    torch.save(sd, ckpt + ".tmp")
    os.rename(ckpt + ".tmp", ckpt)
    f = os.path.join(d, sd["optim"]["disk_offload"]["file"])
    print("CKPT", hashlib.sha256(open(f, "rb").read()).hexdigest(), flush=True)
    i = 3
    while True:  # train on until killed
        step(i)
        print("STEP", i, flush=True)
        i += 1
""")


def _steps_after(model, opt, first, n):
    for i in range(first, first + n):
        g = torch.Generator().manual_seed(i)
        model(torch.randn(32, 64, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(),
                               torch.nn.Linear(512, 64))


def test_killed_process_resumes_from_checkpoint(tmp_path):
    d, ckpt = str(tmp_path / "state"), str(tmp_path / "ckpt.pt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, d, ckpt], stdout=subprocess.PIPE,
                             text=True, env=env)
    try:
        line = child.stdout.readline()
        assert line.startswith("CKPT"), line
        digest = line.split()[1]
        for _ in range(3):  # let it get well past the checkpoint, then kill it mid-run
            assert child.stdout.readline().startswith("STEP")
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=60)
    sd = torch.load(ckpt, weights_only=False)
    assert _sha(os.path.join(d, sd["optim"]["disk_offload"]["file"])) == digest
    # resume in this process from the checkpoint ...
    model = _model()
    model.load_state_dict(sd["model"])
    opt = fo.AdamW(model.parameters(), lr=1e-3, offload=fo.DiskOffload(d, chunk_bytes=4096))
    opt.load_state_dict(sd["optim"])
    _steps_after(model, opt, 3, 2)
    assert not [f for f in os.listdir(d) if f.endswith(".tmp")]
    # ... and it is the run that was never interrupted (in memory)
    ref = _model()
    ref_opt = fo.AdamW(ref.parameters(), lr=1e-3)
    _steps_after(ref, ref_opt, 0, 5)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


def test_options_are_validated(tmp_path):
    p = [torch.nn.Parameter(torch.randn(3))]
    for kw in (dict(chunk_bytes=12), dict(chunk_bytes=0), dict(buffers=1), dict(durable=1)):
        with pytest.raises(flatshard.ConfigError, match=next(iter(kw))):
            fo.DiskOffload(str(tmp_path), **kw)
    with pytest.raises(flatshard.NotBuiltError, match="amsgrad"):
        fo.AdamW(p, amsgrad=True, offload=fo.DiskOffload(str(tmp_path)))
    with pytest.raises(flatshard.ConfigTypeError, match="offload"):
        fo.AdamW(p, offload=str(tmp_path))
    first = fo.AdamW(p, offload=fo.DiskOffload(str(tmp_path)))
    p[0].grad = torch.ones(3)
    first.step()
    second = fo.AdamW([torch.nn.Parameter(torch.randn(3))],
                      offload=fo.DiskOffload(str(tmp_path)))
    second.param_groups[0]["params"][0].grad = torch.ones(3)
    with pytest.raises(flatshard.ConfigError, match="another optimizer"):
        second.step()


def test_io_error_is_an_oserror_with_its_errno(tmp_path):
    path = tmp_path / "ro"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # not writable: the writer thread's pwrite fails
    x, g = torch.zeros(100), torch.ones(100)
    try:
        with pytest.raises(OSError, match="writing the optimizer state") as e:
            _C.disk_adam_step(-1, fd, [(x.data_ptr(), g.data_ptr(), 100, 0, 1)], 16, 2)
        assert e.value.errno == 9  # EBADF
    finally:
        os.close(fd)


def _fsdp_disk(tmp, **kw):
    import torch.distributed as dist
    saved = parity.optimizer

    def optimizer(name, params):
        if name == "fs_disk":
            path = os.path.join(tmp, f"rank{dist.get_rank()}")
            return fo.AdamW(params, lr=0.01, weight_decay=0.1,
                            offload=fo.DiskOffload(path, chunk_bytes=64))
        return saved("adamw", params)
    parity.optimizer = optimizer
    try:
        return parity.run_case(opt="fs_disk", **kw)
    finally:
        parity.optimizer = saved


@pytest.mark.parametrize("world,strategy", [(1, "NO_SHARD"), (2, "FULL_SHARD"),
                                            (4, "SHARD_OPTIM")])
def test_fsdp_training_matches_plain_torch(dist_pool, tmp_path, world, strategy):
    dist_pool(world).run(_fsdp_disk, str(tmp_path), strategy=strategy, steps=3)


def _fsdp_optim_state_dict(tmp):
    import torch.distributed as dist
    from flatshard import FSDP, StateDictType
    from toy_models import build
    fs = FSDP(build())
    opt = fo.AdamW(fs.parameters(), offload=fo.DiskOffload(os.path.join(
        tmp, f"osd{dist.get_rank()}")))
    fs(torch.randn(2, 5)).sum().backward()
    opt.step()
    try:
        FSDP.optim_state_dict(fs, opt)
        return None
    except flatshard.NotBuiltError as e:
        refused = str(e)
    with FSDP.state_dict_type(fs, StateDictType.LOCAL_STATE_DICT):
        local = FSDP.optim_state_dict(fs, opt)
    return refused, local["disk_offload"]["file"] == opt._disk.current


def test_fsdp_full_optim_state_dict_is_refused_local_refers_to_files(dist_pool, tmp_path):
    for refused, local_ok in dist_pool(2).run(_fsdp_optim_state_dict, str(tmp_path)):
        assert "DiskOffload" in refused and "LOCAL_STATE_DICT" in refused
        assert local_ok
