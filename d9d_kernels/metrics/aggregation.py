"""Aggregation metrics: ``update(values, weights=None, mask=None)``.

* ``SumMetric``: ``Σ w·x`` (w defaults to 1); 0 before any update.
* ``WeightedMeanMetric``: ``Σ w·x / Σ w``; NaN when ``Σ w == 0`` (no data, all
  weights zero, or weights summing to zero).
* ``MeanMetric``: torchmetrics' name and arguments for it:
  ``update(value, weight=1.0)``, ``nan_strategy`` also "warn" (torchmetrics'
  default: NaN/Inf left out, ``compute()`` warns with the count) and
  "disable" (= "propagate").
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
import warnings

import torch

from d9d_kernels.core.metric import NAN_STRATEGIES, Metric
from d9d_kernels.metrics._args import broadcasts_to
from d9d_kernels.metrics.moments import ExtremaStatistic, MomentsStatistic

__all__ = ["SumMetric", "WeightedMeanMetric", "MeanMetric", "MaxMetric", "MinMetric"]


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

    def _inputs(self, values, weights, mask, names=("values", "weights")):
        """Checks the inputs; numbers pass through (the statistic fills them
        on the device), so that an update plan can feed them as they come.
        ``names``: the update's own argument names (for messages)."""
        dev = self._storage.device
        shape = self._check_value(names[0], values, dev)
        if weights is not None:
            w_shape = self._check_value(names[1], weights, dev)
            if not broadcasts_to(w_shape, shape):
                raise ValueError(
                    f"{self._label}.update: argument '{names[1]}' of shape {tuple(w_shape)} does not "
                    f"broadcast to {names[0]} {tuple(shape)}"
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
        mean = sx / w + torch.nan_to_num(px, nan=0.0)
        return torch.where(w == 0, torch.full_like(mean, float("nan")), mean)


#: MeanMetric.update's default weight; identity tells "not given" (-> no
#: weights, the fastest path) from any given weight, whatever its value, so
#: an update plan never depends on a weight's value
_UNIT_WEIGHT = 1.0


class MeanMetric(WeightedMeanMetric):
    """torchmetrics' ``MeanMetric``: ``update(value, weight=1.0)``, the weighted mean.

    ``nan_strategy``: "warn" (default, as torchmetrics: NaN/Inf values are left
    out; ``compute()`` warns once with their count), "ignore", "error",
    "propagate" / "disable" (NaN flows into the mean). A float replacement
    value (torchmetrics' ``nan_strategy=0.0``) is not supported.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.MeanMetric()
        >>> m.update(torch.tensor([1.0, 3.0]))
        >>> m.update(6.0, weight=2.0)
        >>> m.compute().item()
        4.0
    """

    def __init__(self, nan_strategy: str = "warn"):
        if not isinstance(nan_strategy, str) or nan_strategy not in ("warn", "disable", *NAN_STRATEGIES):
            raise ValueError(f"MeanMetric: argument 'nan_strategy' must be one of "
                             f"{('warn', 'disable', *NAN_STRATEGIES)}, got {nan_strategy!r}")
        own = {"warn": "ignore", "disable": "propagate"}.get(nan_strategy, nan_strategy)
        super().__init__(nan_strategy=own)
        self.__dict__["_warn_nan"] = nan_strategy == "warn"
        self.__dict__["_nan_strategy_arg"] = nan_strategy

    def update(self, value, weight=_UNIT_WEIGHT) -> None:
        """Adds ``value`` (number or tensor) with ``weight`` (number or tensor broadcastable to it)."""
        value, weights, _ = self._inputs(value, None if weight is _UNIT_WEIGHT else weight, None, ("value", "weight"))
        self._feed({"m": {"x": value, "weights": weights, "mask": None}})

    def _checked_compute(self, states):
        if self.__dict__["_warn_nan"] and not self.__dict__.get("_warned_nan"):
            n = states["m"]["bad"].item()
            if n:
                self.__dict__["_warned_nan"] = True
                warnings.warn(f"{self._label}: {int(n)} NaN/Inf value(s) were left out of the mean "
                              "(nan_strategy='warn'); warned once", UserWarning, stacklevel=3)
        return super()._checked_compute(states)

    def __repr__(self) -> str:
        a = self.__dict__["_nan_strategy_arg"]
        return "MeanMetric()" if a == "warn" else f"MeanMetric(nan_strategy={a!r})"


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
