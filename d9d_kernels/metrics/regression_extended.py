"""More regression metrics of torchmetrics 1.9, on the same statistics as
``regression.py`` (fixed-size, linearly additive state: one all_reduce).

* On the shared regression moments (``Σw, Σw·x, Σw·x², Σw·y, Σw·y², Σw·xy,
  Σw(x-y)²`` about pivots; ``x = preds``, ``y = target``): ``RelativeSquaredError``,
  ``ConcordanceCorrCoef``, ``NormalizedRootMeanSquaredError`` (plus the
  target's per-column extrema for ``normalization="range"``). In a group they
  share ONE ``weighted_moments`` call with MSE / MAE / R² / Pearson on the
  same ``(preds, target, weights, mask)``.
* On moments of transformed inputs (their own statistic, never merged with
  the plain ones): ``MeanSquaredLogError`` (``x = log1p(preds)``,
  ``y = log1p(target)``), ``WeightedMeanAbsolutePercentageError``
  (``x = |preds - target|``, ``y = |target|``), ``CriticalSuccessIndex``
  (``x`` = hit, ``y`` = hit or miss or false alarm, 0/1 per element).
* Weighted means (or sums) of a per-element value (``PairValueMean``, as
  MAPE / SMAPE): ``LogCoshError``, ``MinkowskiDistance``, ``TweedieDevianceScore``.

``update(preds, target, weights=None, mask=None)`` as the regression
family: equal shapes; ``weights`` (scikit-learn's ``sample_weight``;
torchmetrics has none) and ``mask`` broadcastable to ``preds``.
``CriticalSuccessIndex.update(preds, target, mask=None)`` (counts: no weights).

No data (nothing updated, everything masked): the moments-based metrics
give 0.0, as the rest of the regression catalogue (torchmetrics: NaN, but
0.0 for WMAPE and CSI); the per-element means follow ``ValueMean``'s rule,
torchmetrics' values: NaN for a mean (LogCoshError, TweedieDevianceScore),
0.0 for MinkowskiDistance (a sum). Other degenerate cases are named per class.
"""

from __future__ import annotations

import numbers

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.core.statistic import MAX, Slot, Statistic, param, statistic
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.formulas import regression as G
from d9d_kernels.metrics.formulas.classification import safe_div
from d9d_kernels.metrics.moments import MomentsStatistic, OutputMomentsStatistic, Shareable
from d9d_kernels.metrics.value_mean import PairValueMean, common_float

__all__ = [
    "MeanSquaredLogError",
    "NormalizedRootMeanSquaredError",
    "WeightedMeanAbsolutePercentageError",
    "LogCoshError",
    "MinkowskiDistance",
    "RelativeSquaredError",
    "ConcordanceCorrCoef",
    "TweedieDevianceScore",
    "CriticalSuccessIndex",
    "ColumnExtremaStatistic",
]


#: torchmetrics' WMAPE epsilon
EPSILON = 1.17e-06
#: torchmetrics' RSE clamp: ``finfo(float32).eps`` (its states are float32 by default)
RSE_EPSILON = float(torch.finfo(torch.float32).eps)


def _float(t: torch.Tensor) -> torch.Tensor:
    """``t`` in its floating dtype; integers and bools as float64."""
    return t if t.is_floating_point() else t.to(torch.float64)


@statistic
class ColumnExtremaStatistic(Shareable):
    """Per-column ``(max, -min)`` of ``x`` ``[N, outputs]`` (or any shape
    when ``outputs == 1``): ``extrema`` MAX ``[outputs, 2]`` (init -inf).
    ``mask`` (bool, broadcastable) drops elements; torch ops, no host sync.
    Counts nothing itself (the moments statistic beside it counts bad input);
    a non-finite value enters the extrema unless masked. ``shared``: see
    ``moments.Shareable``."""

    inputs = ("x", "mask")

    outputs: int = param(1, convert=int)

    def slots(self) -> list[Slot]:
        return [Slot("extrema", MAX, (self.outputs, 2), float("-inf"))]

    def update(self, state, x, mask=None) -> None:
        M = self.outputs
        x = _float(x).to(torch.float64)
        if M == 1:
            x = x.reshape(-1, 1)
            mask = None if mask is None else mask.reshape(-1, 1)
        hi, lo = x, -x
        if mask is not None:
            keep = torch.broadcast_to(mask, x.shape)
            ninf = torch.full_like(x, float("-inf"))
            hi, lo = torch.where(keep, hi, ninf), torch.where(keep, lo, ninf)
        if x.shape[0] == 0:
            return
        new = torch.stack([hi.amax(0), lo.amax(0)], dim=-1)
        state["extrema"].copy_(torch.maximum(state["extrema"], new))


class _Pairs(Metric):
    """``update(preds, target, weights=None, mask=None)``: metadata checks, then ``_add``."""

    _num_outputs_arg = False  # whether the class takes num_outputs (then [N, M] inputs score per column)

    def __init__(self, nan_strategy: str = "propagate", num_outputs: int = 1):
        super().__init__(nan_strategy=nan_strategy)
        A.check_int(type(self).__name__, "num_outputs", num_outputs)
        self.num_outputs = num_outputs

    def _skip_bad(self) -> bool:
        return self.nan_strategy == "ignore"

    def update(self, preds: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> None:
        """Adds a batch (device-local, no host sync)."""
        A.check_pairs(type(self).__name__, preds, target, weights, mask)
        ps = tuple(preds.shape)
        self._check_outputs(ps)
        if weights is not None and tuple(weights.shape) != ps:
            weights = torch.broadcast_to(weights, ps)
        if mask is not None and tuple(mask.shape) != ps:
            mask = torch.broadcast_to(mask, ps)
        self._add(preds, target, weights, mask)

    def _check_outputs(self, shape: tuple[int, ...]) -> None:
        if self._num_outputs_arg:
            check_outputs(type(self).__name__, self.num_outputs, shape)

    def _moments(self, shared: bool, paired: bool = True) -> Statistic:
        if self.num_outputs == 1:
            return MomentsStatistic(paired=paired, skip_bad=self._skip_bad(), shared=shared)
        return OutputMomentsStatistic(paired=paired, skip_bad=self._skip_bad(), shared=shared,
                                      outputs=self.num_outputs)

    def _squeeze(self, v: torch.Tensor) -> torch.Tensor:
        return v.reshape(()) if self.num_outputs == 1 and v.numel() == 1 else v


def check_outputs(name: str, M: int, shape: tuple[int, ...]) -> None:
    """Raises where inputs of ``shape`` do not fit ``num_outputs=M`` (named after ``name``)."""
    if M == 1:
        if len(shape) == 2 and shape[1] != 1:
            A.fail(name, "num_outputs", f"is 1 but preds and target of shape {shape} have {shape[1]} columns: "
                   f"pass num_outputs={shape[1]} for a value per column (torchmetrics), or flatten them to pool")
    else:
        A.check(len(shape) == 2 and shape[1] == M, name, "preds",
                f"must be [N, {M}] (num_outputs={M}), got shape {shape}")


# -- on the shared regression moments ------------------------------------------


class _SharedMoments(_Pairs):
    _num_outputs_arg = True

    def _statistics(self):
        return {"m": self._moments(shared=True)}

    def _add(self, preds, target, weights, mask):
        self._feed({"m": dict(x=preds, y=target, weights=weights, mask=mask)})


class RelativeSquaredError(_SharedMoments):
    """``Σw(y - x)² / Σw(y - ȳ)²`` (torchmetrics ``RelativeSquaredError``);
    ``squared=False``: its square root (RRSE). With ``num_outputs=M`` the
    value of each column of ``[N, M]`` inputs, averaged (torchmetrics).

    The denominator is clamped to ``finfo(float32).eps`` as torchmetrics
    clamps it (its default float32 state), so a constant target gives
    ``Σ(y - x)² / 1.19e-7``, not an infinite or undefined value.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.RelativeSquaredError()
        >>> m.update(torch.tensor([2.5, 0.0, 2, 8]), torch.tensor([3, -0.5, 2, 7]))
        >>> round(m.compute().item(), 4)
        0.0514
    """

    def __init__(self, num_outputs: int = 1, squared: bool = True, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy, num_outputs=num_outputs)
        A.check(isinstance(squared, bool), "RelativeSquaredError", "squared", f"must be a bool, got {squared!r}",
                TypeError)
        self.squared = squared

    def _compute(self, states):
        m = states["m"]
        w = m["weight"]
        rse = m["sse"] / torch.clamp(m["ss_y"], min=RSE_EPSILON)
        if not self.squared:
            rse = torch.sqrt(rse)
        rse = torch.where(w > 0, rse, torch.zeros_like(rse))
        return rse.mean() if rse.dim() else rse


class ConcordanceCorrCoef(_SharedMoments):
    """Lin's concordance correlation ``2 s_xy / (s_x² + s_y² + (x̄ - ȳ)²)``
    with torchmetrics' unbiased (``n - 1``) variances and covariance
    (torchmetrics ``ConcordanceCorrCoef``); ``num_outputs=M``: a ``[M]``
    vector, one value per column.

    ``weights`` are frequency weights: ``n = Σw`` (equal to repeating a row
    ``w`` times). Degenerate: fewer than two samples, or a zero denominator
    (both inputs constant and equal), give 0.0; torchmetrics gives NaN
    whenever a variance is (near) zero, here a constant input with a varying
    other input gives its exact value, 0.0.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.ConcordanceCorrCoef()
        >>> m.update(torch.tensor([2.5, 0.0, 2, 8]), torch.tensor([3, -0.5, 2, 7]))
        >>> round(m.compute().item(), 4)
        0.9777
    """

    def __init__(self, num_outputs: int = 1, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy, num_outputs=num_outputs)

    def _compute(self, states):
        m = states["m"]
        w = m["weight"]
        dof = torch.clamp(w - 1.0, min=0.0)
        vx, vy, cov = safe_div(m["ss_x"], dof), safe_div(m["ss_y"], dof), safe_div(m["sp_xy"], dof)
        mx, my = safe_div(m["sum_x"], w), safe_div(m["sum_y"], w)
        ccc = safe_div(2.0 * cov, vx + vy + (mx - my) ** 2)
        ccc = torch.where(w > 1.0, ccc, torch.zeros_like(ccc))
        return self._squeeze(ccc)


NORMALIZATIONS = ("mean", "range", "std", "l2")


class NormalizedRootMeanSquaredError(_SharedMoments):
    """RMSE divided by the target's mean, range (max - min), standard
    deviation (population, ``correction=0``) or L2 norm ``sqrt(Σ y²)``
    (torchmetrics ``NormalizedRootMeanSquaredError``); ``num_outputs=M``:
    one value per column of ``[N, M]`` inputs.

    With ``weights``: the RMSE, mean and std are weighted, the L2 norm is
    ``sqrt(Σ w y²)``; the range is over every kept element (``mask`` drops
    elements, weights do not). A zero denominator gives 0.0 where the RMSE is
    0 and ``inf`` otherwise (torchmetrics divides: NaN / inf).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.NormalizedRootMeanSquaredError(normalization="range")
        >>> m.update(torch.tensor([3.0, 5.0, 2.5, 7.0]), torch.tensor([2.5, 5.0, 4.0, 8.0]))
        >>> round(m.compute().item(), 4)
        0.1701
    """

    def __init__(self, normalization: str = "mean", num_outputs: int = 1, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy, num_outputs=num_outputs)
        A.check_choice("NormalizedRootMeanSquaredError", "normalization", normalization, NORMALIZATIONS)
        self.normalization = normalization

    def _statistics(self):
        out = super()._statistics()
        if self.normalization == "range":
            out["e"] = ColumnExtremaStatistic(self.num_outputs, shared=True)
        return out

    def _add(self, preds, target, weights, mask):
        feed = {"m": dict(x=preds, y=target, weights=weights, mask=mask)}
        if self.normalization == "range":
            keep = mask
            if self._skip_bad():  # the elements the moments leave out
                fin = torch.isfinite(preds) & torch.isfinite(target)
                if weights is not None:
                    fin = fin & torch.isfinite(weights)
                keep = fin if keep is None else keep & fin
            feed["e"] = dict(x=target, mask=keep)
        self._feed(feed)

    def _compute(self, states):
        m = states["m"]
        w = m["weight"]
        rmse = torch.sqrt(safe_div(m["sse"], w))
        if self.normalization == "mean":
            den = safe_div(m["sum_y"], w)
        elif self.normalization == "std":
            den = torch.sqrt(safe_div(m["ss_y"], w))
        elif self.normalization == "l2":
            den = torch.sqrt(torch.clamp(m["sum_sq_y"], min=0.0))
        else:
            e = states["e"]["extrema"]
            den = e[..., 0] + e[..., 1]
            den = torch.where(torch.isfinite(den) | torch.isnan(den), den, torch.zeros_like(den)).reshape(w.shape)
        v = torch.where(den != 0, rmse / torch.where(den != 0, den, torch.ones_like(den)),
                        torch.where(rmse == 0, torch.zeros_like(rmse), torch.full_like(rmse, float("inf"))))
        v = torch.where(w > 0, v, torch.zeros_like(v))
        return self._squeeze(v)


# -- on moments of transformed inputs ----------------------------------------------


class _OwnMoments(_Pairs):
    def _statistics(self):
        return {"m": self._moments(shared=False)}


class MeanSquaredLogError(_OwnMoments):
    """``Σw (log1p(x) - log1p(y))² / Σw`` (torchmetrics ``MeanSquaredLogError``,
    sklearn ``mean_squared_log_error``). Inputs below -1 give NaN (log1p), a
    non-finite element handled by ``nan_strategy`` (torchmetrics: NaN;
    sklearn raises).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.MeanSquaredLogError()
        >>> m.update(torch.tensor([3, 5, 2.5, 7]), torch.tensor([2.5, 5, 4, 8]))
        >>> round(m.compute().item(), 4)
        0.0397
    """

    def __init__(self, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)

    def _add(self, preds, target, weights, mask):
        p, t = common_float(preds, target)
        self._feed({"m": dict(x=torch.log1p(p), y=torch.log1p(t), weights=weights, mask=mask)})

    def _compute(self, states):
        return G.mean_squared_error(states["m"], True)


class WeightedMeanAbsolutePercentageError(_OwnMoments):
    """``Σw|y - x| / max(Σw|y|, 1.17e-6)`` (torchmetrics
    ``WeightedMeanAbsolutePercentageError``; 0.0 before any data, as there).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.WeightedMeanAbsolutePercentageError()
        >>> m.update(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([2.0, 2.0, 2.0]))
        >>> round(m.compute().item(), 4)
        0.5
    """

    def __init__(self, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)

    def _add(self, preds, target, weights, mask):
        p, t = common_float(preds, target)
        self._feed({"m": dict(x=(p - t).abs_(), y=t.abs(), weights=weights, mask=mask)})

    def _compute(self, states):
        m = states["m"]
        return m["sum_x"] / torch.clamp(m["sum_y"], min=EPSILON)


class CriticalSuccessIndex(_OwnMoments):
    """Critical success index (threat score) ``hits / (hits + misses +
    false alarms)`` with preds and target binarised at ``value >= threshold``
    (torchmetrics ``CriticalSuccessIndex``); 0.0 when nothing is at or above
    the threshold (torchmetrics' safe division). A NaN reads as below the
    threshold (as there). ``update(preds, target, mask=None)``.

    ``keep_sequence_dim`` (torchmetrics: one value per sequence index, the
    vectors of every update concatenated) needs a state that grows with the
    updates; it is refused with a ``ValueError`` (only ``None``).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.CriticalSuccessIndex(0.5)
        >>> m.update(torch.tensor([[0.2, 0.7], [0.9, 0.3]]), torch.tensor([[0.4, 0.2], [0.8, 0.6]]))
        >>> round(m.compute().item(), 4)
        0.3333
    """

    def __init__(self, threshold: float, keep_sequence_dim: int | None = None):
        super().__init__(nan_strategy="propagate")
        name = "CriticalSuccessIndex"
        A.check(isinstance(threshold, numbers.Real) and not isinstance(threshold, bool), name, "threshold",
                f"must be a real number, got {threshold!r}", TypeError)
        A.check(keep_sequence_dim is None, name, "keep_sequence_dim",
                f"must be None: a value per sequence index of every update is a state that grows with the "
                f"updates (torchmetrics concatenates them); got {keep_sequence_dim!r}. Feed one metric per "
                f"sequence index (mask=) for per-index values")
        self.threshold = float(threshold)
        self.keep_sequence_dim = keep_sequence_dim

    def update(self, preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Adds a batch (equal shapes; ``mask`` broadcastable: False drops an element)."""
        super().update(preds, target, None, mask)

    def _add(self, preds, target, weights, mask):
        p, t = preds >= self.threshold, target >= self.threshold
        hit, union = p & t, p | t
        self._feed({"m": dict(x=hit.to(torch.float32), y=union.to(torch.float32), weights=None, mask=mask)})

    def _compute(self, states):
        m = states["m"]
        return safe_div(m["sum_x"], m["sum_y"])


# -- weighted means of a per-element value -------------------------------------------


class LogCoshError(PairValueMean):
    """Mean of ``log(cosh(x - y))`` (torchmetrics ``LogCoshError``);
    ``num_outputs=M``: ``[M]`` per column of ``[N, M]`` inputs.

    Computed as ``|d| + log1p(exp(-2|d|)) - log 2``, finite for any finite
    ``d`` (torchmetrics' ``log((exp(d) + exp(-d)) / 2)`` overflows to inf for
    ``|d| > 88`` in float32).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.LogCoshError()
        >>> m.update(torch.tensor([3.0, 5.0, 2.5, 7.0]), torch.tensor([2.5, 5.0, 4.0, 8.0]))
        >>> round(m.compute().item(), 4)
        0.3523
    """

    def __init__(self, num_outputs: int = 1, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)
        A.check_int("LogCoshError", "num_outputs", num_outputs)
        self.num_outputs = num_outputs

    def _check_outputs(self, shape):
        check_outputs("LogCoshError", self.num_outputs, shape)

    @staticmethod
    def _value(p, t):
        d = (p - t).abs_()
        return d + torch.log1p(torch.exp(-2.0 * d)) - 0.6931471805599453


class MinkowskiDistance(PairValueMean):
    """``(Σw |x - y|^p)^(1/p)`` (torchmetrics ``MinkowskiDistance``; scipy
    ``distance.minkowski(..., w=weights)``), ``p >= 1``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.MinkowskiDistance(p=3)
        >>> m.update(torch.tensor([6.1, 2.11, 3.1, 5.6]), torch.tensor([1.0, 2.8, 3.5, 4.5]))
        >>> round(m.compute().item(), 4)
        5.122
    """

    reduction = "sum"

    def __init__(self, p: float, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)
        A.check(isinstance(p, numbers.Real) and not isinstance(p, bool), "MinkowskiDistance", "p",
                f"must be a real number >= 1, got {p!r}", TypeError)
        A.check(float(p) >= 1.0, "MinkowskiDistance", "p", f"must be >= 1, got {p!r}")
        self.p = p

    def _value(self, p, t):
        return (p - t).abs_().pow_(float(self.p))

    def _compute(self, states):
        return torch.pow(super()._compute(states), 1.0 / float(self.p))


class TweedieDevianceScore(PairValueMean):
    """Mean Tweedie deviance of power ``power`` (torchmetrics
    ``TweedieDevianceScore``, sklearn ``mean_tweedie_deviance``): 0 normal
    (squared error), 1 Poisson, 2 Gamma, other ``p <= 0`` or ``p >= 1``
    the general formula; ``0 < power < 1`` is undefined (``ValueError``).

    Inputs outside the power's domain (``preds <= 0`` for ``p < 0`` or
    ``p >= 1``; ``target < 0`` for ``1 <= p < 2``; ``target <= 0`` for
    ``p >= 2``) make torchmetrics raise in ``update`` (a host read). Here the
    element's deviance is NaN, counted on the device: under the default
    ``nan_strategy="error"`` ``compute()`` raises with the count (as
    torchmetrics, one read later); ``"ignore"`` leaves those elements out,
    ``"propagate"`` gives NaN.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.TweedieDevianceScore(power=2)
        >>> m.update(torch.tensor([4.0, 3.0, 2.0, 1.0]), torch.tensor([1.0, 2.0, 3.0, 4.0]))
        >>> round(m.compute().item(), 4)
        1.2083
    """

    def __init__(self, power: float = 0.0, nan_strategy: str = "error"):
        super().__init__(nan_strategy=nan_strategy)
        name = "TweedieDevianceScore"
        A.check(isinstance(power, numbers.Real) and not isinstance(power, bool), name, "power",
                f"must be a real number, got {power!r}", TypeError)
        A.check(not (0.0 < float(power) < 1.0), name, "power",
                f"must be <= 0 or >= 1 (the deviance is not defined for 0 < power < 1), got {power!r}")
        self.power = power

    def _value(self, p, t):
        pw = float(self.power)
        if pw == 0:
            return (t - p).square_()
        if pw == 1:
            ok = (p > 0) & (t >= 0)
            dev = 2.0 * (torch.special.xlogy(t, t / p) + p - t)
        elif pw == 2:
            ok = (p > 0) & (t > 0)
            dev = 2.0 * (torch.log(p / t) + t / p - 1.0)
        else:
            if pw < 0:
                ok = p > 0
            elif pw < 2:
                ok = (p > 0) & (t >= 0)
            else:
                ok = (p > 0) & (t > 0)
            t1 = torch.pow(torch.clamp(t, min=0.0), 2.0 - pw) / ((1.0 - pw) * (2.0 - pw))
            t2 = t * torch.pow(p, 1.0 - pw) / (1.0 - pw)
            t3 = torch.pow(p, 2.0 - pw) / (2.0 - pw)
            dev = 2.0 * (t1 - t2 + t3)
        return torch.where(ok, dev, torch.full_like(dev, float("nan")))
