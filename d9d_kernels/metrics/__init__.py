"""Metric classes and the statistics they are built from.

Names are resolved lazily (PEP 562): ``d9d_kernels.metric`` imports
``d9d_kernels.metrics.statistic``, and the metric classes import
``d9d_kernels.metric``, so this package must not import them eagerly.
"""

from __future__ import annotations

import importlib

from d9d_kernels.metrics.statistic import KINDS, MAX, REPLICA, SUM, Slot, Statistic

# public name -> submodule of d9d_kernels.metrics
_LAZY = {
    "MomentsStatistic": "moments",
    "ExtremaStatistic": "moments",
    "recenter_moments": "moments",
    "SumMetric": "aggregation",
    "WeightedMeanMetric": "aggregation",
    "MaxMetric": "aggregation",
    "MinMetric": "aggregation",
}

__all__ = ["Statistic", "Slot", "SUM", "MAX", "REPLICA", "KINDS", *_LAZY]


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'd9d_kernels.metrics' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"d9d_kernels.metrics.{mod}"), name)
    globals()[name] = value
    return value
