"""score_histogram: binned positives / negatives per label for AUROC and AP.

The reference in ``d9d_kernels.reference`` is the specification.
"""

from __future__ import annotations

import torch

from d9d_kernels import reference
from d9d_kernels.ops._common import as_float, as_index, broadcast, fail, same_shape
from d9d_kernels.ops._dispatch import run

OP = "score_histogram"


def score_histogram(
    preds: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    hist: torch.Tensor,
    bad: torch.Tensor,
    multiclass: bool = False,
    ignore_index: int | None = None,
    input_kind: int = reference.INPUT_AUTO,
    backend: str | None = None,
) -> None:
    """Adds binned score counts of one batch into ``hist``.

    Args:
        preds: ``[N]`` (binary), ``[N, L]`` (multilabel) or ``[N, C]``
            (multiclass) floating scores.
        target: shape of ``preds`` with 0/1 values, or ``[N]`` class indices
            when ``multiclass``.
        mask: bool broadcastable to ``target`` or ``None``.
        hist: float64 ``[2, L, B]``: positives, negatives per label and bin.
        bad: float64 ``[2]``: entries (rows when multiclass) left out, by
            cause: ``[0]`` a bad target, ``[1]`` a NaN/Inf pred.
        multiclass: one-vs-rest from class-index targets (softmax for logits).
        ignore_index: target value whose entries/rows are dropped, or ``None``.
        input_kind: ``reference.INPUT_PROBS | INPUT_LOGITS | INPUT_AUTO``.
        backend: force ``"cpp" | "cuda" | "triton" | "torch"``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> h, bad = torch.zeros(2, 1, 4, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        >>> dk.ops.score_histogram(torch.tensor([0.1, 0.9]), torch.tensor([0, 1]), hist=h, bad=bad)
        >>> h[:, 0].tolist()
        [[0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
    """
    preds = as_float(OP, "preds", preds)
    target = as_index(OP, "target", target)
    if multiclass:
        if not (preds.dim() >= 1 and preds.shape[:-1] == target.shape):
            fail(OP, "preds", f"must have shape target.shape + (C,), got preds {tuple(preds.shape)}, "
                 f"target {tuple(target.shape)}")
    else:
        same_shape(OP, "target", target, preds.shape, "preds")
    mask = broadcast(OP, "mask", mask, target.shape)
    n_lab = 1 if preds.dim() <= 1 else preds.shape[-1]
    lead = (-1,) if multiclass else (-1, n_lab)
    preds, target = preds.reshape(-1, n_lab), target.reshape(lead)
    mask = None if mask is None else mask.reshape(lead)
    run(OP, preds.device, backend, preds, target, mask, ignore_index, int(input_kind), bool(multiclass), hist, bad)
