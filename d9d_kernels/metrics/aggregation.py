"""Aggregation metrics (API.md §4): ``update(values, weights=None, mask=None)``.

* ``SumMetric``: ``Σ w·x`` (w defaults to 1); 0 before any update.
* ``WeightedMeanMetric``: ``Σ w·x / Σ w``; NaN when ``Σ w == 0`` (no data, or
  all weights zero).
* ``MaxMetric`` / ``MinMetric``: max / min of the valid values (``weights``
  accepted and ignored); ``-inf`` / ``+inf`` before any update (torchmetrics'
  initial values). Min is stored negated so both reduce with one MAX
  all_reduce.

``values`` may be a Python number (made on the metric's device with
``torch.full``: no host->device copy, no sync), a 0-d or an n-d tensor on the
metric's device; ``weights`` a number or a tensor broadcastable to
``values``; ``mask`` a bool tensor broadcastable to ``values`` (False drops
the element). Results are float64 tensors (counts exact to 2**53).

``nan_strategy``: "propagate" (default: NaN/Inf flow into the result),
"ignore" (non-finite elements are skipped; an Inf is still a valid max/min),
"error" (``compute()`` raises ``ValueError`` with the count). Either way they
are counted on the device, never checked on the host.

Example:
    >>> import torch, d9d_kernels as dk
    >>> m = dk.WeightedMeanMetric()
    >>> m.update(torch.tensor([1.0, 3.0]), weights=torch.tensor([1.0, 3.0]))
    >>> m.update(5.0)
    >>> m.compute().item()
    3.0
"""

from __future__ import annotations

import numbers

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.metrics._args import broadcasts_to
from d9d_kernels.metrics.moments import ExtremaStatistic, MomentsStatistic

__all__ = ["SumMetric", "WeightedMeanMetric", "MaxMetric", "MinMetric"]


class _Aggregation(Metric):
    def __init__(self, nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)

    def _check_value(self, arg: str, v, device: torch.device) -> tuple:
        """Checks a tensor or real number input; returns its shape (numbers: ())."""
        if isinstance(v, torch.Tensor):
            if v.device != device:
                raise ValueError(f"{self._label}.update: argument '{arg}' must be on {device}, got {v.device}")
            if v.is_complex():
                raise TypeError(f"{self._label}.update: argument '{arg}' must be real, got {v.dtype}")
            return v.shape
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(
                f"{self._label}.update: argument '{arg}' must be a tensor or a real number, got {type(v).__name__}"
            )
        return ()

    def _inputs(self, values, weights, mask):
        """Checks the inputs; numbers pass through (the statistic fills them
        on the device), so that an update plan can feed them as they come."""
        dev = self._storage.device
        shape = self._check_value("values", values, dev)
        if weights is not None:
            w_shape = self._check_value("weights", weights, dev)
            if not broadcasts_to(w_shape, shape):
                raise ValueError(
                    f"{self._label}.update: argument 'weights' of shape {tuple(w_shape)} does not "
                    f"broadcast to values {tuple(shape)}"
                )
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                raise TypeError(f"{self._label}.update: argument 'mask' must be a bool tensor or None")
            if mask.device != dev:
                raise ValueError(f"{self._label}.update: argument 'mask' must be on {dev}, got {mask.device}")
            if not broadcasts_to(mask.shape, shape):
                raise ValueError(
                    f"{self._label}.update: argument 'mask' of shape {tuple(mask.shape)} does not "
                    f"broadcast to values {tuple(shape)}"
                )
        return values, weights, mask


class _MomentsAggregation(_Aggregation):
    def _statistics(self):
        return {"m": MomentsStatistic(paired=False, skip_bad=self.nan_strategy == "ignore", shared=False)}

    def update(self, values, weights=None, mask=None) -> None:
        """Adds ``values`` (weighted by ``weights``, where ``mask``)."""
        values, weights, mask = self._inputs(values, weights, mask)
        self._feed({"m": {"x": values, "weights": weights, "mask": mask}})


class SumMetric(_MomentsAggregation):
    """``Σ w·x`` over every valid element since ``reset`` (float64)."""

    def _compute(self, states):
        s = states["m"]
        w, sx, px = s["moments"][0], s["moments"][1], s["pivot"][0]
        return sx + w * torch.nan_to_num(px, nan=0.0)


class WeightedMeanMetric(_MomentsAggregation):
    """``Σ w·x / Σ w`` (NaN when ``Σ w == 0``)."""

    def _compute(self, states):
        s = states["m"]
        w, sx, px = s["moments"][0], s["moments"][1], s["pivot"][0]
        return sx / w + torch.nan_to_num(px, nan=0.0)


class _ExtremaAggregation(_Aggregation):
    def _statistics(self):
        return {"e": ExtremaStatistic(skip_bad=self.nan_strategy == "ignore", shared=False)}

    def update(self, values, weights=None, mask=None) -> None:
        """Folds ``values`` where ``mask`` into the running extremum; ``weights`` ignored."""
        values, _, mask = self._inputs(values, None, mask)
        self._feed({"e": {"x": values, "mask": mask}})


class MaxMetric(_ExtremaAggregation):
    """Maximum of the valid values (``-inf`` before any)."""

    def _compute(self, states):
        return states["e"]["extrema"][0].clone()


class MinMetric(_ExtremaAggregation):
    """Minimum of the valid values (``+inf`` before any)."""

    def _compute(self, states):
        return -states["e"]["extrema"][1]
