"""d9d_kernels: fused metric kernels and a metric library for large-scale PyTorch training.

``import d9d_kernels`` never initialises CUDA and works without the compiled
extension (see ``d9d_kernels.ops.backends()``).
"""

from d9d_kernels import _extension, ops, reference  # noqa: F401
from d9d_kernels import functional  # noqa: F401
from d9d_kernels.distributed import DistributedContext  # noqa: F401
from d9d_kernels import checkpoint  # noqa: F401
from d9d_kernels.metric import Metric  # noqa: F401
from d9d_kernels.group import MetricGroup  # noqa: F401
from d9d_kernels.metrics.aggregation import MaxMetric, MinMetric, SumMetric, WeightedMeanMetric  # noqa: F401
from d9d_kernels.metrics.catalogue import *  # noqa: F401,F403  (classification, ranking, regression, text)

__version__ = "0.1.0"
