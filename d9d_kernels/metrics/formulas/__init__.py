"""Pure functions: sufficient statistics (float64 tensors) -> metric values.

No state, no host sync, no data-dependent shapes: every function here is a
composition of tensor ops, so ``compute()`` stays on the device and the
formulas can be tested on hand-made statistics.
"""

from d9d_kernels.metrics.formulas import classification, ranking, regression  # noqa: F401
