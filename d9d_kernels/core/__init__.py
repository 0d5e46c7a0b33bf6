"""The metric core (statistics, storage, plans, forward, sync, Metric, MetricGroup); it never imports the catalogue."""

from d9d_kernels.core.group import MetricGroup
from d9d_kernels.core.metric import HostValues, Metric
from d9d_kernels.core.statistic import KINDS, MAX, REPLICA, SUM, Slot, Statistic

__all__ = ["Metric", "MetricGroup", "HostValues", "Statistic", "Slot", "SUM", "MAX", "REPLICA", "KINDS"]
