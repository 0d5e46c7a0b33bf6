"""row_sum_exp: ``Σ_j exp(x[i, j] - row_max[i])`` per row, in float64.

The shard pass of the vocab-parallel partials (d9d_kernels/metrics/
vocab_parallel.py): the class_stats NLL row pass (csrc/cpu/row_sum_exp.cpp)
reading the shard in its own dtype. An internal op, compiled for CPU only and
not one of ``OPS``: where it cannot run, ``row_sum_exp`` returns None and the
caller uses torch ops.
"""

from __future__ import annotations

import torch

from d9d_kernels import _extension

AVAILABLE: bool = _extension.CPP_ERROR is None and _extension._has_kernel("row_sum_exp", "CPU")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def row_sum_exp_ok(x: torch.Tensor) -> bool:
    """The compiled pass serves ``x`` ``[N, V]``: CPU, <= 32-bit scores, contiguous rows."""
    return (AVAILABLE and x.device.type == "cpu" and x.dtype in _DTYPES and x.dim() == 2
            and (x.shape[1] <= 1 or x.stride(1) == 1) and not torch.compiler.is_compiling())


def row_sum_exp(x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor | None:
    """``[N]`` float64 sums of ``exp(x - row_max[:, None])``; ``row_max`` must be
    each row's max (or 0 for a row without a finite one). None where
    ``row_sum_exp_ok(x)`` is false."""
    if not row_sum_exp_ok(x):
        return None
    out = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    torch.ops.d9d_kernels.row_sum_exp(x, row_max.to(torch.float32).contiguous(), out)
    return out
