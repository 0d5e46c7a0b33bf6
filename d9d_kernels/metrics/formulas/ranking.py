"""AUROC and average precision from binned score histograms.

``pos, neg``: float64 ``[L, B]``: per label, positives / negatives whose
probability fell in bin ``b`` (``b = clamp(floor(p * B), 0, B - 1)``). Each
bin is one threshold: sorted from the highest bin down, the curve steps
through the cumulative counts; scores inside one bin are tied.

* AUROC: trapezoid over the ROC points ``(fpr, tpr)`` of the bin thresholds,
  i.e. ``Σ_b neg_b (P_above_b + pos_b / 2) / (P N)`` (a positive and a
  negative in the same bin count one half, as ties in scikit-learn).
* AP: scikit-learn's step-wise ``Σ_n (R_n - R_{n-1}) P_n`` over the bin
  thresholds.

Degenerate labels: AUROC of a label without positives or without negatives
is undefined: NaN in ``average="none"``, left out of macro / weighted
averages (0.0 when no label is defined). AP of a label without positives is
0.0 (scikit-learn) and counts in the macro average.
"""

from __future__ import annotations

import torch

from d9d_kernels.metrics.formulas.classification import safe_div

AVERAGES = ("micro", "macro", "weighted", "none")


def _cum_above(x: torch.Tensor) -> torch.Tensor:
    """Per bin, the total of the bins strictly above it (higher score)."""
    rev = torch.flip(x, (-1,))
    inclusive = torch.flip(torch.cumsum(rev, -1), (-1,))
    return inclusive - x


def auroc_per_label(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """``[L]`` AUROC, NaN where a label has no positives or no negatives."""
    P = pos.sum(-1)
    N = neg.sum(-1)
    area = (neg * (_cum_above(pos) + 0.5 * pos)).sum(-1)
    den = P * N
    nan = torch.full_like(area, float("nan"))
    return torch.where(den > 0, area / torch.where(den > 0, den, torch.ones_like(den)), nan)


def average_precision_per_label(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """``[L]`` step-wise AP; 0.0 for a label without positives."""
    P = pos.sum(-1, keepdim=True)
    tps = _cum_above(pos) + pos
    fps = _cum_above(neg) + neg
    prec = safe_div(tps, tps + fps)
    return safe_div((pos * prec).sum(-1), P[..., 0])


def _reduce(per: torch.Tensor, weights: torch.Tensor, average: str) -> torch.Tensor:
    if average == "none":
        return per
    defined = ~torch.isnan(per)
    w = torch.ones_like(per) if average == "macro" else weights
    w = torch.where(defined, w, torch.zeros_like(w))
    vals = torch.where(defined, per, torch.zeros_like(per))
    return safe_div((w * vals).sum(-1), w.sum(-1))


def auroc(hist: torch.Tensor, average: str = "macro") -> torch.Tensor:
    """``hist``: ``[2, L, B]`` (positives, negatives). ``weighted``: by
    positives per label (scikit-learn's prevalence weights). ``micro``: one
    curve over all labels' histograms summed."""
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    pos, neg = hist[0].to(torch.float64), hist[1].to(torch.float64)
    if average == "micro":
        return _reduce(auroc_per_label(pos.sum(0), neg.sum(0))[None], torch.ones(1, dtype=torch.float64, device=pos.device), "macro")
    return _reduce(auroc_per_label(pos, neg), pos.sum(-1), average)


def average_precision(hist: torch.Tensor, average: str = "macro") -> torch.Tensor:
    """As ``auroc`` for AP; every label counts in the macro mean."""
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    pos, neg = hist[0].to(torch.float64), hist[1].to(torch.float64)
    if average == "micro":
        return average_precision_per_label(pos.sum(0), neg.sum(0))
    return _reduce(average_precision_per_label(pos, neg), pos.sum(-1), average)
