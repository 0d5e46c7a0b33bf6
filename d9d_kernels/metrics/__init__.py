"""The metric catalogue, built on ``d9d_kernels.core``."""

from d9d_kernels.metrics.aggregation import MaxMetric, MinMetric, SumMetric, WeightedMeanMetric
from d9d_kernels.metrics.moments import ExtremaStatistic, MomentsStatistic, recenter_moments

__all__ = [
    "MomentsStatistic", "ExtremaStatistic", "recenter_moments",
    "SumMetric", "WeightedMeanMetric", "MaxMetric", "MinMetric",
]
