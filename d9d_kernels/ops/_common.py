"""What the op wrappers share: dtype sets, errors, and the input conversions.

A wrapper turns user-shaped inputs into the op's raw arguments (flattened,
int64 indices, broadcast masks) and checks only what its conversion would
hide (a shape that flattening would make fit, an input it cannot convert).
Every other argument check is the op's own, written once in C++
(``csrc/kernels/*_checks.h``) and run by every backend (see ``_dispatch``).
"""

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


def as_real(op: str, arg: str, t) -> torch.Tensor:
    """``t`` as it is, checked to be a real tensor (what every conversion needs)."""
    if isinstance(t, torch.Tensor) and not t.is_complex():
        return t
    if not isinstance(t, torch.Tensor):
        fail(op, arg, f"must be a torch.Tensor, got {type(t).__name__}", TypeError)
    fail(op, arg, f"must be real, got {t.dtype}", TypeError)


def broadcast(op: str, arg: str, t: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    """``t`` (a mask or weights) broadcast to ``shape``, or None."""
    if t is None:
        return None
    t = as_real(op, arg, t)
    try:
        return torch.broadcast_to(t, shape)
    except RuntimeError:
        fail(op, arg, f"of shape {tuple(t.shape)} does not broadcast to {tuple(shape)}")


def same_shape(op: str, arg: str, t: torch.Tensor, shape: torch.Size, of: str) -> None:
    """``t`` has ``shape`` exactly (checked before flattening would hide it)."""
    if t.shape != shape:
        fail(op, arg, f"must have the shape of {of} {tuple(shape)}, got {tuple(t.shape)}")


def float_dtype(t: torch.Tensor) -> torch.dtype:
    """The floating dtype ``t`` is read in: its own, or float64 for integers / bool (exact)."""
    return t.dtype if t.dtype in FLOATS else torch.float64


def as_float(op: str, arg: str, t) -> torch.Tensor:
    """A floating tensor; integer/bool inputs become float64, which holds them
    exactly (float32 rounds counts past 2^24)."""
    t = as_real(op, arg, t)
    return t if t.dtype in FLOATS else t.to(torch.float64)


def as_index(op: str, arg: str, t) -> torch.Tensor:
    """An int64 tensor of class indices / 0-1 labels.

    Floating values that are not whole numbers become ``BAD_INDEX`` (counted as
    bad by the kernels) - checked on the device, never on the host.
    """
    t = as_real(op, arg, t)
    if t.dtype == torch.int64:
        return t
    if t.is_floating_point():
        whole = torch.isfinite(t) & (t == torch.round(t)) & (t.abs() < 2**62)
        return torch.where(whole, t, torch.full_like(t, BAD_INDEX)).to(torch.int64)
    return t.to(torch.int64)
