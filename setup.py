"""Build flatshard._C from csrc/ with the C compiler: CPython C API only, no
torch at build time, so `pip install .` takes seconds.

CUDA sources (csrc/cuda/: kernels, NCCL backend) are compiled with nvcc,
with their CPython glue (csrc/glue/cuda/), into a separate extension,
flatshard._C_cuda, when a toolkit is found (CUDA_HOME, or
/usr/local/cuda, or nvcc on PATH); without one they are skipped and the CPU
build is complete on its own. FLATSHARD_NO_CUDA=1 skips them explicitly. A
toolkit that is found must build: an nvcc error fails the install. The
CUDA runtime is linked statically and NCCL opened at run time, so the
extension imports (and flatshard works on CPU) on machines without a GPU.
"""
import glob
import os
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
# csrc/: core (pure arithmetic: layout, casts, reductions), engine (the unit
# engine, no Python), backends (collectives), optim (CPU optimizers), hooks
# (the events' sequences and the C over torch objects), glue (the CPython
# module's types), cuda (kernels and NCCL) and glue/cuda (the CPython module
# over them). Each folder is on the include path of what it builds,
# so a header is named by its file alone. flatshard._C takes csrc/hooks/*.c and
# csrc/glue/*.c: glue/cuda/ is _C_cuda's.
C_DIRS = ["core", "engine", "backends", "optim", "hooks", "glue"]
INCLUDE_DIRS = [os.path.join("csrc", d) for d in C_DIRS]
CUDA_DIRS = ["csrc/cuda", "csrc/glue/cuda"]
C_FLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter",
           "-Wno-missing-field-initializers", "-Wno-format-truncation",
           "-fvisibility=hidden"]


def find_nvcc():
    if os.environ.get("FLATSHARD_NO_CUDA") == "1":
        return None
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def cuda_home(nvcc):
    """The toolkit root holding nvcc's headers and the static runtime."""
    for home in (os.environ.get("CUDA_HOME"),
                 os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
            return home
    raise RuntimeError(f"flatshard: found nvcc at {nvcc} but no CUDA headers next to it; "
                       "set CUDA_HOME to the toolkit, or FLATSHARD_NO_CUDA=1 to build without "
                       "the CUDA kernels")


def cuda_archs():
    """SASS for each listed compute capability, plus PTX of the newest one so
    later GPUs JIT it. FLATSHARD_CUDA_ARCHS="80;90" adds A100; the default
    (Hopper only) keeps the CUDA build to seconds."""
    archs = [a.strip().replace(".", "") for a in
             os.environ.get("FLATSHARD_CUDA_ARCHS", "90").replace(",", ";").split(";")
             if a.strip()]
    flags = []
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    top = max(archs, key=int)
    return flags + ["-gencode", f"arch=compute_{top},code=compute_{top}"]


class BuildExt(build_ext):
    """Compiles .cu sources with nvcc, the rest with the C compiler. A failing
    nvcc is a build error: a toolkit that is present must build."""

    def build_extension(self, ext):
        cu = [s for s in ext.sources if s.endswith(".cu")]
        if not cu:
            return super().build_extension(ext)
        nvcc = find_nvcc()
        os.makedirs(self.build_temp, exist_ok=True)
        objs = [os.path.join(self.build_temp, os.path.basename(src) + ".o") for src in cu]
        cmds = [[nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC,-fvisibility=hidden",
                 *cuda_archs(), *[f for d in INCLUDE_DIRS for f in ("-I", os.path.join(HERE, d))],
                 "-c", src, "-o", obj]
                for src, obj in zip(cu, objs)]
        for cmd in cmds:
            print(" ".join(cmd))
        # the .cu files compile in parallel: nvcc is most of the build's time
        procs = [subprocess.Popen(cmd) for cmd in cmds]
        failed = [src for src, p in zip(cu, procs) if p.wait() != 0]
        if failed:
            raise RuntimeError(f"flatshard: nvcc failed on {', '.join(failed)} (commands "
                               "above); set FLATSHARD_NO_CUDA=1 to build without the CUDA "
                               "kernels")
        ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
        ext.extra_objects = objs + list(ext.extra_objects or [])
        super().build_extension(ext)


def extensions():
    c_sources = sorted(s for d in INCLUDE_DIRS for s in glob.glob(os.path.join(d, "*.c")))
    exts = [Extension("flatshard._C", c_sources, include_dirs=INCLUDE_DIRS,
                      extra_compile_args=C_FLAGS)]
    cu_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    nvcc = find_nvcc()
    if cu_sources and nvcc:
        home = cuda_home(nvcc)
        # The CUDA runtime is linked statically (no libcudart needed at import,
        # and importing touches no GPU); NCCL is opened at run time
        # (csrc/cuda/comm_nccl.c). comm.c is the core's argument checking.
        exts.append(Extension(
            "flatshard._C_cuda",
            sorted(s for d in CUDA_DIRS for s in glob.glob(os.path.join(d, "*.c"))) +
            ["csrc/backends/comm.c", "csrc/core/status.c"] + cu_sources,
            include_dirs=INCLUDE_DIRS + CUDA_DIRS + [os.path.join(home, "include")],
            library_dirs=[os.path.join(home, "lib64")],
            libraries=["cudart_static", "stdc++", "dl", "rt", "pthread"],
            extra_compile_args=C_FLAGS))
    return exts


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
