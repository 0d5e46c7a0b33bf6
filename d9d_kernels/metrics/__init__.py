"""The metric catalogue, built on ``d9d_kernels.core``."""

from d9d_kernels.metrics.aggregation import MaxMetric, MinMetric, SumMetric, WeightedMeanMetric
from d9d_kernels.metrics.moments import ExtremaStatistic, MomentsStatistic, recenter_moments
from d9d_kernels.metrics.formulas import fused as _fused  # noqa: F401  (registers MetricGroup's fused compute)

__all__ = [
    "MomentsStatistic", "ExtremaStatistic", "recenter_moments",
    "SumMetric", "WeightedMeanMetric", "MaxMetric", "MinMetric",
]
