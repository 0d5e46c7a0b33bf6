"""Backend choice shared by every op wrapper.

Backends: ``"cpp"`` (C++ CPU kernels in ``_C``), ``"cuda"`` (CUDA kernels in
``_C``), ``"triton"`` and ``"torch"`` (``d9d_kernels.reference``).
``backend=`` on a call wins over the ``D9D_KERNELS_BACKEND`` environment
variable, which wins over auto: cpp on CPU; cuda, else triton, on GPU;
torch when nothing compiled fits.
"""

from __future__ import annotations

import os

import torch

from d9d_kernels import _extension

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


def fail(op: str, arg: str, msg: str, exc: type = ValueError):
    """Raises ``exc`` naming the op and the argument."""
    raise exc(f"d9d_kernels.{op}: argument '{arg}' {msg}")


def check(cond: bool, op: str, arg: str, msg: str, exc: type = ValueError) -> None:
    """Metadata check with a constant message (use ``if not ...: fail(...)`` when
    the message is an f-string, so it is only built on failure)."""
    if not cond:
        fail(op, arg, msg, exc)


def check_state(op: str, arg: str, t: torch.Tensor, shape: tuple, device: torch.device) -> None:
    """A state tensor must be float64, contiguous, of ``shape``, on ``device``."""
    # One combined test on the happy path: building the messages eagerly cost
    # ~3 us per state tensor (cProfile, bench_kernels N=1).
    if (
        isinstance(t, torch.Tensor)
        and t.dtype == torch.float64
        and t.shape == shape
        and t.device == device
        and t.is_contiguous()
    ):
        return
    check(isinstance(t, torch.Tensor), op, arg, "must be a torch.Tensor", TypeError)
    check(t.dtype == torch.float64, op, arg, f"must be float64, got {t.dtype}", TypeError)
    check(tuple(t.shape) == tuple(shape), op, arg, f"must have shape {tuple(shape)}, got {tuple(t.shape)}")
    check(t.device == device, op, arg, f"must be on {device}, got {t.device}")
    check(t.is_contiguous(), op, arg, "must be contiguous")


def check_mask(op: str, mask: torch.Tensor | None, shape: tuple, device: torch.device):
    """Returns the mask broadcast to ``shape`` (bool) or None."""
    if mask is None:
        return None
    check(isinstance(mask, torch.Tensor), op, "mask", "must be a bool tensor or None", TypeError)
    if mask.dtype != torch.bool:
        fail(op, "mask", f"must be bool, got {mask.dtype}", TypeError)
    if mask.device != device:
        fail(op, "mask", f"must be on {device}, got {mask.device}")
    try:
        return torch.broadcast_to(mask, shape)
    except RuntimeError:
        fail(op, "mask", f"of shape {tuple(mask.shape)} does not broadcast to {tuple(shape)}")


FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
