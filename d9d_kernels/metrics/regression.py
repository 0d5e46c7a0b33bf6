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
"""

from __future__ import annotations

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.formulas import regression as G
from d9d_kernels.metrics.moments import MomentsStatistic

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
        name = type(self).__name__
        A.check_preds_target(name, preds, target)
        ps = tuple(preds.shape)
        if not (tuple(target.shape) == ps):
            A.fail(name, "target", f"must have preds' shape {ps}, got {tuple(target.shape)}")
        if weights is not None:
            A.check_tensor(name, "weights", weights)
            ws = tuple(weights.shape)
            A.check(len(ws) <= len(ps) and all(w in (1, p) for w, p in zip(ws[::-1], ps[::-1])), name, "weights",
                    f"of shape {ws} does not broadcast to preds' {ps}")
        A.check_mask(name, mask, ps)
        self._feed({"m": dict(x=preds, y=target, weights=weights, mask=mask)})

    def _compute(self, states):
        return self._value(states["m"])


class MeanSquaredError(_Regression):
    """Weighted mean squared error; ``squared=False`` gives the RMSE
    (torchmetrics ``MeanSquaredError`` / sklearn ``mean_squared_error``,
    ``root_mean_squared_error``).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.MeanSquaredError()
        >>> m.update(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1.0, 3.0, 2.0]))
        >>> round(m.compute().item(), 6)
        1.666667
    """

    def __init__(self, squared: bool = True, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)
        A.check(isinstance(squared, bool), "MeanSquaredError", "squared", f"must be a bool, got {squared!r}", TypeError)
        self.squared = squared

    def _value(self, s):
        return G.mean_squared_error(s["moments"], self.squared)


class MeanAbsoluteError(_Regression):
    """Weighted mean absolute error (torchmetrics ``MeanAbsoluteError`` / sklearn ``mean_absolute_error``)."""

    def _value(self, s):
        return G.mean_absolute_error(s["moments"])


class R2Score(_Regression):
    """Coefficient of determination (sklearn ``r2_score`` with ``sample_weight``,
    ``force_finite=True``; torchmetrics ``R2Score``)."""

    def _value(self, s):
        return G.r2_score(s["moments"])


class PearsonCorrCoef(_Regression):
    """(Weighted) Pearson correlation of preds and target (torchmetrics
    ``PearsonCorrCoef`` / ``numpy.corrcoef``); 0.0 when a variance is 0."""

    def _value(self, s):
        return G.pearson_corrcoef(s["moments"])


class ExplainedVariance(_Regression):
    """Explained variance (sklearn ``explained_variance_score`` with
    ``sample_weight``, ``force_finite=True``; torchmetrics ``ExplainedVariance``)."""

    def _value(self, s):
        return G.explained_variance(s["moments"], s["pivot"])
