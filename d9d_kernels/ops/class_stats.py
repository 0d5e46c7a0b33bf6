"""class_stats: multiclass per-class tp / predicted / target counts in one pass.

From class indices ``[N]`` or straight from scores/logits ``[N, C]`` (argmax,
several top-k at once, optional target NLL by log-sum-exp), with an optional
``[C, C]`` confusion matrix. The reference in ``d9d_kernels.reference`` is
the specification (tie rule included).
"""

from __future__ import annotations

import torch

from d9d_kernels.ops._common import FLOATS, as_index, check, check_mask, check_state, fail
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
    check(isinstance(preds, torch.Tensor), OP, "preds", "must be a torch.Tensor", TypeError)
    dev = preds.device
    target = as_index(OP, "target", target, dev)
    C = num_classes
    scores = preds.dtype in FLOATS
    if scores:
        if tuple(preds.shape) != tuple(target.shape) + (C,):
            fail(OP, "preds", f"scores must have shape target.shape + (num_classes,) = {tuple(target.shape) + (C,)}, got {tuple(preds.shape)}")
    else:
        if preds.is_complex() or preds.dtype == torch.bool:
            fail(OP, "preds", f"must be integer indices or floating scores, got {preds.dtype}", TypeError)
        if not (tuple(preds.shape) == tuple(target.shape)):
            fail(OP, "preds", f"indices must have the shape of target {tuple(target.shape)}, got {tuple(preds.shape)}")
        preds = preds.to(torch.int64)
    top_ks = [int(k) for k in top_ks]
    if not ((len(top_ks) >= 1 or (nll and scores)) and len(set(top_ks)) == len(top_ks)):
        fail(OP, "top_ks", f"must be distinct and non-empty (empty only with nll and scores), got {top_ks}")
    if not (all(1 <= k <= C for k in top_ks)):
        fail(OP, "top_ks", f"must lie in [1, num_classes={C}], got {top_ks}")
    check(scores or top_ks == [1], OP, "top_ks", "must be (1,) when preds are class indices (top-k needs scores)")
    check(scores or not nll, OP, "nll", "needs scores/logits preds, got class indices")
    mask = check_mask(OP, mask, target.shape, dev)
    check_state(OP, "stats", stats, (len(top_ks), 3, C), dev)
    check_state(OP, "extras", extras, (2,), dev)
    check_state(OP, "bad", bad, (2,), dev)
    if confmat is not None:
        check_state(OP, "confmat", confmat, (C, C), dev)

    n = target.numel()
    target = target.reshape(-1)
    preds = preds.reshape(n, C) if scores else preds.reshape(-1)
    mask = None if mask is None else mask.reshape(-1)
    run(OP, dev, backend, preds, target, mask, C, ignore_index, top_ks, nll, stats, confmat, extras, bad)
