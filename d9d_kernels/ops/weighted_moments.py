"""weighted_moments: one pass of Σw, Σw·x, Σw·x², and with y the cross and error sums.

Slots of ``state`` are named in ``d9d_kernels.reference.MOMENTS``; the
reference there is the specification.
"""

from __future__ import annotations

import functools

import torch

from d9d_kernels.ops._common import as_real, broadcast, float_dtype, same_shape
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
        x: any shape, floating, integer or bool (integers are read as float64, exactly).
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
    x = as_real(OP, "x", x)
    shape = x.shape
    if y is not None:
        same_shape(OP, "y", as_real(OP, "y", y), shape, "x")
    weights = broadcast(OP, "weights", weights, shape)
    mask = broadcast(OP, "mask", mask, shape)
    flat = [None if t is None else t.reshape(-1) for t in (x, y, weights, mask)]
    # the compiled kernels promote integer and mixed dtypes themselves (as float_dtype does)
    if pick(OP, x.device, backend) not in ("cpp", "cuda"):
        dtype = functools.reduce(torch.promote_types, [float_dtype(t) for t in flat[:3] if t is not None])
        flat[:3] = [None if t is None else t.to(dtype) for t in flat[:3]]
    run(OP, x.device, backend, *flat, skip_bad, state, bad, pivot)
