"""Metrics that average a per-element or per-row value: the value is formed
in one elementwise pass, then ``MomentsStatistic`` (the ``weighted_moments``
kernel, as ``WeightedMeanMetric``) keeps ``Σw·v`` and ``Σw`` in the packed
state. Sums about a pivot, so a mean of values near 1e6 stays exact; ``mask``
and ``weights`` come for free; ``nan_strategy`` as the aggregation metrics
("propagate": NaN flows into the result, "ignore": non-finite values are
left out, "error": ``compute()`` raises with the count).
"""

from __future__ import annotations

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.moments import MomentsStatistic

__all__ = ["ValueMean"]


class ValueMean(Metric):
    """Base: subclasses call ``self._add(values, weights, mask)`` from ``update``
    and set ``reduction`` to ``"mean"`` (``Σw·v / Σw``) or ``"sum"`` (``Σw·v``)."""

    reduction = "mean"

    def __init__(self, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)

    def _statistics(self):
        return {"m": MomentsStatistic(paired=False, skip_bad=self.nan_strategy == "ignore", shared=False)}

    def _check_reduction(self, reduction) -> str:
        name = type(self).__name__
        A.check(reduction not in ("none", None), name, "reduction",
                "'none' needs every row kept in the state; use 'sum' or 'mean' (the state here is a fixed-size sum)")
        A.check_choice(name, "reduction", reduction, ("mean", "sum"))
        return reduction


    def _add(self, values, weights=None, mask=None) -> None:
        if weights is not None:
            weights = torch.broadcast_to(weights, values.shape)
        if mask is not None:
            mask = torch.broadcast_to(mask, values.shape)
        self._feed({"m": {"x": values, "weights": weights, "mask": mask}})

    def _compute(self, states):
        return states["m"]["sum_x" if self.reduction == "sum" else "mean_x"]
