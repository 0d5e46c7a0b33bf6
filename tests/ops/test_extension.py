"""The compiled extension: loading, backend reporting, forcing, CUDA-free import."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

import d9d_kernels as dk
from d9d_kernels import _extension

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_py(code: str, **env) -> str:
    """Runs `code` in a fresh interpreter (PYTHONPATH = repo root); returns stdout."""
    e = {k: v for k, v in os.environ.items() if k != "D9D_KERNELS_BACKEND"}
    e.update(PYTHONPATH=ROOT, **env)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=240, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_import_does_not_initialise_cuda():
    out = run_py(
        "import torch, d9d_kernels as dk\n"
        "a = torch.cuda.is_initialized()\n"
        "s, b = torch.zeros(2, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)\n"
        "dk.ops.running_extrema(torch.randn(5), state=s, bad=b)\n"
        "dk.ops.backends()\n"
        "print(a, torch.cuda.is_initialized())\n"
    )
    assert out.split() == ["False", "False"]


def test_works_without_compiled_extension():
    out = run_py(
        "import sys\n"
        "sys.modules['d9d_kernels._C'] = None  # import of _C now raises ImportError\n"
        "import torch, d9d_kernels as dk\n"
        "from d9d_kernels import _extension, reference\n"
        "s, b = torch.zeros(9, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)\n"
        "dk.ops.weighted_moments(torch.tensor([1.0, 2.0, 3.0]), state=s, bad=b)\n"
        "print(s[1].item() / s[0].item())\n"
        "print('cpp' in dk.ops.backends(), 'torch' in dk.ops.backends())\n"
        "print(_extension.CPP_ERROR)\n"
        "try:\n"
        "    dk.ops.weighted_moments(torch.ones(2), state=s, bad=b, backend='cpp')\n"
        "except RuntimeError as e:\n"
        "    print('FORCED:', e)\n"
    )
    lines = out.strip().splitlines()
    assert lines[0] == "2.0"
    assert lines[1] == "False True"
    assert "d9d_kernels._C could not be imported" in lines[2]
    assert lines[3].startswith("FORCED:") and "'cpp'" in lines[3] and "could not be imported" in lines[3]


def _cuda_build_expected() -> bool:
    if os.environ.get("D9D_KERNELS_BUILD_CUDA", "auto").lower() in ("0", "false", "no", "off"):
        return False
    if torch.version.cuda is None:
        return False
    spec = importlib.util.spec_from_file_location("_d9d_setup_probe", os.path.join(ROOT, "setup.py"))
    src = open(os.path.join(ROOT, "setup.py")).read()
    # only the toolkit probe of setup.py (running the file would call setup())
    ns: dict = {"__file__": spec.origin}
    exec(compile(src.split("def want_cuda")[0], spec.origin, "exec"), ns)
    return ns["find_cuda_home"]() is not None


@pytest.mark.skipif("cpp" not in dk.ops.backends(), reason="compiled extension not built")
def test_every_op_has_cpu_and_expected_cuda_kernels():
    for op in _extension.OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"d9d_kernels::{op}", "CPU"), op
    if not _cuda_build_expected():
        pytest.skip("this build was not expected to include CUDA kernels")
    for op in _extension.OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"d9d_kernels::{op}", "CUDA"), op
    assert "cuda" in dk.ops.backends()


def test_backends_content():
    b = dk.ops.backends()
    assert b[-1] == "torch" and len(set(b)) == len(b)
    assert set(b) <= {"cpp", "cuda", "triton", "torch"}
    assert ("cpp" in b) == (_extension.CPP_ERROR is None)
    assert ("triton" in b) == (importlib.util.find_spec("triton") is not None)


def test_forced_backend_env():
    code = (
        "import torch, d9d_kernels as dk\n"
        "from unittest import mock\n"
        "import d9d_kernels.reference as ref\n"
        "s, b = torch.full((2,), float('-inf'), dtype=torch.float64), torch.zeros(1, dtype=torch.float64)\n"
        "with mock.patch.object(ref, 'running_extrema', wraps=ref.running_extrema) as spy:\n"
        "    dk.ops.running_extrema(torch.tensor([1.0, -4.0]), state=s, bad=b)\n"
        "print(spy.call_count, s.tolist())\n"
    )
    assert run_py(code, D9D_KERNELS_BACKEND="torch").split()[0] == "1"  # forced: the reference ran
    if "cpp" in dk.ops.backends():
        assert run_py(code).split()[0] == "0"  # auto on CPU: the C++ kernel ran
    with pytest.raises(ValueError, match=r"d9d_kernels\.running_extrema: backend must be one of"):
        run_forced("nope")
    with pytest.raises(RuntimeError, match=r"backend 'cuda' can't run on cpu"):
        run_forced("cuda")


def run_forced(name: str) -> None:
    s, b = torch.full((2,), float("-inf"), dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
    old = os.environ.get("D9D_KERNELS_BACKEND")
    os.environ["D9D_KERNELS_BACKEND"] = name
    try:
        dk.ops.running_extrema(torch.tensor([1.0]), state=s, bad=b)
    finally:
        if old is None:
            del os.environ["D9D_KERNELS_BACKEND"]
        else:
            os.environ["D9D_KERNELS_BACKEND"] = old
