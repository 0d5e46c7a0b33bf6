"""Metrics that average (or sum) a per-element or per-row value: the value
is formed in one elementwise pass, then ``MomentsStatistic`` (the
``weighted_moments`` kernel, as ``WeightedMeanMetric``) keeps ``Σw·v`` and
``Σw`` in the packed state. Sums about a pivot, so a mean of values near 1e6
stays exact; ``mask`` and ``weights`` come for free; ``nan_strategy`` as the
aggregation metrics ("propagate": NaN flows into the result, "ignore":
non-finite values are left out, "error": ``compute()`` raises with the count).

No data (nothing updated, every element masked or left out): a mean is NaN
(0/0) and a sum is 0.0, torchmetrics' values for every metric on this base
(``tests/metrics/test_value_mean.py``).
"""

from __future__ import annotations

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.moments import MomentsStatistic, OutputMomentsStatistic

__all__ = ["ValueMean", "PairValueMean"]


def common_float(p: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``p``, ``t`` in their common floating dtype (float64 for integers and bools)."""
    dtype = torch.promote_types(p.dtype, t.dtype)
    if not dtype.is_floating_point:
        dtype = torch.float64
    return p.to(dtype), t.to(dtype)


class ValueMean(Metric):
    """Base: subclasses call ``self._add(values, weights, mask)`` from ``update``
    and set ``reduction`` to ``"mean"`` (``Σw·v / Σw``; NaN with no data) or
    ``"sum"`` (``Σw·v``; 0.0 with no data). ``num_outputs`` (an instance
    attribute, 1 unless a subclass sets it): values ``[N, num_outputs]``
    give one result per column."""

    reduction = "mean"
    num_outputs = 1

    def __init__(self, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)

    def _statistics(self):
        skip = self.nan_strategy == "ignore"
        if self.num_outputs == 1:
            return {"m": MomentsStatistic(paired=False, skip_bad=skip, shared=False)}
        return {"m": OutputMomentsStatistic(paired=False, skip_bad=skip, shared=False, outputs=self.num_outputs)}

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


class PairValueMean(ValueMean):
    """A ``ValueMean`` of ``v = self._value(p, t)`` per element of
    ``update(preds, target, weights=None, mask=None)``: any equal shapes,
    ``weights`` / ``mask`` broadcastable (``A.check_pairs``); ``p``, ``t``
    in the inputs' common floating dtype (float64 for integers: a float32
    batch needs no float64 copies; the kernel sums in float64)."""

    def update(self, preds: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> None:
        """Adds a batch (device-local, no host sync)."""
        A.check_pairs(type(self).__name__, preds, target, weights, mask)
        self._check_outputs(tuple(preds.shape))
        self._add(self._value(*common_float(preds, target)), weights, mask)

    def _check_outputs(self, shape: tuple[int, ...]) -> None:
        """Raises where ``shape`` does not fit ``num_outputs`` (here: any shape pools)."""

    def _value(self, p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
