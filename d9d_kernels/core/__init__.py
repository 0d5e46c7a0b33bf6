"""The metric core: statistics, packed storage, the sync protocol, Metric and MetricGroup.

Imports flow one way: ``d9d_kernels.metrics`` (the catalogue) builds on this
package; nothing here imports the catalogue.
"""

from d9d_kernels.core.group import MetricGroup
from d9d_kernels.core.metric import HostValues, Metric
from d9d_kernels.core.statistic import KINDS, MAX, REPLICA, SUM, Slot, Statistic

__all__ = ["Metric", "MetricGroup", "HostValues", "Statistic", "Slot", "SUM", "MAX", "REPLICA", "KINDS"]
