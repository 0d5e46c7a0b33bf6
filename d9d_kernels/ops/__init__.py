"""Low-level in-place kernels on float64 state.

Each op adds one batch into caller-owned float64 state tensors and returns
nothing. ``backends()`` lists what can run here; ``backend=`` or the
``D9D_KERNELS_BACKEND`` environment variable forces one.

Besides the checked wrappers (one per op), the op layer exports what the
metric catalogue builds on: ``raw(op, device)`` (the implementation a wrapper
runs, without its conversions), ``backend_for(op, device)`` (which backend a call would take),
``FLOATS`` (the floating dtypes the kernels read), ``OPS``, ``BACKENDS``,
``as_index`` (class indices from any real tensor), ``vocab_partials`` (the
compiled per-row partials of a vocab-parallel shard) and ``linear_logits``
(per-row reductions of ``hidden @ weight.T`` without the logits; torch and
Triton backends only, not in ``OPS``).
"""

import torch

from d9d_kernels._extension import OPS
from d9d_kernels.ops._common import FLOATS
from d9d_kernels.ops._common import as_index as _as_index
from d9d_kernels.ops._dispatch import BACKENDS, backends, pick, raw
from d9d_kernels.ops.binary_stats import binary_stats
from d9d_kernels.ops.class_stats import class_stats
from d9d_kernels.ops.expert_histogram import expert_histogram
from d9d_kernels.ops.linear_logits import linear_logits
from d9d_kernels.ops.running_extrema import running_extrema
from d9d_kernels.ops.score_histogram import score_histogram
from d9d_kernels.ops.vocab_partials import vocab_partials
from d9d_kernels.ops.weighted_moments import weighted_moments


def as_index(t, op: str = "class_stats", arg: str = "preds"):
    """``t`` as int64 class indices on its device: floating values that are not
    whole numbers become an index out of range for every op (counted as bad by
    the kernels, never truncated). ``op``/``arg`` name the input in errors."""
    return _as_index(op, arg, t)


def backend_for(op: str, device: torch.device, backend: str | None = None) -> str:
    """The backend (one of ``BACKENDS``) that runs ``op`` on ``device``, with
    ``backend=`` / ``D9D_KERNELS_BACKEND`` honoured; raises if a forced one can't."""
    return pick(op, torch.device(device), backend)


__all__ = [
    "backends", "backend_for", "raw", "as_index", "vocab_partials", "FLOATS", "OPS", "BACKENDS",
    "weighted_moments", "class_stats", "binary_stats", "score_histogram", "running_extrema", "expert_histogram",
    "linear_logits",
]
