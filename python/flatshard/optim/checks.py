"""What every optimizer step takes and checks: a parameter's local tensors
(DTensor parameters step their shard), zero state laid out as the parameter
(in huge pages from 2 MiB on, on the host), and the argument checks that name
what is wrong. Imports the leaves and runtime/cuda.py only."""
import torch

from .. import _C
from ..errors import bad_type, bad_value
from ..runtime import cuda
from ..tensors import PLAIN_TYPES, check_plain, is_dense

try:  # fully_shard's parameters (and tensor-parallel ones) are DTensors
    from torch.distributed.tensor import DTensor
except ImportError:  # a build of torch without distributed
    DTensor = None


# [Note: state in huge pages] A step streams every byte of the optimizer
# state through the core once; on the host that runs at memory speed only if
# the hardware prefetcher keeps ahead, and it stops at every page boundary:
# 512 of them per 2 MiB with small pages, one with a huge page. So host state
# of 2 MiB and more gets a zero-filled mapping of its own, in huge pages
# where the system has transparent huge pages at all (_C.mapped_storage),
# unmapped when the tensor goes. Measured on AMD EPYC (Zen 4), AdamW over
# 2^24 and 2^26 fp32 parameters, the two placements interleaved in one
# process: 2-3% faster a step on average, within the noise of any one run
# (benchmarks/results/optim.md, "AMD EPYC (Zen 4), third round: optimizer
# state in huge pages"). Smaller state, and state on a device, comes from
# torch as before. The mapping is populated on torch's thread count, and a
# huge page that stalls (compaction, memory the hypervisor has not backed)
# turns the rest of that thread's slice to plain pages: the state is made at
# the first step, which must not wait on it ([Note: state populated in
# parallel] in csrc/engine/pool.c).
_MAPPED_MIN_BYTES = 2 << 20


def _zeros_like(p):
    """Zeros shaped like parameter p, for its optimizer state."""
    nbytes = p.numel() * p.element_size()
    if p.device.type != "cpu" or nbytes < _MAPPED_MIN_BYTES or not p.is_contiguous():
        return torch.zeros_like(p, memory_format=torch.preserve_format)
    storage = _C.mapped_storage(nbytes, threads=torch.get_num_threads())
    return torch.empty(0, dtype=p.dtype).set_(storage, 0, p.shape, p.stride())


# [Note: DTensor parameters] fully_shard's parameters are DTensors, each rank
# holding its shard as the DTensor's local tensor. Every update here is
# elementwise, so each rank steps its own local tensors, exactly as a step of
# the whole parameter would, provided the gradient and the state are laid out
# as the parameter is (mesh, placements, global shape): a Partial gradient (not
# reduced yet) or state of another layout is refused by name. The state is
# made as DTensors of the parameter's layout, as torch's optimizers make it,
# so torch.distributed.checkpoint saves and loads it.

def _locals(owner, gi, i, p, g):
    """(the tensor the kernel steps, its gradient's): the parameter itself, or
    a DTensor parameter's local tensors ([Note: DTensor parameters])."""
    if DTensor is None or not isinstance(p, DTensor):
        return p, g
    if not (isinstance(g, DTensor) and _same_layout(g, p)):
        raise bad_value(f"{owner}: group {gi} gradient {i}", _describe(g),
                        f"a DTensor laid out as its parameter ({p.placements} of shape "
                        f"{tuple(p.shape)}): a Partial gradient is reduced first")
    return p._local_tensor, g._local_tensor


def _same_layout(t, p):
    """Whether DTensors t and p have one layout (global shape, placements,
    mesh), each compared by identity first: every step asks it of each
    parameter's gradient and state, whose placements and mesh are most
    often the parameter's own objects (Placement and DeviceMesh equality
    is Python code)."""
    a, b = t._spec, p._spec
    return a is b or (t.shape == p.shape and
                      (a.placements is b.placements or a.placements == b.placements) and
                      (a.mesh is b.mesh or a.mesh == b.mesh))


def _state_local(t, p):
    """A state tensor as the kernel takes it: a DTensor state of a DTensor
    parameter's layout is its local tensor; anything else (a plain tensor
    for a DTensor parameter, a state of another layout) comes back as it is,
    for the checks to refuse by name."""
    if DTensor is not None and isinstance(t, DTensor) and isinstance(p, DTensor) and \
            _same_layout(t, p):
        return t._local_tensor
    return t


def _zeros_state(p, local):
    """Zero state for parameter p whose kernel tensor is `local`."""
    z = _zeros_like(local)
    if local is p:
        return z
    return DTensor.from_local(z, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _threads(threads):
    if threads is None:
        return torch.get_num_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise bad_value("threads", threads, "expected a positive int or None (torch's count)")
    return threads


_CPU, _CPU_CUDA = ("cpu",), ("cpu", "cuda")
_F32, _STRIDED = torch.float32, torch.strided


def _check_tensor(owner, what, i, t, cuda_ok=False):
    devices = _CPU_CUDA if cuda_ok else _CPU
    if is_dense(t, torch.float32, devices):
        return
    if torch.is_tensor(t):
        check_plain(t, f"{what} {i}", owner)
    if not torch.is_tensor(t) or t.dtype != torch.float32 or t.device.type not in devices \
            or not t.is_contiguous() or t.is_sparse:
        raise bad_type(f"{owner}: {what} {i}", _describe(t),
                       f"a contiguous float32 {' or '.join(d.upper() for d in devices)} tensor "
                       "(dense gradients)")


def _check_pair(owner, gi, i, p, g):
    """A parameter and its gradient g: fp32, contiguous, on one device (CPU
    or CUDA)."""
    if is_dense(p, torch.float32, _CPU) and is_dense(g, torch.float32, _CPU):
        return  # every step's case (on the host), checked without building a message
    _check_tensor(owner, f"group {gi} parameter", i, p, cuda_ok=True)
    _check_tensor(owner, f"group {gi} gradient", i, g, cuda_ok=True)
    if g.device != p.device:
        raise bad_value(f"{owner}: group {gi} gradient {i}", str(g.device),
                        f"expected it on the parameter's device, {p.device}")
    if p.is_cuda and not cuda.built():
        raise bad_type(f"{owner}: group {gi} parameter {i}", str(p.device),
                       "a CPU tensor: flatshard was built without nvcc (no CUDA kernels)")


def _check_range(owner, name, value, lo=0.0, hi=None, hi_open=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value >= lo and \
        (hi is None or (value < hi if hi_open else value <= hi))
    if not ok:
        bound = f"in [{lo}, {hi})" if hi_open else (f">= {lo}" if hi is None else
                                                     f"in [{lo}, {hi}]")
        raise bad_value(f"{owner}({name}=...)", value, f"expected a number {bound}")


def _call_closure(closure):
    """torch's contract: the closure re-evaluates the loss with autograd on."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _host_f32(t, n):
    """Whether t is a plain, contiguous float32 CPU tensor of n elements: the
    check of every step, is_dense(t, torch.float32, ("cpu",)) and the size
    written out, its cheapest attributes first (calling is_dense cost AdamW
    0.7 us a parameter, 15% of its per-tensor cost; t.device costs several
    times t.is_cpu)."""
    return type(t) in PLAIN_TYPES and t.dtype is _F32 and t.is_cpu and \
        t.layout is _STRIDED and t.is_contiguous() and t.numel() == n


def _describe(t):
    if not torch.is_tensor(t):
        return type(t).__name__
    return f"{t.dtype} {tuple(t.shape)} on {t.device}" + \
        ("" if t.is_contiguous() else ", non-contiguous")
