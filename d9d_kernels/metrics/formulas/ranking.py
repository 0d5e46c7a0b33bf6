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

``edges`` (torchmetrics' ``thresholds``): int64 ``[T]`` bin indices of
increasing thresholds ``t_i = edges_i / B``; the curve then has exactly
torchmetrics' binned points, ``(fpr, tpr)`` / ``(recall, precision)`` of
``score >= t_i`` for each i, and no others (no implicit ``(0, 0)``). An edge
``B`` (``t = 1``) counts no score (one of exactly 1.0 lies in the last bin).

``max_fpr`` (AUROC): the McClish-corrected partial area up to ``fpr =
max_fpr``, the last segment interpolated linearly (scikit-learn's
``roc_auc_score(max_fpr=...)``, torchmetrics' ``BinaryAUROC(max_fpr=...)``).
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


def at_edges(x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """``[..., T]``: per label, the count of bins ``>= edges_i`` (``edges_i = B``: 0)."""
    inclusive = torch.flip(torch.cumsum(torch.flip(x, (-1,)), -1), (-1,))
    inclusive = torch.cat([inclusive, torch.zeros_like(inclusive[..., :1])], -1)
    return inclusive.index_select(-1, edges)


def _roc_points(pos: torch.Tensor, neg: torch.Tensor, edges: torch.Tensor | None):
    """``fpr, tpr`` ``[L, T']`` in increasing fpr (decreasing threshold): the
    thresholds of ``edges``, or (None) of every bin edge and the ``(0, 0)``
    point above the highest bin."""
    if edges is None:
        edges = torch.arange(pos.shape[-1] + 1, device=pos.device)
    P, N = pos.sum(-1, keepdim=True), neg.sum(-1, keepdim=True)
    tpr = safe_div(at_edges(pos, edges), P.expand(*P.shape[:-1], edges.numel()))
    fpr = safe_div(at_edges(neg, edges), N.expand(*N.shape[:-1], edges.numel()))
    return torch.flip(fpr, (-1,)), torch.flip(tpr, (-1,))


def _trapezoid(x: torch.Tensor, y: torch.Tensor, max_x: float | None = None) -> torch.Tensor:
    """Area under ``y(x)`` (``x`` non-decreasing along the last dim), up to ``max_x``
    with the crossing segment cut at ``max_x`` by linear interpolation."""
    x0, x1, y0, y1 = x[..., :-1], x[..., 1:], y[..., :-1], y[..., 1:]
    full = (x1 - x0) * (y0 + y1) / 2
    if max_x is None:
        return full.sum(-1)
    y_cut = y0 + (y1 - y0) * safe_div(max_x - x0, x1 - x0)
    part = (max_x - x0) * (y0 + y_cut) / 2
    zero = torch.zeros_like(full)
    return torch.where(x1 <= max_x, full, torch.where(x0 >= max_x, zero, part)).sum(-1)


def auroc_points(pos: torch.Tensor, neg: torch.Tensor, edges: torch.Tensor | None = None,
                 max_fpr: float | None = None) -> torch.Tensor:
    """``[L]`` AUROC over the thresholds of ``edges`` (see the module doc),
    McClish-corrected up to ``max_fpr``; NaN where a label has no positives
    or no negatives. A curve whose fpr or tpr are all 0 gets the plain area
    (torchmetrics' rule)."""
    fpr, tpr = _roc_points(pos, neg, edges)
    area = _trapezoid(fpr, tpr)
    if max_fpr is not None and max_fpr < 1:
        m = float(max_fpr)
        lo = 0.5 * m * m
        mcclish = 0.5 * (1 + (_trapezoid(fpr, tpr, m) - lo) / (m - lo))
        flat = (fpr.sum(-1) == 0) | (tpr.sum(-1) == 0)
        area = torch.where(flat, area, mcclish)
    defined = (pos.sum(-1) * neg.sum(-1)) > 0
    return torch.where(defined, area, torch.full_like(area, float("nan")))


def average_precision_points(pos: torch.Tensor, neg: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """``[L]`` step-wise AP over the thresholds of ``edges`` (torchmetrics'
    binned ``Σ_i (R_i - R_{i+1}) P_i``, ``R_T = 0``); 0.0 without positives."""
    tps, fps = at_edges(pos, edges), at_edges(neg, edges)
    prec = safe_div(tps, tps + fps)
    gained = tps - torch.cat([tps[..., 1:], torch.zeros_like(tps[..., :1])], -1)
    return safe_div((gained * prec).sum(-1), pos.sum(-1))


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


def auroc(hist: torch.Tensor, average: str = "macro", edges: torch.Tensor | None = None,
          max_fpr: float | None = None) -> torch.Tensor:
    """``hist``: ``[2, L, B]`` (positives, negatives). ``weighted``: by
    positives per label (scikit-learn's prevalence weights). ``micro``: one
    curve over all labels' histograms summed. ``edges`` / ``max_fpr``: see
    the module doc."""
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    pos, neg = hist[0].to(torch.float64), hist[1].to(torch.float64)
    if edges is None and (max_fpr is None or max_fpr >= 1):
        per = auroc_per_label
    else:
        per = lambda p, n: auroc_points(p, n, edges, max_fpr)  # noqa: E731
    if average == "micro":
        return _reduce(per(pos.sum(0), neg.sum(0))[None], torch.ones(1, dtype=torch.float64, device=pos.device), "macro")
    return _reduce(per(pos, neg), pos.sum(-1), average)


def average_precision(hist: torch.Tensor, average: str = "macro", edges: torch.Tensor | None = None) -> torch.Tensor:
    """As ``auroc`` for AP; every label counts in the macro mean."""
    if average not in AVERAGES:
        raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
    pos, neg = hist[0].to(torch.float64), hist[1].to(torch.float64)
    per = average_precision_per_label if edges is None else (
        lambda p, n: average_precision_points(p, n, edges))  # noqa: E731
    if average == "micro":
        return per(pos.sum(0), neg.sum(0))
    return _reduce(per(pos, neg), pos.sum(-1), average)
