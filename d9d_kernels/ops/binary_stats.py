"""binary_stats: per-label tp / fp / tn / fn for binary and multilabel tasks.

The reference in ``d9d_kernels.reference`` is the specification.
"""

from __future__ import annotations

import torch

from d9d_kernels import reference
from d9d_kernels.ops._common import FLOATS, as_float, as_index, as_real, broadcast, same_shape
from d9d_kernels.ops._dispatch import run

OP = "binary_stats"


def binary_stats(
    preds: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    state: torch.Tensor,
    bad: torch.Tensor,
    threshold: float = 0.5,
    ignore_index: int | None = None,
    input_kind: int = reference.INPUT_AUTO,
    backend: str | None = None,
) -> None:
    """Adds per-label confusion counts of one batch into ``state``.

    Args:
        preds: ``[N]`` (binary, L = 1) or ``[N, L]`` (multilabel); floating
            probabilities/logits, or integer/bool 0/1.
        target: same shape as ``preds``; 0/1 (integer, bool or floating).
        mask: bool broadcastable to ``target`` or ``None``.
        state: float64 ``[L, 4]`` (tp, fp, tn, fn per label).
        bad: float64 ``[2]``: entries left out, by cause: ``[0]`` a target not
            in {0, 1}, ``[1]`` a NaN/Inf pred.
        threshold: positive iff probability > threshold.
        ignore_index: target value whose entries are dropped, or ``None``.
        input_kind: ``reference.INPUT_PROBS | INPUT_LOGITS | INPUT_AUTO``.
        backend: force ``"cpp" | "cuda" | "triton" | "torch"``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> st, bad = torch.zeros(1, 4, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        >>> dk.ops.binary_stats(torch.tensor([0.9, 0.2, 0.7]), torch.tensor([1, 0, 0]), state=st, bad=bad)
        >>> st.tolist()  # tp, fp, tn, fn
        [[1.0, 1.0, 1.0, 0.0]]
    """
    if as_real(OP, "preds", preds).dtype not in FLOATS:  # 0/1 values: probabilities
        input_kind = reference.INPUT_PROBS
    preds = as_float(OP, "preds", preds)
    target = as_index(OP, "target", target)
    same_shape(OP, "target", target, preds.shape, "preds")
    mask = broadcast(OP, "mask", mask, target.shape)
    n_lab = 1 if preds.dim() <= 1 else preds.shape[-1]
    preds, target = preds.reshape(-1, n_lab), target.reshape(-1, n_lab)
    mask = None if mask is None else mask.reshape(-1, n_lab)
    run(OP, preds.device, backend, preds, target, mask, float(threshold), ignore_index, int(input_kind), state, bad)
