"""Builds csrc/cuda/ for the host (fs_emu_rt.h): the emulated runtime, a
fake libnccl over flatshard's shared-memory backend, the kernels alone, and
flatshard._C_cuda itself (with its glue, csrc/glue/cuda/), into a directory
named by the sources' hash, so every process of a test session (ranks
included) shares one build."""
import glob
import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CSRC = ROOT / "csrc"
CUDA = CSRC / "cuda"
CUDA_GLUE = CSRC / "glue" / "cuda"  # flatshard._C_cuda's CPython glue
# setup.py's C folders, each on the include path
C_DIRS = [CSRC / d for d in ("core", "engine", "backends", "optim", "hooks", "glue")]
# The device table's name in this build: flatshard's Python layer treats
# "cuda" Comms as moving CUDA tensors; these move host memory.
DEVICE_NAME = "cuda-on-host"
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
CXX_FLAGS = ["-std=c++17", "-O1", "-fPIC", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas"]
C_FLAGS = ["-std=c11", "-O1", "-fPIC", "-Wall", "-Wno-unused-parameter",
           "-Wno-missing-field-initializers", "-Wno-format-truncation", "-fvisibility=hidden"]


def compilers():
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    return cc, cxx


def available():
    cc, cxx = compilers()
    return bool(cc and cxx and (CUDA / "copy.cu").exists())


def _sources():
    return sorted(glob.glob(str(HERE / "*.h")) + glob.glob(str(HERE / "*.cc")) + [__file__] +
                  [p for d in C_DIRS for p in glob.glob(str(d / "*.[ch]"))] +
                  glob.glob(str(CUDA / "*")) + glob.glob(str(CUDA_GLUE / "*")))


def _digest():
    h = hashlib.sha256()
    for p in _sources():
        h.update(p.encode())
        h.update(Path(p).read_bytes())
    h.update(EXT_SUFFIX.encode())
    return h.hexdigest()[:16]


def _run(cmd, cwd):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0 or "warning" in r.stderr:
        raise RuntimeError(f"host build of csrc/cuda failed: {' '.join(cmd)}\n{r.stderr[-6000:]}")


def _build(out):
    cc, cxx = compilers()
    inc = (["-I", str(HERE), "-I", str(CUDA), "-I", str(CUDA_GLUE)] +
           [f for d in C_DIRS for f in ("-I", str(d))])
    py = ["-I", sysconfig.get_paths()["include"]]
    rpath = ["-L", out, "-lfs_cudart_emu", "-Wl,-rpath,$ORIGIN"]
    # the runtime: streams, events, memory, the fiber scheduler
    _run([cxx, *CXX_FLAGS, *inc, "-shared",
          "-Wl,-soname,libfs_cudart_emu.so", str(HERE / "emu.cc"), str(HERE / "emu_rt.cc"),
          "-o", "libfs_cudart_emu.so"], out)
    # the kernels alone, called through their C entry points
    kernels = [str(CUDA / "copy.cu"), str(CUDA / "optim.cu"), str(CUDA / "quant.cu")]
    objs = []
    for src in kernels:
        obj = Path(src).stem + "_cu.o"
        _run([cxx, *CXX_FLAGS, *inc, "-x", "c++", "-c", src, "-o", obj], out)
        objs.append(obj)
    _run([cxx, "-shared", *objs, *rpath, "-o", "libfs_cuda_kernels.so"], out)
    # a libnccl over the shared-memory backend
    core = ["backends/comm_shm.c", "backends/shm_staging.c", "backends/comm.c",
            "backends/ledger.c", "core/reduce.c",
            "core/stream_copy.c",
            "core/status.c", "core/copy.c", "core/layout.c"]
    core_objs = []
    for name in core:
        obj = "core_" + Path(name).stem + ".o"
        _run([cc, *C_FLAGS, *inc, "-c", str(CSRC / name), "-o", obj], out)
        core_objs.append(obj)
    _run([cxx, *CXX_FLAGS, *inc, "-c", str(HERE / "fake_nccl.cc"), "-o", "fake_nccl.o"], out)
    _run([cxx, "-shared", "fake_nccl.o", *core_objs, *rpath, "-lrt", "-lpthread",
          "-o", "libnccl_fake.so"], out)
    # flatshard._C_cuda, as setup.py builds it, with the host runtime
    ext_objs = []
    for src in (sorted(glob.glob(str(CUDA / "*.c")) + glob.glob(str(CUDA_GLUE / "*.c"))) +
                [str(CSRC / "backends" / "comm.c"), str(CSRC / "core" / "status.c")]):
        obj = "ext_" + Path(src).stem + ".o"
        _run([cc, *C_FLAGS, *inc, *py, f"-DFS_CUDA_DEVICE_NAME=\"{DEVICE_NAME}\"", "-c", src,
              "-o", obj], out)
        ext_objs.append(obj)
    _run([cxx, "-shared", *ext_objs, *objs, *rpath, "-ldl", "-o", "_C_cuda" + EXT_SUFFIX], out)


def build():
    """The build directory (made once per source state)."""
    final = Path(tempfile.gettempdir()) / f"flatshard_cuda_emu_{_digest()}"
    if (final / "done").exists():
        return final
    work = Path(tempfile.mkdtemp(prefix="flatshard_cuda_emu_"))
    _build(str(work))
    (work / "done").write_text("ok")
    try:
        os.rename(work, final)
    except OSError:  # another process got there first: its build is the same
        shutil.rmtree(work, ignore_errors=True)
    return final


_loaded = {}


def load():
    """(the host-built flatshard._C_cuda module, the runtime as a ctypes
    library, the fake libnccl's path); the module has loaded that NCCL."""
    if "mod" not in _loaded:
        import ctypes
        d = build()
        path = str(d / ("_C_cuda" + EXT_SUFFIX))
        loader = importlib.machinery.ExtensionFileLoader("cuda_emu._C_cuda", path)
        spec = importlib.util.spec_from_file_location("cuda_emu._C_cuda", path, loader=loader)
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
        rt = ctypes.CDLL(str(d / "libfs_cudart_emu.so"))
        rt.fs_emu_fault.argtypes = [ctypes.c_char_p, ctypes.c_int]
        rt.fs_emu_pending.restype = ctypes.c_long
        nccl = str(d / "libnccl_fake.so")
        mod.nccl_load(nccl)
        _loaded.update(mod=mod, rt=rt, nccl=nccl)
        sys.modules.setdefault("cuda_emu._C_cuda", mod)
    return _loaded["mod"], _loaded["rt"], _loaded["nccl"]
