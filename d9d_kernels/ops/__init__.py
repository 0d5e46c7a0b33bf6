"""Low-level in-place kernels on float64 state (API.md §6).

Each op adds one batch into caller-owned float64 state tensors and returns
nothing. ``backends()`` lists what can run here; ``backend=`` or the
``D9D_KERNELS_BACKEND`` environment variable forces one.
"""

from d9d_kernels.ops import _fake  # noqa: F401  (register_fake of the compiled ops)
from d9d_kernels.ops._dispatch import backends
from d9d_kernels.ops.binary_stats import binary_stats
from d9d_kernels.ops.class_stats import class_stats
from d9d_kernels.ops.running_extrema import running_extrema
from d9d_kernels.ops.score_histogram import score_histogram
from d9d_kernels.ops.weighted_moments import weighted_moments

__all__ = ["backends", "weighted_moments", "class_stats", "binary_stats", "score_histogram", "running_extrema"]
