"""Builds d9d_kernels._C: C++ CPU kernels, plus CUDA kernels when a CUDA build
of torch and a CUDA toolkit are both found (a visible GPU is not needed).

Environment:
  D9D_KERNELS_BUILD_CUDA = auto (default) | 0 | 1
  TORCH_CUDA_ARCH_LIST   = CUDA archs; default "8.0;9.0+PTX" (A100, H100/H200
                           SASS, plus sm_90 PTX that newer GPUs JIT-compile).
                           torch's own default probes the GPU and crashes on a
                           machine without one, so we always set it.
  CUDA_HOME / CUDA_PATH  = toolkit root; else /usr/local/cuda*, else found
                           from the real nvcc (the one on PATH may be a
                           wrapper script, so we look for include/cuda_runtime.h).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_ARCHS = "8.0;9.0+PTX"


def _is_toolkit(root: str | None) -> bool:
    return bool(root) and os.path.isfile(os.path.join(root, "bin", "nvcc")) and os.path.isfile(
        os.path.join(root, "include", "cuda_runtime.h")
    )


def find_cuda_home() -> str | None:
    """The CUDA toolkit root, or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates += sorted(glob.glob("/usr/local/cuda-*"), reverse=True)
    nvcc = shutil.which("nvcc")
    if nvcc:
        real = os.path.realpath(nvcc)
        candidates.append(os.path.dirname(os.path.dirname(real)))
        try:  # a wrapper script: `exec /path/to/real/nvcc "$@"`
            with open(real, "rb") as f:
                head = f.read(4096)
            if head.startswith(b"#!"):
                for tok in head.decode(errors="ignore").split():
                    if tok.endswith("/bin/nvcc"):
                        candidates.append(os.path.dirname(os.path.dirname(tok)))
        except OSError:
            pass
    for c in candidates:
        if _is_toolkit(c):
            return os.path.realpath(c)
    return None


def want_cuda(torch_cuda: str | None, cuda_home: str | None) -> bool:
    mode = os.environ.get("D9D_KERNELS_BUILD_CUDA", "auto").lower()
    if mode in ("0", "false", "no", "off"):
        return False
    found = torch_cuda is not None and cuda_home is not None
    if mode in ("1", "true", "yes", "on"):
        if not found:
            sys.exit(f"D9D_KERNELS_BUILD_CUDA=1 but torch.version.cuda={torch_cuda}, CUDA toolkit={cuda_home}")
        return True
    return found


def extensions():
    cuda_home = find_cuda_home()
    if cuda_home:
        os.environ["CUDA_HOME"] = cuda_home  # before cpp_extension reads it at import
    import torch
    from torch.utils import cpp_extension

    cuda_home = cuda_home if torch.version.cuda else None
    sources = ["csrc/registration.cpp"] + sorted(glob.glob("csrc/host/*.cpp")) + sorted(glob.glob("csrc/cpu/*.cpp"))
    # -fopenmp: at::parallel_for is a header template that, in torch's OpenMP
    # build, splits work with `#pragma omp parallel` compiled into OUR objects;
    # without the flag every chunk of a CPU op ran on the calling thread. The
    # link resolves to the libgomp.so.1 torch ships and has already loaded.
    omp = [] if sys.platform == "darwin" else ["-fopenmp"]
    cxx = ["-O3", "-fvisibility=hidden", *omp]
    build_cuda = want_cuda(torch.version.cuda, cuda_home)
    print(f"d9d_kernels: torch {torch.__version__} (cuda {torch.version.cuda}), toolkit {cuda_home}, "
          f"building CUDA kernels: {build_cuda}")
    if not build_cuda:
        return [cpp_extension.CppExtension("d9d_kernels._C", sources, extra_compile_args={"cxx": cxx},
                                           extra_link_args=omp)], cpp_extension
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCHS)
    include_dirs = []
    for site in sys.path:  # cusparse/cublas headers of the pip CUDA wheels
        inc = os.path.join(site, "nvidia", "cu13", "include")
        if os.path.isdir(inc):
            include_dirs.append(inc)
            break
    ext = cpp_extension.CUDAExtension(
        "d9d_kernels._C",
        sources + sorted(glob.glob("csrc/cuda/*.cu")),
        include_dirs=include_dirs,
        define_macros=[("D9D_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]},
        extra_link_args=omp,
    )
    return [ext], cpp_extension


exts, cpp_extension = extensions()
setup(
    name="d9d_kernels",
    version="0.1.0",
    packages=find_packages(include=["d9d_kernels", "d9d_kernels.*"]),
    package_data={"d9d_kernels": ["py.typed"]},  # PEP 561: type checkers read the package's annotations
    ext_modules=exts,
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
