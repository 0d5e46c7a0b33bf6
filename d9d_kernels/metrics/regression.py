"""Regression metrics from one-pass weighted moments (``MomentsStatistic``).

All five metrics on the same ``(preds, target, weights, mask)`` share ONE
``weighted_moments`` call in a group (``shared=True``): the state is
``Σw, Σw·x, Σw·x², Σw·y, Σw·y², Σw·xy, Σw|x-y|, Σw(x-y)², n`` about pivots
(a REPLICA slot set from the first valid element), which keeps R² / Pearson
exact for data like ``1e6 + noise``. Formulas and degenerate cases:
``formulas.regression``.

``update(preds, target, weights=None, mask=None)``: any equal shapes
(flattened); ``weights`` broadcastable to ``preds`` (scikit-learn's
``sample_weight``); ``mask`` bool broadcastable to ``preds``.

``nan_strategy``: ``"propagate"`` (default, as torchmetrics: a NaN/Inf input
makes the result NaN), ``"ignore"`` (non-finite elements are left out),
``"error"`` (``compute()`` raises ``ValueError`` with the count).

R2Score and ExplainedVariance score each output column of ``[N, num_outputs]``
inputs and reduce the scores by ``multioutput`` (torchmetrics). The state is
allocated at construction, so ``num_outputs`` is given up front; a 2-D input
of another width raises rather than pooling its columns.
"""

from __future__ import annotations

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.formulas import regression as G
from d9d_kernels.metrics.moments import MomentsStatistic, OutputMomentsStatistic

__all__ = ["MeanSquaredError", "MeanAbsoluteError", "R2Score", "PearsonCorrCoef", "ExplainedVariance"]


class _Regression(Metric):
    def __init__(self, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)

    def _statistics(self):
        return {"m": MomentsStatistic(paired=True, skip_bad=self.nan_strategy == "ignore", shared=True)}

    def update(
        self,
        preds: torch.Tensor,
        target: torch.Tensor,
        weights: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> None:
        """Adds a batch (device-local, no host sync)."""
        A.check_pairs(type(self).__name__, preds, target, weights, mask)
        self._check_outputs(tuple(preds.shape))
        self._feed({"m": dict(x=preds, y=target, weights=weights, mask=mask)})

    def _check_outputs(self, shape: tuple[int, ...]) -> None:
        """Raises where ``shape`` does not fit the metric's outputs (any shape pools)."""

    def _compute(self, states):
        return self._value(states["m"])


class _Outputs(_Regression):
    """State per output column of ``[N, num_outputs]`` inputs (torchmetrics'
    ``num_outputs``): one moment vector per column, allocated at construction.
    With ``num_outputs=1`` a metric whose ``_pools`` is set takes any shape and
    pools it (torchmetrics flattens there); otherwise a 2-D input must have
    ``num_outputs`` columns and raises naming it, never pooling silently."""

    _pools = False

    def __init__(self, num_outputs: int = 1, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)
        A.check_int(type(self).__name__, "num_outputs", num_outputs)
        self.num_outputs = num_outputs

    def _statistics(self):
        if self.num_outputs == 1:
            return super()._statistics()
        return {"m": OutputMomentsStatistic(paired=True, skip_bad=self.nan_strategy == "ignore", shared=True,
                                            outputs=self.num_outputs)}

    def _check_outputs(self, shape):
        M = self.num_outputs
        if M == 1 and self._pools:
            return
        if len(shape) == 2 and shape[1] != M:
            A.fail(type(self).__name__, "num_outputs",
                   f"is {M} but preds and target of shape {shape} have {shape[1]} columns (outputs): pass "
                   f"num_outputs={shape[1]} for a score per column (torchmetrics), or "
                   f"flatten preds and target to pool them")
        if not (len(shape) == 2 or (M == 1 and len(shape) <= 1)):
            want = "[N] or [N, 1]" if M == 1 else f"[N, {M}]"
            A.fail(type(self).__name__, "preds", f"must be {want} (num_outputs={M}), got shape {shape}")


class MeanSquaredError(_Outputs):
    """Weighted mean squared error; ``squared=False`` gives the RMSE
    (torchmetrics ``MeanSquaredError`` / sklearn ``mean_squared_error``,
    ``root_mean_squared_error``); ``num_outputs`` > 1: one value per column
    of ``[N, num_outputs]`` inputs (torchmetrics).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.MeanSquaredError()
        >>> m.update(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1.0, 3.0, 2.0]))
        >>> round(m.compute().item(), 6)
        1.666667
    """

    _pools = True

    def __init__(self, squared: bool = True, num_outputs: int = 1, nan_strategy: str = "propagate"):
        super().__init__(num_outputs, nan_strategy=nan_strategy)
        A.check(isinstance(squared, bool), "MeanSquaredError", "squared", f"must be a bool, got {squared!r}", TypeError)
        self.squared = squared

    def _value(self, s):
        return G.mean_squared_error(s, self.squared)


class MeanAbsoluteError(_Outputs):
    """Weighted mean absolute error (torchmetrics ``MeanAbsoluteError`` / sklearn
    ``mean_absolute_error``); ``num_outputs`` as ``MeanSquaredError``'s."""

    _pools = True

    def _value(self, s):
        return G.mean_absolute_error(s)


MULTIOUTPUTS = ("raw_values", "uniform_average", "variance_weighted")


class _PerOutput(_Outputs):
    """A score per output column, reduced by ``multioutput`` (torchmetrics' ``num_outputs`` / ``multioutput``)."""

    def __init__(self, num_outputs: int = 1, multioutput: str = "uniform_average", nan_strategy: str = "propagate"):
        super().__init__(num_outputs, nan_strategy=nan_strategy)
        A.check_choice(type(self).__name__, "multioutput", multioutput, MULTIOUTPUTS)
        self.multioutput = multioutput

    def _value(self, s):
        scores = self._scores(s)
        if scores.dim() == 0:
            return scores
        return G.average_outputs(scores, s, self.multioutput)


class R2Score(_PerOutput):
    """Coefficient of determination (sklearn ``r2_score`` with ``sample_weight``,
    ``force_finite=True``; torchmetrics ``R2Score``).

    Args:
        adjusted: number of independent regressors ``k``: the adjusted score
            ``1 - (1 - r2)(n - 1)/(n - k - 1)`` (torchmetrics; the plain score
            where ``n <= k + 1``).
        multioutput: ``"uniform_average"`` (default), ``"raw_values"`` or
            ``"variance_weighted"`` over the ``num_outputs`` columns.
        num_outputs: columns of ``[N, num_outputs]`` inputs (1: ``[N]``).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.R2Score(num_outputs=2, multioutput="raw_values")
        >>> m.update(torch.tensor([[0.0, 2.0], [-1.0, 2.0], [8.0, -5.0]]),
        ...          torch.tensor([[0.5, 1.0], [-1.0, 1.0], [7.0, -6.0]]))
        >>> [round(v, 4) for v in m.compute().tolist()]
        [0.9654, 0.9082]
    """

    def __init__(self, adjusted: int = 0, multioutput: str = "uniform_average", num_outputs: int = 1,
                 nan_strategy: str = "propagate"):
        super().__init__(num_outputs, multioutput, nan_strategy)
        A.check_int("R2Score", "adjusted", adjusted, lo=0)
        self.adjusted = adjusted

    def _scores(self, s):
        return G.r2_adjust(G.r2_score(s), s, self.adjusted)


class PearsonCorrCoef(_Outputs):
    """(Weighted) Pearson correlation of preds and target (torchmetrics
    ``PearsonCorrCoef`` / ``numpy.corrcoef``); 0.0 when a variance is 0;
    ``num_outputs`` > 1: one per column of ``[N, num_outputs]`` inputs. With
    ``num_outputs=1`` any shape pools (torchmetrics refuses a 2-D input of
    several columns there)."""

    _pools = True

    def _value(self, s):
        return G.pearson_corrcoef(s)


class ExplainedVariance(_PerOutput):
    """Explained variance (sklearn ``explained_variance_score`` with
    ``sample_weight``, ``force_finite=True``; torchmetrics ``ExplainedVariance``);
    ``multioutput`` and ``num_outputs`` as ``R2Score``'s."""

    def __init__(self, multioutput: str = "uniform_average", num_outputs: int = 1, nan_strategy: str = "propagate"):
        super().__init__(num_outputs, multioutput, nan_strategy)

    def _scores(self, s):
        return G.explained_variance(s)
