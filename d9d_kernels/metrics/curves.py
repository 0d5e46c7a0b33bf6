"""Binned ROC and precision-recall curves from the score histogram AUROC
uses (``HistogramStatistic``: ``[2, L, B]`` positives / negatives per score
bin; linearly additive, one SUM all_reduce; shared with AUROC /
AveragePrecision members of a group on the same inputs and bins).

The curve's thresholds are torchmetrics' binned ones, read from the
histogram as ``ranking.py`` reads them: ``thresholds=T`` (int) is
``linspace(0, 1, T)`` on ``T - 1`` bins; a list / tensor on a grid ``k / B``
takes exactly those thresholds; ``thresholds=None`` every bin edge ``k /
num_bins``, ``k = 0 .. num_bins`` (torchmetrics' exact, unbinned curve has
a length that grows with the data: not kept here). At threshold ``k / B``
a score counts as positive iff its bin is ``>= k`` (``p >= k / B``; the
threshold 1.0 counts no score, where torchmetrics counts a score of exactly
1.0). Rates are those of torchmetrics' binned mode on the same thresholds.
"""

from __future__ import annotations

import torch

from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.formulas.classification import safe_div
from d9d_kernels.metrics.ranking import _Ranking

__all__ = ["ROC", "PrecisionRecallCurve"]


def _at_edges(x: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """``[..., T]``: per label, the total of the bins ``>= edges_i`` (``edges_i = B``: 0)."""
    inclusive = torch.flip(torch.cumsum(torch.flip(x, (-1,)), -1), (-1,))
    inclusive = torch.cat([inclusive, torch.zeros_like(inclusive[..., :1])], -1)
    return inclusive.index_select(-1, edges)


#: elements of one chunk of the macro curves' interpolation (classes x points)
_MACRO_CHUNK = 1 << 22


def interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """torchmetrics' ``utilities.compute.interp`` (its macro curves' one),
    batched over the leading dim: for each ``x`` the segment ``i`` = (the
    number of ``xp <= x``) - 1, clamped to the first / last segment, its
    slope 0 where the segment has zero width. ``xp`` need not be sorted (the
    precision of a PR curve is not monotone, and may be NaN): ``i`` indexes
    the segments in the given order, as there."""
    m = safe_div(fp[..., 1:] - fp[..., :-1], xp[..., 1:] - xp[..., :-1])
    b = fp[..., :-1] - m * xp[..., :-1]
    ranked = torch.sort(torch.nan_to_num(xp, nan=float("inf"))).values  # NaN is never <= x
    count = torch.searchsorted(ranked, x, right=True)
    count = torch.where(torch.isnan(x), torch.zeros_like(count), count)
    idx = (count - 1).clamp(0, m.shape[-1] - 1)
    return m.gather(-1, idx) * x + b.gather(-1, idx)


def _macro(x: torch.Tensor, y: torch.Tensor, thresholds: torch.Tensor, descending: bool):
    """torchmetrics' multiclass ``average="macro"`` curve: every class's ``x``
    values sorted into one axis, the classes' ``y`` interpolated there
    (``interp``) and averaged, the thresholds repeated once per class."""
    C = x.shape[0]
    mean_x = torch.sort(x.reshape(-1)).values
    step = max(1, _MACRO_CHUNK // mean_x.numel())
    mean_y = torch.zeros_like(mean_x)
    for c in range(0, C, step):  # chunks of classes: [classes, C * T] at a time
        n = min(step, C - c)
        mean_y = mean_y + interp(mean_x.expand(n, -1).contiguous(), x[c:c + n], y[c:c + n]).sum(0)
    return mean_x, mean_y / C, torch.sort(thresholds.repeat(C), descending=descending).values


class _Curve(_Ranking):
    #: the ``average`` values taken (besides None): torchmetrics' multiclass curves take "micro" / "macro"
    _curve_averages = ("micro", "macro")

    def __init__(self, task: str, thresholds: int | None = None, num_classes: int | None = None,
                 num_labels: int | None = None, ignore_index: int | None = None, average: str | None = None,
                 num_bins: int = 10_000, nan_strategy: str = "error", class_dim: int | None = None):
        name = type(self).__name__
        curve_average = "none" if average is None else average
        A.check(curve_average == "none" or (task == "multiclass" and curve_average in self._curve_averages), name,
                "average", f"must be None (one curve per class / label), or for task='multiclass' one of "
                f"{self._curve_averages} (torchmetrics takes them there only), got {average!r} for task={task!r}")
        super().__init__(task, num_classes, num_labels, None, num_bins, ignore_index, nan_strategy, thresholds,
                         class_dim)
        self.average = curve_average

    def _edges_on(self, device) -> torch.Tensor:
        """The thresholds as bin indices ``k`` (``t = k / num_bins``), increasing."""
        edges = self._edge_index(device)
        return torch.arange(self.num_bins + 1, device=device) if edges is None else edges

    def _counts(self, s):
        """``tps, fps, P, N`` per label and threshold ``[L, T]`` (binary, average="micro": L = 1), and the edges."""
        hist = s["hist"]
        if self.average == "micro":  # torchmetrics' one-hot flattening: every (row, class) pair is one binary score
            hist = hist.sum(1, keepdim=True)
        pos, neg = hist[0], hist[1]
        edges = self._edges_on(pos.device)
        return (_at_edges(pos, edges), _at_edges(neg, edges), pos.sum(-1, keepdim=True), neg.sum(-1, keepdim=True),
                edges)

    def _thresholds(self, edges: torch.Tensor) -> torch.Tensor:
        """The thresholds ``k / num_bins`` (float64, ascending)."""
        return edges.to(torch.float64) / self.num_bins

    def _compute(self, states):
        s = states["hist"]
        out = self._curve(s)
        if self.nan_strategy == "propagate":
            nan = s["bad"][1] > 0
            out = tuple(torch.where(nan, torch.full_like(v, float("nan")), v) if i < 2 else v
                        for i, v in enumerate(out))
        if self.task == "binary" or self.average == "micro":
            out = tuple(v[0] if v.dim() > 1 else v for v in out)
        return out


class ROC(_Curve):
    """Binned receiver operating characteristic: ``(fpr, tpr, thresholds)``,
    thresholds descending (torchmetrics ``ROC`` in its binned mode; module
    doc). Binary: ``[T]`` each; multiclass (one-vs-rest) / multilabel:
    ``fpr``, ``tpr`` ``[C, T]``, ``thresholds`` ``[T]``. A rate with a zero
    denominator is 0.0 (torchmetrics). Multiclass ``average="micro"``: one
    ``[T]`` curve of the classes' histograms summed; ``"macro"``:
    torchmetrics' interpolated mean curve, ``[C * T]`` each (``_macro``).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.ROC(task="binary", thresholds=5)
        >>> m.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        >>> fpr, tpr, thr = m.compute()
        >>> fpr.tolist(), tpr.tolist(), thr.tolist()
        ([0.0, 0.0, 0.0, 0.5, 1.0], [0.0, 0.5, 0.5, 1.0, 1.0], [1.0, 0.75, 0.5, 0.25, 0.0])
    """

    def _curve(self, s):
        tps, fps, P, N, edges = self._counts(s)
        tpr = torch.flip(safe_div(tps, P.expand_as(tps)), (-1,))
        fpr = torch.flip(safe_div(fps, N.expand_as(fps)), (-1,))
        thresholds = torch.flip(self._thresholds(edges), (0,))
        if self.average == "macro":
            return _macro(fpr, tpr, thresholds, descending=True)
        return fpr, tpr, thresholds


class PrecisionRecallCurve(_Curve):
    """Binned precision-recall curve: ``(precision, recall, thresholds)``,
    thresholds ascending, precision and recall with a last point ``(1, 0)``
    appended (torchmetrics ``PrecisionRecallCurve`` in its binned mode:
    ``[T + 1]``, ``[T + 1]``, ``[T]``; ``[C, T + 1]`` per class / label). A ratio with a zero
    denominator is NaN there and here (no score at or above a threshold:
    precision; no positives: recall).
    Multiclass ``average="micro"`` / ``"macro"`` as ``ROC`` (macro:
    ``[C * (T + 1)]``, ``[C * (T + 1)]``, ``[C * T]``).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.PrecisionRecallCurve(task="binary", thresholds=[0.0, 0.25, 0.5, 0.75])
        >>> m.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        >>> p, r, thr = m.compute()
        >>> [round(v, 4) for v in p.tolist()], r.tolist(), thr.tolist()
        ([0.5, 0.6667, 1.0, 1.0, 1.0], [1.0, 1.0, 0.5, 0.5, 0.0], [0.0, 0.25, 0.5, 0.75])
    """

    def _curve(self, s):
        tps, fps, P, _, edges = self._counts(s)
        nan = float("nan")
        precision = safe_div(tps, tps + fps, nan)
        recall = safe_div(tps, P.expand_as(tps), nan)
        ones = torch.ones_like(precision[..., :1])
        precision, recall = torch.cat([precision, ones], -1), torch.cat([recall, torch.zeros_like(ones)], -1)
        if self.average == "macro":
            return _macro(precision, recall, self._thresholds(edges), descending=False)
        return precision, recall, self._thresholds(edges)
