"""class_stats: multiclass per-class tp / predicted / target counts in one pass.

From class indices ``[N]`` or straight from scores/logits ``[N, C]`` (argmax,
several top-k at once, optional target NLL by log-sum-exp), with an optional
``[C, C]`` confusion matrix. The reference in ``d9d_kernels.reference`` is
the specification (tie rule included).
"""

from __future__ import annotations

import torch

from d9d_kernels.ops._common import FLOATS, as_index, as_real, broadcast, fail, same_shape
from d9d_kernels.ops._dispatch import run

OP = "class_stats"


def class_stats(
    preds: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    num_classes: int,
    stats: torch.Tensor,
    extras: torch.Tensor,
    bad: torch.Tensor,
    confmat: torch.Tensor | None = None,
    ignore_index: int | None = None,
    top_ks: tuple[int, ...] | list[int] = (1,),
    nll: bool = False,
    backend: str | None = None,
) -> None:
    """Adds multiclass statistics of one batch into the state tensors.

    Args:
        preds: integer class indices of ``target``'s shape, or floating
            scores/logits of shape ``target.shape + (num_classes,)``.
        target: integer class indices, any shape (flattened), e.g. ``[N]``
            or ``[B, T]``.
        mask: bool broadcastable to ``target`` or ``None``.
        num_classes: C.
        stats: float64 ``[len(top_ks), 3, C]`` (tp, predicted, target per class).
        extras: float64 ``[2]``: valid rows, NLL sum.
        bad: float64 ``[2]``: rows left out, by cause: ``[0]`` an out-of-range
            target (or index pred), ``[1]`` NaN/+Inf (or only -Inf) scores.
        confmat: float64 ``[C, C]`` (rows = target, cols = argmax) or ``None``.
        ignore_index: target value whose rows are dropped, or ``None``.
        top_ks: distinct k's, ``1 <= k <= C`` (only ``(1,)`` for index preds).
            Empty with ``nll`` and scores: the NLL alone (``stats`` is
            ``[0, 3, C]``, no bytes), as Perplexity without the classes.
        nll: accumulate ``logsumexp(s) - s[target]`` (scores only).
        backend: force ``"cpp" | "cuda" | "triton" | "torch"``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> st = torch.zeros(1, 3, 3, dtype=torch.float64)
        >>> ex, bad = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        >>> dk.ops.class_stats(torch.tensor([0, 2, 1]), torch.tensor([0, 1, 1]),
        ...                    num_classes=3, stats=st, extras=ex, bad=bad)
        >>> st[0, 0].tolist()  # true positives per class
        [1.0, 1.0, 0.0]
    """
    if not (isinstance(num_classes, int) and num_classes >= 1):
        fail(OP, "num_classes", f"must be an int >= 1, got {num_classes!r}")
    preds = as_real(OP, "preds", preds)
    target = as_index(OP, "target", target)
    C, n = num_classes, target.numel()
    if preds.dtype in FLOATS:  # scores [..., C]: the rows are flattened
        if preds.shape != target.shape + (C,):
            fail(OP, "preds", f"scores must have shape target.shape + (num_classes,) = {tuple(target.shape) + (C,)}, "
                 f"got {tuple(preds.shape)}")
        preds = preds.reshape(n, C)
    else:
        if preds.dtype == torch.bool:
            fail(OP, "preds", f"must be integer indices or floating scores, got {preds.dtype}", TypeError)
        same_shape(OP, "preds", preds, target.shape, "target")
        preds = preds.reshape(-1).to(torch.int64)
    mask = broadcast(OP, "mask", mask, target.shape)
    mask = None if mask is None else mask.reshape(-1)
    top_ks = [int(k) for k in top_ks]
    run(OP, preds.device, backend, preds, target.reshape(-1), mask, C, ignore_index, top_ks, nll, stats, confmat,
        extras, bad)
