"""Input preparation shared by the op wrappers: flatten, promote, check."""

from __future__ import annotations

import torch

from d9d_kernels.ops._dispatch import FLOATS, check

# Targets that are not integral (0.5, NaN) become this index: out of range for
# every op, so they are counted as bad instead of silently truncated.
BAD_INDEX = 2**62


def as_float(op: str, arg: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A floating tensor on ``device``; integer/bool inputs become float32."""
    check(isinstance(t, torch.Tensor), op, arg, f"must be a torch.Tensor, got {type(t).__name__}", TypeError)
    check(t.device == device, op, arg, f"must be on {device}, got {t.device}")
    if t.dtype in FLOATS:
        return t
    check(not t.is_complex(), op, arg, f"must be real, got {t.dtype}", TypeError)
    return t.to(torch.float32)


def as_index(op: str, arg: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An int64 tensor of class indices / 0-1 labels on ``device``.

    Floating values that are not whole numbers become ``BAD_INDEX`` (counted as
    bad by the kernels) - checked on the device, never on the host.
    """
    check(isinstance(t, torch.Tensor), op, arg, f"must be a torch.Tensor, got {type(t).__name__}", TypeError)
    check(t.device == device, op, arg, f"must be on {device}, got {t.device}")
    check(not t.is_complex(), op, arg, f"must be real, got {t.dtype}", TypeError)
    if t.dtype == torch.int64:
        return t
    if t.is_floating_point():
        whole = torch.isfinite(t) & (t == torch.round(t)) & (t.abs() < 2**62)
        return torch.where(whole, t, torch.full_like(t, BAD_INDEX)).to(torch.int64)
    return t.to(torch.int64)
