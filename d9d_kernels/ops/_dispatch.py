"""Backend choice and the one table that maps (op, backend) to an implementation.

Backends: ``"cpp"`` (C++ CPU kernels in ``_C``), ``"cuda"`` (CUDA kernels in
``_C``), ``"triton"`` and ``"torch"`` (``d9d_kernels.reference``).
``backend=`` on a call wins over the ``D9D_KERNELS_BACKEND`` environment
variable, which wins over auto: cpp on CPU; cuda, else triton, on GPU;
torch when nothing compiled fits.

Every backend implements an op with the same positional arguments (the
reference's, which the ``torch.ops.d9d_kernels`` schemas mirror), so the
wrappers and ``raw`` only choose, never adapt.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from d9d_kernels import _extension, reference
from d9d_kernels._extension import OPS

BACKENDS = ("cpp", "cuda", "triton", "torch")


def backends() -> list[str]:
    """Backends usable in this process (without initialising CUDA)."""
    out = []
    if _extension.HAS_CPP:
        out.append("cpp")
    if _extension.HAS_CUDA_KERNELS:
        out.append("cuda")
    if _extension.HAS_TRITON:
        out.append("triton")
    out.append("torch")
    return out


def pick(op: str, device: torch.device, backend: str | None) -> str:
    """The backend that runs ``op`` on ``device``; raises if a forced one can't."""
    forced = backend or os.environ.get("D9D_KERNELS_BACKEND") or None
    if forced is not None:
        if forced not in BACKENDS:
            raise ValueError(f"d9d_kernels.{op}: backend must be one of {BACKENDS}, got {forced!r}")
        ok = {
            "cpp": _extension.HAS_CPP and device.type == "cpu",
            "cuda": _extension.HAS_CUDA_KERNELS and device.type == "cuda",
            "triton": _extension.triton_usable(device),
            "torch": True,
        }[forced]
        if not ok:
            why = _extension.CPP_ERROR or "not available for this device"
            raise RuntimeError(f"d9d_kernels.{op}: backend {forced!r} can't run on {device}: {why}")
        return forced
    if device.type == "cpu":
        return "cpp" if _extension.HAS_CPP else "torch"
    if device.type == "cuda":
        if _extension.HAS_CUDA_KERNELS:
            return "cuda"
        if _extension.HAS_TRITON:
            return "triton"
    return "torch"


def _compiled(op: str) -> Callable:
    return getattr(torch.ops.d9d_kernels, op).default


def _triton(op: str) -> Callable:
    # Imported on first use: importing triton costs seconds and is not needed on
    # CPU. Static import statements, because torch.compile traces them (it
    # refuses importlib.import_module); they also bind the package attributes.
    import d9d_kernels.triton as package
    from d9d_kernels.triton import binary_stats, class_stats, running_extrema, score_histogram  # noqa: F401
    from d9d_kernels.triton import weighted_moments  # noqa: F401

    return getattr(getattr(package, op), op)


def _reference(op: str) -> Callable:
    return getattr(reference, op)


# Looked up at every call (not cached): a test may replace a launcher or a
# reference function, and the triton modules load lazily.
_IMPLEMENTATIONS: dict[str, Callable[[str], Callable]] = {
    "cpp": _compiled,
    "cuda": _compiled,
    "triton": _triton,
    "torch": _reference,
}


def raw(op: str, device: torch.device | str = "cpu", backend: str | None = None) -> Callable:
    """The unchecked implementation that ``dk.ops.<op>`` runs on ``device``.

    The compiled ``torch.ops.d9d_kernels.<op>.default`` where ``_C`` serves
    ``device``, else the Triton launcher or the pure-PyTorch reference (so it
    works without the extension). It takes the raw positional arguments of
    ``d9d_kernels.reference.<op>`` (flattened inputs, int64 indices, bool
    masks, float64 contiguous state) and checks nothing: callers that already
    validated an input signature use it to skip the wrapper's checks.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> st, bad = torch.full((2,), float("-inf"), dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        >>> dk.ops.raw("running_extrema")(torch.tensor([3.0, -1.0]), None, False, st, bad)
        >>> st.tolist()
        [3.0, 1.0]
    """
    if op not in OPS:
        raise ValueError(f"d9d_kernels.ops.raw: argument 'op' must be one of {OPS}, got {op!r}")
    return _IMPLEMENTATIONS[pick(op, torch.device(device), backend)](op)


def run(op: str, device: torch.device, backend: str | None, *args) -> None:
    """Runs ``op`` on the backend ``pick`` chooses, with raw positional ``args``."""
    _IMPLEMENTATIONS[pick(op, device, backend)](op)(*args)
