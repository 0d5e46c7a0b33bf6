"""Scores read off the binned ROC / precision-recall curves (``curves.py``),
torchmetrics 1.9's binned mode: ``LogAUC``, ``PrecisionAtFixedRecall``,
``RecallAtFixedPrecision``, ``SensitivityAtSpecificity``,
``SpecificityAtSensitivity``.

The state is the score histogram of AUROC / ROC (``HistogramStatistic``,
``[2, L, B]``, one SUM all_reduce; shared with every AUROC / AveragePrecision
/ ROC / PrecisionRecallCurve / curve-score member of a group on the same
inputs and bins). ``thresholds`` as ``curves.py``: an int ``T`` is
``linspace(0, 1, T)``, a list / tensor on a grid ``k / B`` exactly those
thresholds, ``None`` every bin edge ``k / num_bins`` (torchmetrics' exact
curve, whose length grows with the data, is not kept; its threshold is a
score, here the bin edge below it). Each score is a formula of the curve's
counts at the thresholds, with torchmetrics' rules for ties and for "no
threshold qualifies" (per class):

* ``RecallAtFixedPrecision``: the highest recall among the thresholds with
  ``precision >= min_precision`` (ties: the higher precision, then the
  higher threshold); none, or a recall of 0: ``(0.0, NaN)``.
* ``PrecisionAtFixedRecall``: the highest precision among the thresholds
  with ``recall >= min_recall`` (ties: the higher recall, then the higher
  threshold; an undefined precision, no score at or above the threshold,
  never wins); none, or a precision of 0: ``(0.0, NaN)``.
* ``SensitivityAtSpecificity`` / ``SpecificityAtSensitivity``: on the ROC
  (``specificity = 1 - fpr``; a rate with no positives / negatives is 0.0
  as there), the highest sensitivity among the thresholds with
  ``specificity >= min_specificity`` (resp. the reverse; ties: the higher
  threshold); none: ``(0.0, 1e6)`` (torchmetrics' sentinel threshold).
* ``LogAUC``: the area under ``tpr`` over ``log10(fpr)`` between the two
  ends of ``fpr_range``, the curve interpolated there, divided by the width
  ``log10(hi / lo)`` (torchmetrics' ``_binary_logauc_compute``, its
  interpolation ``utilities.data.interp`` included).

Rates are float64 (torchmetrics: float32); a threshold is ``k / num_bins``.
``min_*`` compares with the float64 rate, so a rate on the boundary whose
float32 value rounds the other way can pick a different threshold.
"""

from __future__ import annotations

import torch

from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.curves import _Curve
from d9d_kernels.metrics.formulas.classification import safe_div
from d9d_kernels.metrics.ranking import DEFAULT_BINS

__all__ = ["LogAUC", "PrecisionAtFixedRecall", "RecallAtFixedPrecision", "SensitivityAtSpecificity",
           "SpecificityAtSensitivity"]

#: torchmetrics' threshold where no threshold reaches the minimum specificity / sensitivity
NO_THRESHOLD = 1e6
#: the ``average`` values LogAUC takes (torchmetrics' ``_reduce_logauc``: "weighted" has no weights there)
LOGAUC_AVERAGES = ("macro", "none")


def _check_min(name: str, arg: str, value) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= float(value) <= 1.0
    A.check(ok, name, arg, f"must be a float in [0, 1], got {value!r}")
    return float(value)


def _lex_last(cand: torch.Tensor, *keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the index of the candidate with the largest ``keys[0]``, ties
    broken by ``keys[1]``, ..., then by the last index (the highest
    threshold); and whether the row has a candidate. ``keys`` must be finite
    on the candidates."""
    sel = cand
    for k in keys:
        best = torch.where(sel, k, torch.full_like(k, -float("inf"))).amax(-1, keepdim=True)
        sel = sel & (k == best)
    positions = torch.arange(cand.shape[-1], device=cand.device).expand_as(cand)
    idx = torch.where(sel, positions, torch.full_like(positions, -1)).amax(-1)
    return idx.clamp(min=0), cand.any(-1)


def _at(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return x.gather(-1, idx.unsqueeze(-1)).squeeze(-1)


class _CurveScore(_Curve):
    """A ``(value, threshold)`` per class / label from the curve's counts."""

    def _pick(self, s) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _rates(self, s):
        """``tps, fps, P, N`` ``[L, T]`` at ascending thresholds, and the thresholds ``[L, T]``."""
        tps, fps, P, N, edges = self._counts(s)
        return tps, fps, P.expand_as(tps), N.expand_as(fps), self._thresholds(edges).expand_as(tps)

    def _compute(self, states):
        s = states["hist"]
        value, threshold = self._pick(s)
        if self.nan_strategy == "propagate":
            value = torch.where(s["bad"][1] > 0, torch.full_like(value, float("nan")), value)
        if self.task == "binary":
            value, threshold = value[0], threshold[0]
        return value, threshold


class RecallAtFixedPrecision(_CurveScore):
    """The highest recall with ``precision >= min_precision`` and its threshold
    (torchmetrics ``RecallAtFixedPrecision`` in its binned mode; module doc):
    binary ``(recall, threshold)`` scalars, multiclass (one-vs-rest) /
    multilabel ``[C]`` each.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.RecallAtFixedPrecision(task="binary", min_precision=0.5, thresholds=5)
        >>> m.update(torch.tensor([0.0, 0.5, 0.7, 0.8]), torch.tensor([0, 1, 1, 0]))
        >>> [v.item() for v in m.compute()]
        [1.0, 0.5]
    """

    def __init__(self, task: str, min_precision: float, thresholds: int | list[float] | torch.Tensor | None = None,
                 num_classes: int | None = None, num_labels: int | None = None, ignore_index: int | None = None,
                 num_bins: int = DEFAULT_BINS, nan_strategy: str = "error", class_dim: int | None = None):
        self.min_precision = _check_min(type(self).__name__, "min_precision", min_precision)
        super().__init__(task, thresholds, num_classes, num_labels, ignore_index, None, num_bins, nan_strategy,
                         class_dim)

    def _pick(self, s):
        tps, fps, P, _, t = self._rates(s)
        nan = float("nan")
        precision, recall = safe_div(tps, tps + fps, nan), safe_div(tps, P, nan)
        cand = (precision >= self.min_precision) & ~torch.isnan(recall)
        idx, found = _lex_last(cand, recall, precision)
        value = torch.where(found, _at(recall, idx), torch.zeros_like(idx, dtype=recall.dtype))
        return value, torch.where(value == 0, torch.full_like(value, nan), _at(t, idx))


class PrecisionAtFixedRecall(_CurveScore):
    """The highest precision with ``recall >= min_recall`` and its threshold
    (torchmetrics ``PrecisionAtFixedRecall`` in its binned mode; module doc).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.PrecisionAtFixedRecall(task="binary", min_recall=0.5, thresholds=5)
        >>> m.update(torch.tensor([0.0, 0.5, 0.7, 0.8]), torch.tensor([0, 1, 1, 0]))
        >>> [round(v.item(), 4) for v in m.compute()]
        [0.6667, 0.5]
    """

    def __init__(self, task: str, min_recall: float, thresholds: int | list[float] | torch.Tensor | None = None,
                 num_classes: int | None = None, num_labels: int | None = None, ignore_index: int | None = None,
                 num_bins: int = DEFAULT_BINS, nan_strategy: str = "error", class_dim: int | None = None):
        self.min_recall = _check_min(type(self).__name__, "min_recall", min_recall)
        super().__init__(task, thresholds, num_classes, num_labels, ignore_index, None, num_bins, nan_strategy,
                         class_dim)

    def _pick(self, s):
        tps, fps, P, _, t = self._rates(s)
        nan = float("nan")
        precision, recall = safe_div(tps, tps + fps, nan), safe_div(tps, P, nan)
        cand = recall >= self.min_recall
        positions = torch.arange(cand.shape[-1], device=cand.device).expand_as(cand)
        first = torch.where(cand, positions, torch.full_like(positions, cand.shape[-1])).amin(-1).clamp(
            max=cand.shape[-1] - 1)
        # torchmetrics' max() over (precision, recall, threshold) tuples starts at the first candidate; an
        # undefined (NaN) precision compares false both ways: it never wins, and where it comes first it stays
        first_nan = cand.any(-1) & torch.isnan(_at(precision, first))
        idx, found = _lex_last(cand & ~torch.isnan(precision), precision, recall)
        zero = torch.zeros_like(precision[..., 0])
        value = torch.where(first_nan, torch.full_like(zero, nan), torch.where(found, _at(precision, idx), zero))
        threshold = torch.where(first_nan, _at(t, first),
                                torch.where(value == 0, torch.full_like(zero, nan), _at(t, idx)))
        return value, threshold


class _RocScore(_CurveScore):
    _minimum = ""

    def _roc(self, s):
        tps, fps, P, N, t = self._rates(s)
        return safe_div(tps, P), 1.0 - safe_div(fps, N), t

    def _best(self, value, constraint, t):
        idx, found = _lex_last(constraint >= getattr(self, self._minimum), value)
        zero = torch.zeros_like(value[..., 0])
        return (torch.where(found, _at(value, idx), zero),
                torch.where(found, _at(t, idx), torch.full_like(zero, NO_THRESHOLD)))


class SensitivityAtSpecificity(_RocScore):
    """The highest sensitivity (tpr) with ``specificity >= min_specificity``
    and its threshold (torchmetrics ``SensitivityAtSpecificity`` in its
    binned mode; module doc). No threshold qualifies: ``(0.0, 1e6)``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.SensitivityAtSpecificity(task="binary", min_specificity=0.5, thresholds=5)
        >>> m.update(torch.tensor([0.0, 0.5, 0.4, 0.1]), torch.tensor([0, 1, 1, 1]))
        >>> [round(v.item(), 4) for v in m.compute()]
        [0.6667, 0.25]
    """

    _minimum = "min_specificity"

    def __init__(self, task: str, min_specificity: float,
                 thresholds: int | list[float] | torch.Tensor | None = None, num_classes: int | None = None,
                 num_labels: int | None = None, ignore_index: int | None = None, num_bins: int = DEFAULT_BINS,
                 nan_strategy: str = "error", class_dim: int | None = None):
        self.min_specificity = _check_min(type(self).__name__, "min_specificity", min_specificity)
        super().__init__(task, thresholds, num_classes, num_labels, ignore_index, None, num_bins, nan_strategy,
                         class_dim)

    def _pick(self, s):
        sensitivity, specificity, t = self._roc(s)
        return self._best(sensitivity, specificity, t)


class SpecificityAtSensitivity(_RocScore):
    """The highest specificity (``1 - fpr``) with ``sensitivity >=
    min_sensitivity`` and its threshold (torchmetrics
    ``SpecificityAtSensitivity`` in its binned mode; module doc). No
    threshold qualifies: ``(0.0, 1e6)``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.SpecificityAtSensitivity(task="binary", min_sensitivity=0.5, thresholds=5)
        >>> m.update(torch.tensor([0.0, 0.5, 0.4, 0.1]), torch.tensor([0, 1, 1, 1]))
        >>> [v.item() for v in m.compute()]
        [1.0, 0.25]
    """

    _minimum = "min_sensitivity"

    def __init__(self, task: str, min_sensitivity: float,
                 thresholds: int | list[float] | torch.Tensor | None = None, num_classes: int | None = None,
                 num_labels: int | None = None, ignore_index: int | None = None, num_bins: int = DEFAULT_BINS,
                 nan_strategy: str = "error", class_dim: int | None = None):
        self.min_sensitivity = _check_min(type(self).__name__, "min_sensitivity", min_sensitivity)
        super().__init__(task, thresholds, num_classes, num_labels, ignore_index, None, num_bins, nan_strategy,
                         class_dim)

    def _pick(self, s):
        sensitivity, specificity, t = self._roc(s)
        return self._best(specificity, sensitivity, t)


# -- LogAUC ----------------------------------------------------------------------------------


def _interp_sorted(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """torchmetrics' ``utilities.data.interp`` (LogAUC's), batched over the
    leading dim: ``xp`` sorted (stably), each ``x`` on the segment below it
    (``searchsorted - 1``, clamped to the first / last), its slope a plain
    division (infinite or NaN on a segment of zero width, as there)."""
    order = torch.sort(xp, dim=-1, stable=True).indices
    xp, fp = xp.gather(-1, order), fp.gather(-1, order)
    slopes = (fp[..., 1:] - fp[..., :-1]) / (xp[..., 1:] - xp[..., :-1])
    idx = (torch.searchsorted(xp.contiguous(), x.contiguous()) - 1).clamp(0, slopes.shape[-1] - 1)
    return fp.gather(-1, idx) + slopes.gather(-1, idx) * (x - xp.gather(-1, idx))


def log_auc(fpr: torch.Tensor, tpr: torch.Tensor, fpr_range: tuple[float, float]) -> torch.Tensor:
    """``[L]`` LogAUC of ROC curves ``[L, T]`` in increasing fpr
    (torchmetrics' ``_binary_logauc_compute``): the range's ends inserted
    into the curve (``tpr`` interpolated there), both axes sorted, the
    trapezoid over ``log10(fpr)`` from the last point at the lower end to the
    last at the upper end, divided by ``log10(hi) - log10(lo)``. 0.0 for a
    curve of fewer than two points."""
    L, T = fpr.shape
    if T < 2:
        return torch.zeros(L, dtype=fpr.dtype, device=fpr.device)
    rng = torch.tensor(fpr_range, dtype=fpr.dtype, device=fpr.device).expand(L, 2).contiguous()
    y = torch.sort(torch.cat([tpr, _interp_sorted(rng, fpr, tpr)], -1), -1).values
    x = torch.log10(torch.sort(torch.cat([fpr, rng], -1), -1).values)
    bounds = torch.log10(rng[:1])  # [1, 2]
    positions = torch.arange(T + 2, device=fpr.device).expand(L, -1)
    none = torch.full_like(positions, -1)
    lo = torch.where(x == bounds[:, :1], positions, none).amax(-1, keepdim=True)
    hi = torch.where(x == bounds[:, 1:], positions, none).amax(-1, keepdim=True)
    inside = (positions[:, :-1] >= lo) & (positions[:, 1:] <= hi)
    seg = (x[:, 1:] - x[:, :-1]) * (y[:, 1:] + y[:, :-1]) / 2
    area = torch.where(inside, seg, torch.zeros_like(seg)).sum(-1)
    return area / (bounds[0, 1] - bounds[0, 0])


class LogAUC(_Curve):
    """Area under the ROC curve over ``log10(fpr)`` in ``fpr_range``, scaled
    to [0, 1] (torchmetrics ``LogAUC`` in its binned mode; module doc).
    Binary: a scalar; multiclass (one-vs-rest) / multilabel: ``[C]`` with
    ``average=None`` (torchmetrics' default there), their mean over the
    classes whose score is not NaN with ``average="macro"``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.LogAUC(task="binary", thresholds=11)
        >>> m.update(torch.tensor([0.75, 0.05, 0.05, 0.05, 0.05]), torch.tensor([1, 0, 0, 0, 0]))
        >>> m.compute().item()
        1.0
    """

    def __init__(self, task: str, thresholds: int | list[float] | torch.Tensor | None = None,
                 fpr_range: tuple[float, float] = (0.001, 0.1), num_classes: int | None = None,
                 num_labels: int | None = None, ignore_index: int | None = None, average: str | None = None,
                 num_bins: int = DEFAULT_BINS, nan_strategy: str = "error", class_dim: int | None = None):
        name = type(self).__name__
        ok = (isinstance(fpr_range, (tuple, list)) and len(fpr_range) == 2
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in fpr_range))
        A.check(ok and 0 <= fpr_range[0] < fpr_range[1] <= 1, name, "fpr_range",
                f"must be a tuple of two floats (lo, hi) with 0 <= lo < hi <= 1, got {fpr_range!r}")
        log_average = "none" if average is None else average
        A.check(log_average in LOGAUC_AVERAGES, name, "average",
                f"must be one of {LOGAUC_AVERAGES} or None (torchmetrics has no weights for 'weighted' here), got "
                f"{average!r}")
        super().__init__(task, thresholds, num_classes, num_labels, ignore_index, None, num_bins, nan_strategy,
                         class_dim)
        self.fpr_range = (float(fpr_range[0]), float(fpr_range[1]))
        self.average = log_average

    def _compute(self, states):
        s = states["hist"]
        tps, fps, P, N, _ = self._counts(s)
        fpr = torch.flip(safe_div(fps, N.expand_as(fps)), (-1,))
        tpr = torch.flip(safe_div(tps, P.expand_as(tps)), (-1,))
        scores = log_auc(fpr, tpr, self.fpr_range)
        if self.nan_strategy == "propagate":
            scores = torch.where(s["bad"][1] > 0, torch.full_like(scores, float("nan")), scores)
        if self.task == "binary":
            return scores[0]
        if self.average == "macro":
            return torch.nanmean(scores)
        return scores
