"""The vocab-parallel partials: ``vocab_partials`` of one rank's shard, ``vocab_combine`` of all ranks'.

For logits ``x`` ``[N, size]`` holding the vocabulary columns ``[start, start
+ size)`` and targets ``[N]`` (global ids), row i of the result (float64
``[N, 2 + sumexp + 2 * kmax]``) is: the row max, the target's logit (-inf
when the target is not in the shard), ``Σ exp(x - max)`` when ``sumexp``, the
shard's best ``kmax`` values and their global indices (ties: lower index
first; -inf and ``vocab_parallel.PAST`` where the shard is narrower than
kmax). A row with a NaN or +Inf has a NaN or +Inf max. One pass over the
shard in its own dtype (csrc/cpu/vocab_partials.cpp); the torch-ops
specification is ``d9d_kernels.metrics.vocab_parallel._local_partials``.

``vocab_combine`` combines the tp ranks' gathered partials ``[W, N, P]``
per row: the row max, the logsumexp, the target's logit and the best ``kmax``
global indices of the merged lists (the torch-ops specification is
``vocab_parallel._combine``).

Internal ops, compiled for CPU only and not in ``OPS``: where they cannot
run, these functions return None and the caller uses torch ops.
"""

from __future__ import annotations

import torch

from d9d_kernels import _extension

AVAILABLE: bool = _extension.CPP_ERROR is None and _extension._has_kernel("vocab_partials", "CPU")
COMBINE: bool = _extension.CPP_ERROR is None and _extension._has_kernel("vocab_combine", "CPU")
#: the largest kmax the op's per-row buffer holds (kTopKBuffer)
MAX_K = 64


def vocab_partials_ok(x: torch.Tensor, kmax: int) -> bool:
    """The compiled pass serves ``x`` ``[N, size]``: CPU, rows contiguous, ``kmax <= MAX_K``."""
    return (AVAILABLE and x.device.type == "cpu" and x.is_floating_point() and x.dim() == 2 and x.shape[1] >= 1
            and (x.shape[1] == 1 or x.stride(1) == 1) and kmax <= MAX_K and not torch.compiler.is_compiling())


def vocab_partials(x: torch.Tensor, target: torch.Tensor, start: int, kmax: int, sumexp: bool) -> torch.Tensor | None:
    """``[N, 2 + sumexp + 2 * kmax]`` float64 partials of the shard ``x`` (module
    docstring); ``target`` ``[N]`` int64. None where ``vocab_partials_ok`` is false."""
    if not vocab_partials_ok(x, kmax):
        return None
    out = torch.empty(x.shape[0], 2 + int(sumexp) + 2 * kmax, dtype=torch.float64, device=x.device)
    torch.ops.d9d_kernels.vocab_partials(x, target, start, kmax, sumexp, out)
    return out


def vocab_combine(g: torch.Tensor, kmax: int, sumexp: bool):
    """``(row_max, lse or None, target_logit, top)`` of the gathered partials
    ``g`` float64 ``[W, N, P]``: float64 ``[N]`` each and int64 ``[N, kmax]``.
    None where the compiled op cannot run (not CPU, no extension, tracing)."""
    if not (COMBINE and g.device.type == "cpu" and kmax <= MAX_K and not torch.compiler.is_compiling()):
        return None
    n = g.shape[1]
    f = dict(dtype=torch.float64, device=g.device)
    row_max, lse, target_logit = torch.empty(n, **f), torch.empty(n if sumexp else 0, **f), torch.empty(n, **f)
    top = torch.empty(n, kmax, dtype=torch.int64, device=g.device)
    torch.ops.d9d_kernels.vocab_combine(g.contiguous(), kmax, sumexp, row_max, lse, target_logit, top)
    return row_max, (lse if sumexp else None), target_logit, top
