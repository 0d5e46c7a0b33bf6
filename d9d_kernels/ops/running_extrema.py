"""running_extrema: running max and (negated) min in one MAX-reducible state.

The reference in ``d9d_kernels.reference`` is the specification.
"""

from __future__ import annotations

import torch

from d9d_kernels.ops._common import as_float, broadcast
from d9d_kernels.ops._dispatch import run

OP = "running_extrema"


def running_extrema(
    x: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    state: torch.Tensor,
    bad: torch.Tensor,
    skip_bad: bool = False,
    backend: str | None = None,
) -> None:
    """Folds ``max(x)`` and ``-min(x)`` into ``state``.

    Args:
        x: any shape, floating, integer or bool (integers are read as float64, exactly).
        mask: bool broadcastable to ``x`` or ``None``.
        state: float64 ``[2]`` = (max, -min), initialised to ``-inf``.
        bad: float64 ``[1]``: += valid NaN/±Inf elements.
        skip_bad: leave NaN out instead of propagating it.
        backend: force ``"cpp" | "cuda" | "triton" | "torch"``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> st = torch.full((2,), float("-inf"), dtype=torch.float64)
        >>> dk.ops.running_extrema(torch.tensor([3.0, -1.0]), state=st, bad=torch.zeros(1, dtype=torch.float64))
        >>> st.tolist()
        [3.0, 1.0]
    """
    x = as_float(OP, "x", x)
    mask = broadcast(OP, "mask", mask, x.shape)
    run(OP, x.device, backend, x.reshape(-1), None if mask is None else mask.reshape(-1), skip_bad, state, bad)
