"""The metric catalogue, built on ``d9d_kernels.core``."""

from d9d_kernels.metrics.aggregation import MaxMetric, MinMetric, SumMetric, WeightedMeanMetric
from d9d_kernels.metrics.moments import ExtremaStatistic, MomentsStatistic

__all__ = [
    "MomentsStatistic", "ExtremaStatistic",
    "SumMetric", "WeightedMeanMetric", "MaxMetric", "MinMetric",
]
