"""Input preparation shared by the op wrappers: flatten, promote, check."""

from __future__ import annotations

import torch

from d9d_kernels.ops._dispatch import FLOATS, fail

# Targets that are not integral (0.5, NaN) become this index: out of range for
# every op, so they are counted as bad instead of silently truncated.
BAD_INDEX = 2**62


def _check_real(op: str, arg: str, t, device: torch.device) -> None:
    """A real tensor on ``device`` (messages are only built on failure)."""
    if isinstance(t, torch.Tensor) and t.device == device and not t.is_complex():
        return
    if not isinstance(t, torch.Tensor):
        fail(op, arg, f"must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.device != device:
        fail(op, arg, f"must be on {device}, got {t.device}")
    fail(op, arg, f"must be real, got {t.dtype}", TypeError)


def as_float(op: str, arg: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A floating tensor on ``device``; integer/bool inputs become float32."""
    _check_real(op, arg, t, device)
    if t.dtype in FLOATS:
        return t
    return t.to(torch.float32)


def as_index(op: str, arg: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An int64 tensor of class indices / 0-1 labels on ``device``.

    Floating values that are not whole numbers become ``BAD_INDEX`` (counted as
    bad by the kernels) - checked on the device, never on the host.
    """
    _check_real(op, arg, t, device)
    if t.dtype == torch.int64:
        return t
    if t.is_floating_point():
        whole = torch.isfinite(t) & (t == torch.round(t)) & (t.abs() < 2**62)
        return torch.where(whole, t, torch.full_like(t, BAD_INDEX)).to(torch.int64)
    return t.to(torch.int64)
