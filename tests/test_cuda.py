"""The CUDA path (csrc/cuda/, flatshard.runtime.cuda, flatshard.runtime.cuda_nccl).

The first tests run everywhere: the extension must have been built wherever
nvcc is installed, import without a GPU, and refuse bad input with clear
errors. The rest need a GPU torch can see and check every kernel against an
independent reference (torch's own ops and optimizers, float64 sums, the
CPU core's scalar path) and the NCCL backend's collectives."""
import os
import shutil

import pytest
import torch

import flatshard
from flatshard import _C
from flatshard.runtime import comm as fcomm
from flatshard.runtime import cuda, cuda_nccl
from flatshard.runtime.comm import backend_for_device, requested_backend
from flatshard.runtime.device import nccl_device_comm

GPU = torch.cuda.is_available()
need_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device visible to torch")
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
ENTRY_POINTS = ("runtime_info", "nccl_load", "nccl_version", "nccl_unique_id", "cast",
                "scale_accumulate", "pack", "unpack", "adam_step", "sgd_step", "norm_partial",
                "NcclComm", "CudaError", "NcclError")


def nvcc_present():
    if os.environ.get("FLATSHARD_NO_CUDA") == "1":
        return False
    homes = (os.environ.get("CUDA_HOME"), "/usr/local/cuda")
    return any(h and os.path.exists(os.path.join(h, "bin", "nvcc")) for h in homes) or \
        shutil.which("nvcc") is not None


# ---------------------------------------------------------------------------
# everywhere

def test_extension_built_where_nvcc_is_installed():
    if not nvcc_present():
        pytest.skip("no nvcc here: the CPU build is complete without the CUDA extension")
    assert cuda.built(), "nvcc is installed but flatshard._C_cuda was not built"
    missing = [name for name in ENTRY_POINTS if not hasattr(cuda._C_cuda, name)]
    assert not missing
    assert issubclass(cuda._C_cuda.NcclError, cuda._C_cuda.CudaError)
    assert issubclass(cuda._C_cuda.CudaError, RuntimeError)
    assert cuda._C_cuda.SEGMENTS_PER_LAUNCH == 64


def _capsule_pointer(name, capsule=None):
    import ctypes
    api = ctypes.pythonapi
    if capsule is None:
        api.PyCapsule_Import.restype = ctypes.c_void_p
        api.PyCapsule_Import.argtypes = [ctypes.c_char_p, ctypes.c_int]
        return api.PyCapsule_Import(name.encode(), 0)
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    return api.PyCapsule_GetPointer(capsule, name.encode())


@pytest.mark.parametrize("which", ["host", "cuda"])
def test_device_api_capsules(which):
    """flatshard._C's units reach a device's kernels through an fs_device_api
    capsule (csrc/engine/fs_device.h): versioned, named, every entry set."""
    import ctypes
    from flatshard import _C
    if which == "cuda" and not cuda.built():
        pytest.skip("built without nvcc")
    capsule = _C.host_device_api if which == "host" else cuda._C_cuda.device_api
    ptr = _capsule_pointer("flatshard.fs_device_api", capsule)
    assert ptr
    assert ctypes.c_int.from_address(ptr).value == 6  # FS_DEVICE_API_VERSION
    assert ctypes.c_char_p.from_address(ptr + 8).value.decode() == which
    entries = (ctypes.c_void_p * 13).from_address(ptr + 16)  # 13 function pointers
    assert all(entries)


def test_nccl_load_reports_what_is_wrong():
    if not cuda.built():
        pytest.skip("built without nvcc")
    C = cuda._C_cuda
    if C.nccl_version():
        pytest.skip("NCCL already loaded in this process (loading is once per process)")
    with pytest.raises(C.NcclError, match="cannot open /nonexistent/libnccl.so.2"):
        C.nccl_load("/nonexistent/libnccl.so.2")
    with pytest.raises(C.NcclError, match="has no symbol ncclGetVersion"):
        C.nccl_load("libc.so.6")
    assert C.nccl_version() == 0
    with pytest.raises(C.NcclError, match="NCCL is not loaded"):
        C.nccl_unique_id()


def test_runtime_info_never_raises_and_matches_torch():
    if not cuda.built():
        pytest.skip("built without nvcc")
    info = cuda.runtime_info()
    assert info["runtime_version"] >= 12000
    if GPU:
        assert info["device_count"] == torch.cuda.device_count(), info
    else:
        assert cuda.available() is False
    from flatshard.__main__ import doctor_report
    line = [x for x in doctor_report() if x.startswith("CUDA kernels:")]
    assert line and "built" in line[0]


def test_launch_preconditions_raise_cuda_error_naming_the_op():
    """Checked before any CUDA call, so these run without a GPU too."""
    if not cuda.built():
        pytest.skip("built without nvcc")
    C = cuda._C_cuda
    with pytest.raises(C.CudaError, match="cast: cudaErrorInvalidValue"):
        C.cast(0, _C.F32, 0, _C.F32, -1, 0)
    with pytest.raises(C.CudaError, match="adam_step"):
        C.adam_step(0, 0, 0, 0, 0, 0, _C.BF16, 4, step=0)
    with pytest.raises(C.CudaError, match="pack"):  # negative numel in a segment
        C.pack(8, _C.F32, [(8, 0, 0, -3, _C.F32)], 0)
    with pytest.raises(C.CudaError, match="unpack"):  # integer to float is not a cast we do
        C.unpack(8, _C.F32, [(8, 0, 0, 3, _C.I64)], 0)
    with pytest.raises(TypeError, match="segment must be"):
        C.pack(8, _C.F32, [(8, 0)], 0)
    with pytest.raises(ValueError, match="unique_id must be 128 bytes"):
        C.NcclComm(0, 1, b"short", 0)


def test_tensor_checks_name_the_argument():
    if not cuda.built():
        pytest.skip("built without nvcc")
    cpu = torch.zeros(4)
    with pytest.raises(flatshard.ConfigError, match="cast_: dst"):
        cuda.cast_(cpu, cpu)
    with pytest.raises(flatshard.ConfigError, match="adam_step_: param"):
        cuda.adam_step_(cpu, cpu, cpu, cpu, 1, lr=1e-3)


def test_backend_must_fit_the_device():
    """CUDA memory moves only through 'nccl' ('auto' picks it), host memory
    never through it: each mismatch names comm_backend and what to use."""
    assert backend_for_device("auto", torch.device("cuda", 0)) == "nccl"
    assert backend_for_device("auto", torch.device("cpu")) == "auto"
    with pytest.raises(flatshard.ConfigError, match="comm_backend='nccl'.*moves CUDA memory"):
        backend_for_device(requested_backend("nccl"), torch.device("cpu"))
    for name in ("shm", "torch"):
        with pytest.raises(flatshard.ConfigError, match=f"comm_backend='{name}'.*only the "
                           "'nccl' backend"):
            backend_for_device(name, torch.device("cuda", 0))
    if not cuda.available():
        with pytest.raises(flatshard.NotBuiltError, match="needs flatshard built with nvcc"):
            cuda_nccl.nccl_comm_for(None)


# ---------------------------------------------------------------------------
# kernels (GPU)

def dev(t):
    return t.to("cuda")


@need_gpu
@pytest.mark.parametrize("n", [0, 1, 3, 1023, 4097])
def test_cast_matches_torch(n):
    g = torch.Generator().manual_seed(n)
    base = torch.randn(n, generator=g, dtype=torch.float64) * 300
    for src_t in FLOATS:
        src = dev(base.to(src_t))
        for dst_t in FLOATS:
            out = torch.full((n,), 7, dtype=dst_t, device="cuda")
            cuda.cast_(out, src)
            ref = src.to(dst_t)
            assert torch.equal(out, ref), (src_t, dst_t)


@need_gpu
def test_pack_and_unpack_many_mixed_segments():
    """70 tensors (more than one launch's table), mixed dtypes, empty ones and
    padding runs, into a bf16 flat buffer and back."""
    g = torch.Generator().manual_seed(0)
    tensors, pieces = [], []
    for i in range(70):
        n = [0, 1, 5, 17, 129, 1000][i % 6]
        t = dev(torch.randn(n, generator=g).to(FLOATS[i % 4]))
        tensors.append(t)
        pieces.append(t.to(torch.bfloat16))
        if i % 9 == 0:
            tensors.append(3)  # three zeros of padding
            pieces.append(torch.zeros(3, dtype=torch.bfloat16, device="cuda"))
    ref = torch.cat(pieces)
    flat = torch.full_like(ref, 5.0)
    cuda.pack(flat, tensors)
    assert torch.equal(flat, ref)
    # copy-out: every real tensor gets its slice back, cast to its own dtype
    outs, offsets, at = [], [], 0
    for t in tensors:
        if isinstance(t, int):
            at += t
            continue
        outs.append(torch.empty_like(t))
        offsets.append(at)
        at += t.numel()
    cuda.unpack(flat, outs, offsets)
    for o, off in zip(outs, offsets):
        assert torch.equal(o, flat[off:off + o.numel()].to(o.dtype))


@need_gpu
@pytest.mark.parametrize("dst_t,src_t", [(torch.float32, torch.float32),
                                         (torch.float32, torch.bfloat16),
                                         (torch.bfloat16, torch.float32),
                                         (torch.float64, torch.float64)])
def test_scale_accumulate_matches_f32_math(dst_t, src_t):
    g = torch.Generator().manual_seed(1)
    src = dev(torch.randn(4099, generator=g).to(src_t))
    dst = dev(torch.randn(4099, generator=g).to(dst_t))
    acc = torch.float64 if dst_t == src_t == torch.float64 else torch.float32
    ref = (dst.to(acc) + 0.25 * src.to(acc)).to(dst_t)
    cuda.scale_accumulate_(dst, src, 0.25, accumulate=True)
    torch.testing.assert_close(dst, ref)
    cuda.scale_accumulate_(dst, src, 0.5, accumulate=False)
    torch.testing.assert_close(dst, (0.5 * src.to(acc)).to(dst_t))


def misaligned(n, gen):
    """n elements starting 4 bytes into an allocation: the kernels' scalar path."""
    return dev(torch.randn(n + 1, generator=gen))[1:]


ADAM_CASES = [
    dict(decoupled=True, weight_decay=0.01),
    dict(decoupled=False, weight_decay=0.1),
    dict(decoupled=True, weight_decay=0.0, amsgrad=True),
    dict(decoupled=True, weight_decay=0.01, maximize=True),
]


@need_gpu
@pytest.mark.parametrize("n", [1, 3, 4, 5, 17, 4099, 65537])
@pytest.mark.parametrize("case", range(len(ADAM_CASES)))
def test_adam_matches_torch_and_the_cpu_scalar_path(n, case):
    cfg = ADAM_CASES[case]
    amsgrad, maximize = cfg.get("amsgrad", False), cfg.get("maximize", False)
    gen = torch.Generator().manual_seed(n * 10 + case)
    # odd cases start 4 bytes into an allocation (the scalar path), even ones
    # are 16-byte aligned (the vector path and its tail)
    p = misaligned(n, gen) if case % 2 else dev(torch.randn(n, generator=gen))
    ref_p = p.detach().clone().requires_grad_(True)
    cls = torch.optim.AdamW if cfg["decoupled"] else torch.optim.Adam
    ref_opt = cls([ref_p], lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                  weight_decay=cfg["weight_decay"], amsgrad=amsgrad, maximize=maximize,
                  foreach=False)
    cpu = [p.cpu().clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n)]
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    mx = torch.zeros_like(p) if amsgrad else None
    copy = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    for step in range(1, 7):
        grad = dev(torch.randn(n, generator=gen))
        ref_p.grad = grad.clone()
        ref_opt.step()
        cuda.adam_step_(p, grad, m, v, step, lr=1e-2, betas=(0.9, 0.99), eps=1e-8,
                        weight_decay=cfg["weight_decay"], decoupled=cfg["decoupled"],
                        maximize=maximize, max_exp_avg_sq=mx, copy=copy)
        grad_cpu = grad.cpu()
        _C.adam_step(cpu[0].data_ptr(), grad_cpu.data_ptr(), cpu[1].data_ptr(),
                     cpu[2].data_ptr(), cpu[3].data_ptr() if amsgrad else 0, 0, _C.BF16, n,
                     lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=cfg["weight_decay"],
                     step=step, decoupled=cfg["decoupled"], maximize=maximize, simd="scalar")
    torch.testing.assert_close(p, ref_p.detach(), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(p.cpu(), cpu[0], rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(m, ref_opt.state[ref_p]["exp_avg"], rtol=2e-6, atol=1e-7)
    assert torch.equal(copy, p.to(torch.bfloat16))


@need_gpu
def test_adam_device_step_found_inf_and_grad_scale():
    """torch's fused-optimizer protocol: step a float32 device tensor,
    found_inf skips, grad_scale divides; nothing read back on the host."""
    gen = torch.Generator().manual_seed(3)
    n = 1000
    p = dev(torch.randn(n, generator=gen))
    ref_p = p.clone().requires_grad_(True)
    ref = torch.optim.AdamW([ref_p], lr=1e-3, weight_decay=0.01, foreach=False)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    step = torch.zeros((), device="cuda")
    scale = torch.tensor(1024.0, device="cuda")
    for k in range(4):
        grad = dev(torch.randn(n, generator=gen))
        inf = torch.tensor(float(k == 2), device="cuda")  # overflow at the third step
        before = p.clone()
        step += 1
        cuda.adam_step_(p, grad * 1024.0, m, v, step, lr=1e-3, weight_decay=0.01,
                        found_inf=inf, grad_scale=scale)
        step -= inf
        if k == 2:
            assert torch.equal(p, before)
            continue
        ref_p.grad = grad
        ref.step()
    assert step.item() == 3
    torch.testing.assert_close(p, ref_p.detach(), rtol=2e-6, atol=1e-7)


@need_gpu
@pytest.mark.parametrize("momentum,nesterov,dampening,wd,maximize",
                         [(0.0, False, 0.0, 0.0, False), (0.9, False, 0.1, 0.01, False),
                          (0.9, True, 0.0, 0.01, True)])
def test_sgd_matches_torch(momentum, nesterov, dampening, wd, maximize):
    gen = torch.Generator().manual_seed(4)
    n = 4099
    p = dev(torch.randn(n, generator=gen))
    ref_p = p.clone().requires_grad_(True)
    ref = torch.optim.SGD([ref_p], lr=0.05, momentum=momentum, dampening=dampening,
                          weight_decay=wd, nesterov=nesterov, maximize=maximize, foreach=False)
    buf = torch.zeros_like(p) if momentum else None
    for k in range(5):
        grad = dev(torch.randn(n, generator=gen))
        ref_p.grad = grad.clone()
        ref.step()
        cuda.sgd_step_(p, grad, buf, lr=0.05, momentum=momentum, dampening=dampening,
                       weight_decay=wd, nesterov=nesterov, maximize=maximize, first_step=k == 0)
    torch.testing.assert_close(p, ref_p.detach(), rtol=2e-6, atol=1e-7)


@need_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("n", [0, 1, 31, 100003])
def test_norm_partial_matches_float64(dtype, n):
    x = dev(torch.randn(n, generator=torch.Generator().manual_seed(n)).to(dtype))
    x64 = x.double()
    sq = cuda.norm_partial(x, 2.0)
    mx = cuda.norm_partial(x, float("inf"))
    torch.testing.assert_close(sq, (x64 * x64).sum(), rtol=1e-10, atol=0)
    torch.testing.assert_close(mx, x64.abs().max() if n else torch.zeros((), dtype=torch.float64,
                                                                         device="cuda"))
    if n:
        x[n // 2] = float("nan")
        assert cuda.norm_partial(x, 2.0).isnan().item()
        assert cuda.norm_partial(x, float("inf")).isnan().item()


@need_gpu
def test_kernels_index_past_2_to_the_31():
    """64-bit indexing: cast, SGD and the norm reach the last elements."""
    n = (1 << 31) + 5
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * (1 << 30):
        pytest.skip("needs 40 GiB of free device memory")
    src = torch.ones(n, device="cuda")
    tail = torch.tensor([1.5, -2.0, 3.25, 4.0, -5.5], device="cuda")
    src[-5:] = tail
    low = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    cuda.cast_(low, src)
    assert torch.equal(low[-5:], tail.to(torch.bfloat16)) and low[(1 << 31) - 1].item() == 1.0
    del low
    grad = torch.ones(n, device="cuda")
    cuda.sgd_step_(src, grad, lr=0.5)
    assert torch.equal(src[-5:], tail - 0.5) and src[0].item() == 0.5
    expected = (n - 5) * 0.25 + float(((tail - 0.5).double() ** 2).sum())
    assert cuda.norm_partial(src, 2.0).item() == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------
# NCCL backend (GPU): its collectives through comm.py's functions and the
# Comm(kind='device') over the communicator, as the units issue them

@pytest.fixture(scope="module")
def nccl1():
    """A world-size-1 communicator on the current device, made directly (no
    process group needed), and the Comm that issues its collectives."""
    if not GPU:
        pytest.skip("needs a CUDA device visible to torch")
    cuda_nccl.load_nccl()
    here = torch.device("cuda", torch.cuda.current_device())
    backend = cuda_nccl.NcclBackend(cuda._C_cuda.NcclComm(0, 1, cuda._C_cuda.nccl_unique_id(),
                                                          here.index, 60.0), here, 60.0)
    yield backend, nccl_device_comm(backend)
    backend.close()


@need_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nccl_collectives_world_one(nccl1, dtype):
    _, comm = nccl1
    x = dev(torch.randn(4099, generator=torch.Generator().manual_seed(5)).to(dtype))
    out = torch.empty_like(x)
    fcomm.all_gather_into(comm, out, x, tag="unit0")
    assert torch.equal(out, x)
    for average in (False, True):
        out.fill_(0)
        fcomm.reduce_scatter_into(comm, out, x, average=average, tag="unit0.grad")
        assert torch.equal(out, x)
    y = x.clone()
    fcomm.all_reduce_(comm, y, average=True)
    assert torch.equal(y, x)
    fcomm.broadcast_(comm, y, root=0)
    comm.barrier()
    assert torch.equal(y, x)
    assert [e["op"] for e in comm.ledger()][:2] == ["all_gather", "reduce_scatter"]


@need_gpu
def test_nccl_orders_against_the_callers_stream(nccl1):
    """The input is written by a long kernel on a side stream just before
    the all-gather, and the result read right after on that stream: events
    alone must order them."""
    backend, comm = nccl1
    side = torch.cuda.Stream()
    a = torch.randn(2048, 2048, device="cuda")
    with torch.cuda.stream(side):
        x = (a @ a @ a).view(-1)
        out = torch.empty_like(x)
        fcomm.all_gather_into(comm, out, x)
        diff = (out - x).abs().max()
    torch.cuda.current_stream().wait_stream(side)
    assert diff.item() == 0.0
    with backend.group():
        outs = [torch.empty_like(x) for _ in range(3)]
        for o in outs:
            fcomm.all_gather_into(comm, o, x)
    assert all(torch.equal(o, x) for o in outs)


@need_gpu
def test_nccl_errors_name_the_collective_and_abort(nccl1):
    backend, comm = nccl1
    x = torch.ones(8, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(_C.CoreError, match="reduce_scatter for 'u7'.*inside a group"):
        with backend.group():
            fcomm.reduce_scatter_into(comm, torch.empty_like(x), x, tag="u7")
    with pytest.raises(flatshard.ConfigError, match="all_gather: output"):
        fcomm.all_gather_into(comm, torch.empty(3, device="cuda"), torch.empty(2, device="cuda"))
    with pytest.raises(flatshard.ConfigError, match=f"all_gather: input='cpu'.*this Comm moves "
                       f"cuda:{backend.device.index} memory"):
        fcomm.all_gather_into(comm, torch.empty(2, device="cuda"), torch.empty(2))
    here = torch.device("cuda", torch.cuda.current_device())
    raw = cuda._C_cuda.NcclComm(0, 1, cuda._C_cuda.nccl_unique_id(), here.index, 60.0)
    # the fs_comm (comm.h) another extension drives: ops table, then rank, world_size
    import ctypes
    ptr = _capsule_pointer("flatshard.fs_comm", raw.capsule())
    assert ctypes.c_void_p.from_address(ptr).value
    assert (ctypes.c_int.from_address(ptr + 8).value, ctypes.c_int.from_address(ptr + 12).value) \
        == (0, 1)
    other = nccl_device_comm(cuda_nccl.NcclBackend(raw, here, 60.0))
    assert other.abort("test") is True
    with pytest.raises(_C.CoreError, match="all_gather for 'u9'.*aborted"):
        other.all_gather(x.data_ptr(), x.data_ptr(), 8, _C.BF16, "u9")
    raw.close()
    with pytest.raises(cuda._C_cuda.NcclError, match="closed"):
        raw.wait(1.0)
    with pytest.raises(_C.CoreError, match="closed"):
        other.barrier()


def _two_gpu_worker(rank, path, results):
    import torch.distributed as dist
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    try:
        b = cuda_nccl.nccl_comm_for(dist.group.WORLD)
        c = nccl_device_comm(b)
        x = torch.arange(6, dtype=torch.float32, device="cuda") + 10 * rank
        out = torch.empty(12, device="cuda")
        fcomm.all_gather_into(c, out, x)
        rs = torch.empty(3, dtype=torch.bfloat16, device="cuda")
        fcomm.reduce_scatter_into(c, rs, x.to(torch.bfloat16), average=True)
        b.wait()
        results[rank] = (out.cpu(), rs.float().cpu())
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not GPU or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_two_ranks(tmp_path):
    import torch.multiprocessing as mp
    results = mp.Manager().dict()
    mp.spawn(_two_gpu_worker, args=(str(tmp_path / "store"), results), nprocs=2, join=True)
    x0, x1 = torch.arange(6.0), torch.arange(6.0) + 10
    for rank in range(2):
        out, rs = results[rank]
        assert torch.equal(out, torch.cat([x0, x1]))
        sl = slice(3 * rank, 3 * rank + 3)
        assert torch.equal(rs, ((x0[sl] + x1[sl]) / 2).to(torch.bfloat16).float())
