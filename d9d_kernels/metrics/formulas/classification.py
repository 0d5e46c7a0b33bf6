"""Classification formulas from per-class / per-label confusion counts.

Inputs are float64 tensors of counts ``tp, fp, tn, fn`` of shape ``[C]``
(one entry per class or label) and, for MCC / Cohen's kappa, a confusion
matrix. Averaging follows torchmetrics 1.9 (``_adjust_weights_safe_divide``):

* ``"micro"``: counts summed over classes first, then one ratio.
* ``"macro"``: unweighted mean of the per-class scores. Multiclass: classes
  absent from both target and preds (``tp + fp + fn == 0``) are left out, as
  torchmetrics and as scikit-learn without ``labels=`` do; with ``top_k > 1``
  classes absent from the target are left out (torchmetrics' rule).
  Multilabel: every label counts.
* ``"weighted"``: mean weighted by support ``tp + fn``.
* ``"none"``: the ``[C]`` per-class scores.

Zero division (a ratio with denominator 0, e.g. precision of a class never
predicted) gives ``zero_division``: ``0.0`` by default (scikit-learn
``zero_division=0``, torchmetrics' default); precision, recall, F-beta and
Jaccard take torchmetrics' ``zero_division`` (0, 1 or NaN, with torchmetrics'
arithmetic: a NaN class score makes micro / macro / weighted NaN, even a
class whose averaging weight is 0). An average over an empty set of classes
(nothing seen) is ``0.0``.
"""

from __future__ import annotations

import torch

AVERAGES = ("micro", "macro", "weighted", "none")


def safe_div(num: torch.Tensor, den: torch.Tensor, zero_division: float = 0.0) -> torch.Tensor:
    """``num / den`` with ``zero_division`` where ``den == 0`` (no NaN, no host sync)."""
    num = torch.as_tensor(num, dtype=torch.float64)
    den = torch.as_tensor(den, dtype=torch.float64, device=num.device)
    return torch.where(den != 0, num / den, zero_division)  # the quotient's 0/0 and x/0 are never selected


def _average(score, tp, fp, fn, average: str, multilabel: bool, top_k: int = 1) -> torch.Tensor:
    """Per-class ``score`` reduced by ``average`` (torchmetrics' ``_adjust_weights_safe_divide``)."""
    if average == "none":
        return score
    if average == "weighted":
        weights = tp + fn
    else:
        weights = torch.ones_like(score)
        if not multilabel:
            weights = (((tp + fp + fn) if top_k == 1 else (tp + fn)) != 0).to(score.dtype)
    return safe_div((weights * score).sum(-1), weights.sum(-1))


def _check_average(average: str) -> None:
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")


def accuracy(tp, fp, tn, fn, average: str = "micro", multilabel: bool = False, top_k: int = 1):
    """Multiclass: ``tp / (tp + fn)`` (micro: correct / rows); multilabel and
    binary: ``(tp + tn) / all`` per label."""
    _check_average(average)
    if multilabel:
        if average == "micro":
            return safe_div((tp + tn).sum(-1), (tp + tn + fp + fn).sum(-1))
        score = safe_div(tp + tn, tp + tn + fp + fn)
    else:
        if average == "micro":
            return safe_div(tp.sum(-1), (tp + fn).sum(-1))
        score = safe_div(tp, tp + fn)
    return _average(score, tp, fp, fn, average, multilabel, top_k)


def precision(tp, fp, tn, fn, average: str = "micro", multilabel: bool = False, top_k: int = 1,
              zero_division: float = 0.0):
    _check_average(average)
    if average == "micro":
        return safe_div(tp.sum(-1), (tp + fp).sum(-1), zero_division)
    return _average(safe_div(tp, tp + fp, zero_division), tp, fp, fn, average, multilabel, top_k)


def recall(tp, fp, tn, fn, average: str = "micro", multilabel: bool = False, top_k: int = 1,
           zero_division: float = 0.0):
    _check_average(average)
    if average == "micro":
        return safe_div(tp.sum(-1), (tp + fn).sum(-1), zero_division)
    return _average(safe_div(tp, tp + fn, zero_division), tp, fp, fn, average, multilabel, top_k)


def fbeta(tp, fp, tn, fn, beta: float = 1.0, average: str = "micro", multilabel: bool = False, top_k: int = 1,
          zero_division: float = 0.0):
    """``(1 + b²) tp / ((1 + b²) tp + b² fn + fp)``."""
    _check_average(average)
    b2 = float(beta) ** 2
    if average == "micro":
        tp, fp, fn = tp.sum(-1), fp.sum(-1), fn.sum(-1)
        return safe_div((1 + b2) * tp, (1 + b2) * tp + b2 * fn + fp, zero_division)
    score = safe_div((1 + b2) * tp, (1 + b2) * tp + b2 * fn + fp, zero_division)
    return _average(score, tp, fp, fn, average, multilabel, top_k)


def specificity(tp, fp, tn, fn, average: str = "micro", multilabel: bool = False, top_k: int = 1):
    """``tn / (tn + fp)``."""
    _check_average(average)
    if average == "micro":
        return safe_div(tn.sum(-1), (tn + fp).sum(-1))
    return _average(safe_div(tn, tn + fp), tp, fp, fn, average, multilabel, top_k)


def jaccard(tp, fp, tn, fn, average: str = "macro", multilabel: bool = False, top_k: int = 1,
            zero_division: float = 0.0):
    """Intersection over union ``tp / (tp + fp + fn)``."""
    _check_average(average)
    if average == "micro":
        return safe_div(tp.sum(-1), (tp + fp + fn).sum(-1), zero_division)
    return _average(safe_div(tp, tp + fp + fn, zero_division), tp, fp, fn, average, multilabel, top_k)


def binary_confmat(tp, fp, tn, fn) -> torch.Tensor:
    """``[..., 2, 2]`` confusion matrix ``[[tn, fp], [fn, tp]]`` (rows = target)."""
    return torch.stack([torch.stack([tn, fp], -1), torch.stack([fn, tp], -1)], -2)


def matthews_corrcoef(confmat: torch.Tensor) -> torch.Tensor:
    """MCC of a ``[C, C]`` confusion matrix (rows = target), as scikit-learn:
    ``0.0`` when the denominator is 0 (one class only in target or preds)."""
    cm = confmat.to(torch.float64)
    t = cm.sum(1)
    p = cm.sum(0)
    c = torch.diagonal(cm).sum()
    s = cm.sum()
    cov_tp = c * s - (t * p).sum()
    cov_pp = s * s - (p * p).sum()
    cov_tt = s * s - (t * t).sum()
    den = cov_pp * cov_tt
    return safe_div(cov_tp, torch.sqrt(den))


def cohen_kappa(confmat: torch.Tensor, weights: str | None = None) -> torch.Tensor:
    """Cohen's kappa of a ``[C, C]`` confusion matrix, as scikit-learn's
    ``cohen_kappa_score``; ``0.0`` where it is undefined (expected disagreement 0).

    ``weights=None`` uses only the diagonal and the marginals (O(C));
    ``"linear"`` / ``"quadratic"`` build the ``[C, C]`` disagreement weights.
    """
    cm = confmat.to(torch.float64)
    s = cm.sum()
    t = cm.sum(1)
    p = cm.sum(0)
    if weights is None or weights == "none":
        observed = s - torch.diagonal(cm).sum()  # Σ w·cm with w = 1 - I
        expected = s - safe_div((t * p).sum(), s)  # Σ w·outer(t, p) / s
    else:
        n = cm.shape[0]
        idx = torch.arange(n, dtype=torch.float64, device=cm.device)
        d = (idx[:, None] - idx[None, :]).abs()
        w = d if weights == "linear" else d * d
        observed = (w * cm).sum()
        expected = safe_div((w * torch.outer(t, p)).sum(), s)
    return torch.where(expected != 0, 1.0 - safe_div(observed, expected), torch.zeros_like(s))


def normalize_confmat(confmat: torch.Tensor, normalize: str | None) -> torch.Tensor:
    """``normalize``: None (counts), ``"true"`` (rows sum to 1), ``"pred"``
    (columns sum to 1), ``"all"`` (total 1); empty rows/cols stay 0."""
    cm = confmat.to(torch.float64)
    if normalize is None or normalize == "none":
        return cm
    if normalize == "true":
        return safe_div(cm, cm.sum(-1, keepdim=True).expand_as(cm))
    if normalize == "pred":
        return safe_div(cm, cm.sum(-2, keepdim=True).expand_as(cm))
    if normalize == "all":
        return safe_div(cm, cm.sum((-2, -1), keepdim=True).expand_as(cm))
    raise ValueError(f"normalize must be None, 'true', 'pred' or 'all', got {normalize!r}")
