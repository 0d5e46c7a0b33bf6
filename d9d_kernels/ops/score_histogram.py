"""score_histogram: binned positives / negatives per label for AUROC and AP.

The reference in ``d9d_kernels.reference`` is the specification.
"""

from __future__ import annotations

import torch

from d9d_kernels import reference
from d9d_kernels.ops._common import as_float, as_index, check, check_mask, check_state, fail
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
    check(isinstance(preds, torch.Tensor), OP, "preds", "must be a torch.Tensor", TypeError)
    dev = preds.device
    preds = as_float(OP, "preds", preds, dev)
    target = as_index(OP, "target", target, dev)
    if not (input_kind in (0, 1, 2)):
        fail(OP, "input_kind", f"must be 0 (probs), 1 (logits) or 2 (auto), got {input_kind!r}")
    if not (hist.dim() == 3 and hist.shape[0] == 2):
        fail(OP, "hist", f"must have shape [2, L, B], got {tuple(hist.shape)}")
    if multiclass:
        check(preds.dim() >= 1 and tuple(preds.shape[:-1]) == tuple(target.shape), OP, "preds",
              f"must have shape target.shape + (C,), got preds {tuple(preds.shape)}, target {tuple(target.shape)}")
        n_lab = preds.shape[-1]
    else:
        if not (preds.shape == target.shape):
            fail(OP, "target", f"must have the shape of preds {tuple(preds.shape)}, got {tuple(target.shape)}")
        n_lab = 1 if preds.dim() <= 1 else preds.shape[-1]
    mask = check_mask(OP, mask, target.shape, dev)
    check_state(OP, "hist", hist, (2, n_lab, hist.shape[2]), dev)
    check(hist.shape[2] >= 1, OP, "hist", "needs at least one bin")
    check_state(OP, "bad", bad, (2,), dev)
    preds = preds.reshape(-1, n_lab)
    target = target.reshape(-1) if multiclass else target.reshape(-1, n_lab)
    if mask is not None:
        mask = mask.reshape(-1) if multiclass else mask.reshape(-1, n_lab)
    run(OP, dev, backend, preds, target, mask, ignore_index, int(input_kind), bool(multiclass), hist, bad)
