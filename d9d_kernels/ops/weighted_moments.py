"""weighted_moments: one pass of Σw, Σw·x, Σw·x², and with y the cross and error sums.

Slots of ``state`` are named in ``d9d_kernels.reference.MOMENTS``; the
reference there is the specification.
"""

from __future__ import annotations

import torch

from d9d_kernels import reference
from d9d_kernels.ops._common import as_real, check_mask, check_state, fail, float_dtype
from d9d_kernels.ops._dispatch import pick, run

OP = "weighted_moments"


def weighted_moments(
    x: torch.Tensor,
    y: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    *,
    state: torch.Tensor,
    bad: torch.Tensor,
    pivot: torch.Tensor | None = None,
    skip_bad: bool = False,
    backend: str | None = None,
) -> None:
    """Adds the weighted moments of ``x`` (and ``y``) into ``state``.

    Args:
        x: any shape, floating (integers are promoted to float32).
        y: same shape as ``x`` or ``None``.
        weights: broadcastable to ``x`` or ``None`` (all ones).
        mask: bool, broadcastable to ``x``, or ``None``.
        state: float64 ``[MOMENTS_SIZE]`` (9) on ``x``'s device, added to.
        bad: float64 ``[1]``; += valid elements with a non-finite x, y or w.
        pivot: float64 ``[2]`` or ``None``; NaN = unset (set from the data).
        skip_bad: leave non-finite elements out of the sums.
        backend: force ``"cpp" | "cuda" | "triton" | "torch"``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> s, b = torch.zeros(9, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        >>> dk.ops.weighted_moments(torch.tensor([1.0, 2.0, 3.0]), state=s, bad=b)
        >>> (s[1] / s[0]).item()
        2.0
    """
    dev = x.device if isinstance(x, torch.Tensor) else torch.device("cpu")
    x = as_real(OP, "x", x, dev)
    shape = x.shape
    dtype = float_dtype(x)
    if y is not None:
        y = as_real(OP, "y", y, dev)
        if not (y.shape == shape):
            fail(OP, "y", f"must have the shape of x {tuple(shape)}, got {tuple(y.shape)}")
        dtype = torch.promote_types(dtype, float_dtype(y))
    if weights is not None:
        weights = as_real(OP, "weights", weights, dev)
        try:
            weights = torch.broadcast_to(weights, shape)
        except RuntimeError:
            fail(OP, "weights", f"of shape {tuple(weights.shape)} does not broadcast to {tuple(shape)}")
        dtype = torch.promote_types(dtype, float_dtype(weights))
    mask = check_mask(OP, mask, shape, dev)
    check_state(OP, "state", state, (reference.MOMENTS_SIZE,), dev)
    check_state(OP, "bad", bad, (1,), dev)
    if pivot is not None:
        check_state(OP, "pivot", pivot, (2,), dev)

    # the compiled kernels promote integer and mixed dtypes themselves (as float_dtype does)
    cast = (lambda t: t) if pick(OP, dev, backend) in ("cpp", "cuda") else (lambda t: t.to(dtype))  # noqa: E731
    x = cast(x.reshape(-1))
    y = None if y is None else cast(y.reshape(-1))
    weights = None if weights is None else cast(weights.reshape(-1))
    mask = None if mask is None else mask.reshape(-1)
    run(OP, dev, backend, x, y, weights, mask, skip_bad, state, bad, pivot)
