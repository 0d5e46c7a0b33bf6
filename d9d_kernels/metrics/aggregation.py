"""Aggregation metrics: ``update(values, weights=None, mask=None)``.

* ``SumMetric``: ``Σ w·x`` (w defaults to 1); 0 before any update.
* ``WeightedMeanMetric``: ``Σ w·x / Σ w``; NaN when ``Σ w == 0`` (no data, all
  weights zero, or weights summing to zero).
* ``MeanMetric``: torchmetrics' name and arguments for it:
  ``update(value, weight=1.0)``.
* ``MaxMetric`` / ``MinMetric``: max / min of the valid values (``weights``
  accepted and ignored); ``-inf`` / ``+inf`` before any update (torchmetrics'
  initial values). Min is stored negated so both reduce with one MAX
  all_reduce.

``values`` may be a Python number (made on the metric's device with
``torch.full``: no host->device copy, no sync), a 0-d or an n-d tensor on the
metric's device; ``weights`` a number or a tensor broadcastable to
``values``; ``mask`` a bool tensor broadcastable to ``values`` (False drops
the element). Results are float64 tensors (counts exact to 2**53).

``nan_strategy`` (every aggregation metric, RunningMean and
ExponentialMovingAverage alike; torchmetrics' values and default):

* ``"warn"`` (default): NaN values (NaN/Inf for Sum and the means: the
  kernel skips non-finite elements) are left out and counted on the device;
  the count is read where ``"error"`` would raise (``compute()``, a group's
  ``compute()``, ``compute_to_host().result()``) and warned once per metric.
* ``"ignore"``: left out silently. ``"error"``: ``compute()`` raises
  ``ValueError`` with the count. ``"disable"`` / ``"propagate"``: NaN flows
  into the value. A float: NaN values (and values with a NaN weight) are
  replaced by it, with weight 1 (torchmetrics' impute).

Max/Min keep an Inf as a valid extremum under every strategy. Nothing is
checked on the host in ``update``.

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

from d9d_kernels.core.metric import Metric, config_args
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics._args import broadcasts_to
from d9d_kernels.metrics.moments import ExtremaStatistic, MomentsStatistic, as_tensor

__all__ = ["SumMetric", "WeightedMeanMetric", "MeanMetric", "MaxMetric", "MinMetric", "AggregationNaN"]

#: torchmetrics' aggregation ``nan_strategy`` values (and "propagate") -> the core's
_NAN = {"warn": "ignore", "ignore": "ignore", "error": "error", "disable": "propagate", "propagate": "propagate"}


class AggregationNaN:
    """torchmetrics' aggregation ``nan_strategy`` on a ``Metric`` (a mixin
    placed before it): ``"warn"`` is the core's ``"ignore"`` with its count
    read where the host reads values anyway, warning once instead of
    raising; a float is kept as ``_impute`` over the core's ``"propagate"``."""

    def __init__(self, nan_strategy="warn"):
        name = type(self).__name__
        impute = isinstance(nan_strategy, numbers.Real) and not isinstance(nan_strategy, bool)
        A.check(impute or (isinstance(nan_strategy, str) and nan_strategy in _NAN), name, "nan_strategy",
                f"must be a float (impute) or one of {tuple(_NAN)}, got {nan_strategy!r}")
        super().__init__(nan_strategy="propagate" if impute else _NAN[nan_strategy])
        d = self.__dict__
        d["_nan_strategy_arg"] = nan_strategy
        d["_impute"] = float(nan_strategy) if impute else None

    def _counts_nan(self) -> bool:
        """Whether the dropped values are counted (the count "error" raises and "warn" warns with)."""
        return self.nan_strategy == "error" or self._nan_strategy_arg == "warn"

    def _raise_on_bad(self) -> bool:
        # "warn" reads its count where the host reads anyway: compute() on CPU state (as "error"
        # does); on a GPU compute() reads nothing and compute_to_host().result() warns (_host_items)
        return self.nan_strategy == "error" or (self._nan_strategy_arg == "warn" and self.device.type == "cpu")

    def _host_items(self):
        items, checks = super()._host_items()
        if self._nan_strategy_arg == "warn" and not checks:
            causes = self._bad_causes(self._states())
            checks = [(self, torch.stack(list(causes.values())).sum(), causes)]
        return items, checks

    def _raise_if_bad(self, count: float, causes: dict[str, float] | None = None) -> None:
        if self._nan_strategy_arg != "warn":
            return super()._raise_if_bad(count, causes)
        if count != 0 and not self.__dict__.get("_warned_nan"):
            self.__dict__["_warned_nan"] = True
            warnings.warn(f"{self._label}: {int(count)} NaN/Inf value(s) were left out since the last reset "
                          "(nan_strategy='warn'; 'ignore' silences this, 'disable' keeps NaN in the value); "
                          "warned once", UserWarning, stacklevel=4)

    def __repr__(self) -> str:
        args = [a for a in config_args(self) if not a.startswith("nan_strategy=")]
        if self._nan_strategy_arg != "warn":
            args.append(f"nan_strategy={self._nan_strategy_arg!r}")
        return f"{type(self).__name__}({', '.join(args)})"

    def _imputed(self, values, weights, device):
        """``values`` (and ``weights``) with torchmetrics' impute applied: new
        tensors, so an update plan never passes a raw input through."""
        x = as_tensor(values, device)
        if not x.is_floating_point():
            return x, weights
        nan = torch.isnan(x)
        if weights is not None:
            w = as_tensor(weights, device)
            nan = nan | torch.isnan(w)
            weights = torch.where(nan, torch.ones_like(w), w)
        return torch.where(nan, torch.full_like(x, self._impute), x), weights


class _Aggregation(AggregationNaN, Metric):

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
        if self._impute is not None:
            values, weights = self._imputed(values, weights, dev)
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
        return states["m"]["sum_x"]


class WeightedMeanMetric(_MomentsAggregation):
    """``Σ w·x / Σ w`` (NaN when ``Σ w == 0``)."""

    def _compute(self, states):
        return states["m"]["mean_x"]


#: MeanMetric.update's default weight; identity tells "not given" (-> no
#: weights, the fastest path) from any given weight, whatever its value, so
#: an update plan never depends on a weight's value
_UNIT_WEIGHT = 1.0


class MeanMetric(WeightedMeanMetric):
    """torchmetrics' ``MeanMetric``: ``update(value, weight=1.0)``, the weighted mean.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.MeanMetric()
        >>> m.update(torch.tensor([1.0, 3.0]))
        >>> m.update(6.0, weight=2.0)
        >>> m.compute().item()
        4.0
    """

    def update(self, value, weight=_UNIT_WEIGHT) -> None:
        """Adds ``value`` (number or tensor) with ``weight`` (number or tensor broadcastable to it)."""
        value, weights, _ = self._inputs(value, None if weight is _UNIT_WEIGHT else weight, None, ("value", "weight"))
        self._feed({"m": {"x": value, "weights": weights, "mask": None}})


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
