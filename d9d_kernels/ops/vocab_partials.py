"""The vocab-parallel partials: ``vocab_partials`` of one rank's shard; ``vocab_class_stats`` adds all ranks' to the state.

For logits ``x`` ``[N, size]`` holding the vocabulary columns ``[start, start
+ size)`` and targets ``[N]`` (global ids), row i of the result (float64
``[N, 2 + sumexp + 2 * kmax]``) is: the row max, the target's logit (-inf
when the target is not in the shard), ``Σ exp(x - max)`` when ``sumexp``, the
shard's best ``kmax`` values and their global indices (ties: lower index
first; -inf and ``vocab_parallel.PAST`` where the shard is narrower than
kmax). A row with a NaN or +Inf has a NaN or +Inf max. One pass over the
shard in its own dtype (csrc/cpu/vocab_partials.cpp); the torch-ops
specification is ``d9d_kernels.metrics.vocab_parallel._local_partials``.

``vocab_class_stats`` combines the tp ranks' gathered partials ``[W, N, P]``
per row (the row max, the logsumexp, the target's logit and the best
``kmax`` global indices of the merged lists) and adds the rows to the
class_stats state; the torch-ops specification is ``vocab_parallel._combine``
then ``vocab_parallel._add_rows``.

Internal ops, compiled for CPU only and not in ``OPS``: where they cannot
run, these functions return None and the caller uses torch ops.
"""

from __future__ import annotations

import torch

from d9d_kernels import _extension

AVAILABLE: bool = _extension.CPP_ERROR is None and _extension._has_kernel("vocab_partials", "CPU")
COMBINE: bool = _extension.CPP_ERROR is None and _extension._has_kernel("vocab_class_stats", "CPU")
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


def vocab_class_stats(g: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None, ignore_index: int | None,
                      lse: torch.Tensor | None, num_classes: int, top_ks, nll: bool, rows_by_lse: bool,
                      stats: torch.Tensor, extras: torch.Tensor, bad: torch.Tensor,
                      confmat: torch.Tensor | None) -> bool:
    """Adds the gathered partials ``g`` float64 ``[W, N, P]`` of targets
    ``target`` int64 ``[N]`` (``mask`` bool ``[N]`` or None, ``lse`` float64
    ``[N]`` or None) to the class_stats state ``stats`` ``[len(top_ks), 3,
    num_classes]``, ``extras``, ``bad`` and ``confmat`` (or None). False where
    the compiled op cannot run (not CPU, no extension, tracing): nothing is
    written then."""
    kmax = max(max(top_ks, default=0), 1 if confmat is not None else 0)
    if not (COMBINE and g.device.type == "cpu" and kmax <= MAX_K and not torch.compiler.is_compiling()):
        return False
    torch.ops.d9d_kernels.vocab_class_stats(g.contiguous(), target, mask, ignore_index, lse, num_classes,
                                            list(top_ks), nll, rows_by_lse, stats, extras, bad, confmat)
    return True
