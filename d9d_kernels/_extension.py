"""Loads the compiled extension ``d9d_kernels._C`` once and reports backends.

Importing this module never initialises CUDA: availability comes from the
dispatcher (which kernels were registered), not from a visible GPU.
A missing or broken ``_C`` is a supported state: ``CPP_ERROR`` says why and
the ops fall back to Triton or the pure-PyTorch reference.
"""

from __future__ import annotations

import importlib.util
import os

import torch

OPS = ("weighted_moments", "class_stats", "binary_stats", "score_histogram", "running_extrema", "expert_histogram")

CPP_ERROR: str | None = None
try:
    from d9d_kernels import _C  # noqa: F401  (registers torch.ops.d9d_kernels.*)
except ImportError as e:  # pragma: no cover - exercised by the no-extension test
    CPP_ERROR = (
        f"d9d_kernels._C could not be imported ({e}); falling back to the Triton/PyTorch "
        "kernels. Build it with `pip install --no-build-isolation -e .`."
    )


def _has_kernel(op: str, key: str) -> bool:
    name = f"d9d_kernels::{op}"
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
    except RuntimeError:  # op not registered at all
        return False


HAS_CPP: bool = CPP_ERROR is None and all(_has_kernel(op, "CPU") for op in OPS)
HAS_CUDA_KERNELS: bool = CPP_ERROR is None and all(_has_kernel(op, "CUDA") for op in OPS)
HAS_TRITON: bool = importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    if not HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
