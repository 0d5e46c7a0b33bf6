"""Which implementation runs an op: the dispatcher's, unless a backend is forced.

Auto: ``torch.ops.d9d_kernels.<op>``, whose kernel the dispatcher picks by
device: the C++ CPU kernel, the CUDA kernel, or, in a build without CUDA
kernels, the Triton launcher (the PyTorch reference without Triton),
registered here as the op's CUDA kernel. Without the extension there is no
dispatcher op: Triton on CUDA, else the reference.

Forced (``backend=`` on a call, else ``D9D_KERNELS_BACKEND``): that backend's
implementation, one of ``"cpp"`` / ``"cuda"`` (the compiled kernels),
``"triton"`` and ``"torch"`` (``d9d_kernels.reference``). Before a Triton or
reference call the op's meta kernel runs its argument checks, the C++ ones
every compiled kernel runs first (``csrc/kernels/*_checks.h``), so each
backend refuses the same arguments with the same message.

Every backend takes the same positional arguments (the reference's, which
the ``torch.ops.d9d_kernels`` schemas mirror), so nothing here adapts them.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from d9d_kernels import _extension, reference
from d9d_kernels._extension import OPS

BACKENDS = ("cpp", "cuda", "triton", "torch")
_META = torch._C.DispatchKeySet(torch._C.DispatchKey.Meta)


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


def _forced(op: str, device: torch.device, backend: str | None) -> str | None:
    forced = backend or os.environ.get("D9D_KERNELS_BACKEND") or None
    if forced is None:
        return None
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


def pick(op: str, device: torch.device, backend: str | None) -> str:
    """The backend that runs ``op`` on ``device``; raises if a forced one can't."""
    forced = _forced(op, device, backend)
    if forced is not None:
        return forced
    if device.type == "cpu":
        return "cpp" if _extension.HAS_CPP else "torch"
    if device.type == "cuda":
        if _extension.HAS_CUDA_KERNELS:
            return "cuda"
        if _extension.HAS_TRITON:
            return "triton"
    return "torch"


def _triton(op: str) -> Callable:
    # Imported on first use: importing triton costs seconds and is not needed on
    # CPU. Static import statements, because torch.compile traces them (it
    # refuses importlib.import_module); they also bind the package attributes.
    import d9d_kernels.triton as package
    from d9d_kernels.triton import binary_stats, class_stats, running_extrema, score_histogram  # noqa: F401
    from d9d_kernels.triton import expert_histogram, weighted_moments  # noqa: F401

    return getattr(getattr(package, op), op)


def _python(op: str, backend: str) -> Callable:
    """The Triton launcher or the reference (looked up at every call: a test may
    replace one, and the Triton modules load lazily)."""
    return _triton(op) if backend == "triton" else getattr(reference, op)


def _dispatcher_op(op: str):
    return getattr(torch.ops.d9d_kernels, op).default if _extension.HAS_CPP else None


def raw(op: str, device: torch.device | str = "cpu", backend: str | None = None) -> Callable:
    """The implementation that ``dk.ops.<op>`` runs on ``device``, without the
    wrapper's conversions.

    It takes the raw positional arguments of ``d9d_kernels.reference.<op>``
    (flattened inputs, int64 indices, bool masks, float64 contiguous state).
    Unforced, it is ``torch.ops.d9d_kernels.<op>.default`` (the dispatcher
    picks the kernel) when the extension is built, else the Triton launcher
    or the pure-PyTorch reference.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> st, bad = torch.full((2,), float("-inf"), dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        >>> dk.ops.raw("running_extrema")(torch.tensor([3.0, -1.0]), None, False, st, bad)
        >>> st.tolist()
        [3.0, 1.0]
    """
    if op not in OPS:
        raise ValueError(f"d9d_kernels.ops.raw: argument 'op' must be one of {OPS}, got {op!r}")
    device = torch.device(device)
    compiled = _dispatcher_op(op)
    forced = _forced(op, device, backend)
    if forced in ("cpp", "cuda") or (forced is None and compiled is not None):
        return compiled
    name = forced or pick(op, device, None)
    if compiled is None:
        return _python(op, name)

    def checked(*args):
        if not torch.compiler.is_compiling():  # traced, the impl's own fake stands in
            compiled.redispatch(_META, *args)
        _python(op, name)(*args)

    return checked


def run(op: str, device: torch.device, backend: str | None, *args) -> None:
    """Runs ``op`` with raw positional ``args`` where ``raw`` says."""
    raw(op, device, backend)(*args)


def _register_cuda_fallbacks() -> None:
    """In a build without CUDA kernels, the Triton launcher (else the
    reference) is each op's CUDA kernel, so the dispatcher picks it."""
    if not _extension.HAS_CPP or _extension.HAS_CUDA_KERNELS:
        return
    backend = "triton" if _extension.HAS_TRITON else "torch"
    lib = torch.library.Library("d9d_kernels", "IMPL")  # noqa: TOR901  (kept alive below)
    for op in OPS:
        lib.impl(op, lambda *args, _op=op: _python(_op, backend)(*args), "CUDA")
    _register_cuda_fallbacks.library = lib


_register_cuda_fallbacks()
