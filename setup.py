"""Build flatshard._C from csrc/ with the C compiler: CPython C API only, no
torch at build time, so `pip install .` takes seconds.

CUDA sources (csrc/cuda/*.cu) are compiled with nvcc into a separate
extension, flatshard._C_cuda, when a toolkit is found (CUDA_HOME, or
/usr/local/cuda, or nvcc on PATH); without one they are skipped and the CPU
build is complete on its own. FLATSHARD_NO_CUDA=1 skips them explicitly.
"""
import glob
import os
import shutil
import subprocess

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
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


class BuildExt(build_ext):
    """Compiles .cu sources with nvcc, the rest with the C compiler."""

    def build_extension(self, ext):
        cu = [s for s in ext.sources if s.endswith(".cu")]
        if not cu:
            return super().build_extension(ext)
        nvcc = find_nvcc()
        objs = []
        os.makedirs(self.build_temp, exist_ok=True)
        for src in cu:
            obj = os.path.join(self.build_temp, os.path.basename(src) + ".o")
            subprocess.check_call([nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC",
                                   "-I", os.path.join(HERE, "csrc"), "-c", src, "-o", obj])
            objs.append(obj)
        ext.sources = [s for s in ext.sources if not s.endswith(".cu")]
        ext.extra_objects = objs + list(ext.extra_objects or [])
        super().build_extension(ext)


def extensions():
    c_sources = sorted(glob.glob("csrc/*.c"))
    exts = [Extension("flatshard._C", c_sources, include_dirs=["csrc"],
                      extra_compile_args=C_FLAGS)]
    cu_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    nvcc = find_nvcc()
    if cu_sources and nvcc:
        home = os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
        exts.append(Extension(
            "flatshard._C_cuda", sorted(glob.glob("csrc/cuda/*.c")) + cu_sources,
            include_dirs=["csrc", os.path.join(home, "include")],
            library_dirs=[os.path.join(home, "lib64")], libraries=["cudart"],
            extra_compile_args=C_FLAGS))
    return exts


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
