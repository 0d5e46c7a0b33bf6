"""Input preparation shared by the op wrappers: dtype sets, checks, conversions."""

from __future__ import annotations

import torch

#: Floating dtypes every kernel reads (converted to float64 per element).
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Targets that are not integral (0.5, NaN) become this index: out of range for
# every op, so they are counted as bad instead of silently truncated.
BAD_INDEX = 2**62


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
    # One combined test on the happy path: building the messages eagerly costs
    # ~3 us per state tensor (cProfile, bench/bench_kernels.py at N=1).
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


def _check_real(op: str, arg: str, t, device: torch.device) -> None:
    """A real tensor on ``device`` (messages are only built on failure)."""
    if isinstance(t, torch.Tensor) and t.device == device and not t.is_complex():
        return
    if not isinstance(t, torch.Tensor):
        fail(op, arg, f"must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.device != device:
        fail(op, arg, f"must be on {device}, got {t.device}")
    fail(op, arg, f"must be real, got {t.dtype}", TypeError)


def as_real(op: str, arg: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` as it is, checked to be a real tensor on ``device``."""
    _check_real(op, arg, t, device)
    return t


def float_dtype(t: torch.Tensor) -> torch.dtype:
    """The floating dtype ``t`` is read in: its own, or float64 for integers / bool (exact)."""
    return t.dtype if t.dtype in FLOATS else torch.float64


def as_float(op: str, arg: str, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A floating tensor on ``device``; integer/bool inputs become float64,
    which holds them exactly (float32 rounds counts past 2^24)."""
    _check_real(op, arg, t, device)
    if t.dtype in FLOATS:
        return t
    return t.to(torch.float64)


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
