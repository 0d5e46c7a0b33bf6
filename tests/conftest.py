"""Shared fixtures: backend parametrisation, gpu marker, deterministic seeds."""

from __future__ import annotations

import os

import pytest
import torch  # does not import triton

# Without a GPU, Triton kernels run on CPU tensors in the interpreter. Must be
# set before `import triton` anywhere in the test process. On a GPU machine
# they run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import d9d_kernels as dk  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: that also holds directory names
            item.add_marker(skip)


def cpu_backends() -> list[str]:
    """Backends that can run on CPU tensors in this process."""
    out = [b for b in dk.ops.backends() if b in ("cpp", "torch")]
    if "triton" in dk.ops.backends():
        out.append("triton")
    return out


@pytest.fixture(params=cpu_backends())
def backend(request):
    """Every backend that runs on CPU here (triton through TRITON_INTERPRET=1)."""
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
