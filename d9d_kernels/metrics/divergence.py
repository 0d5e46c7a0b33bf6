"""JensenShannonDivergence (torchmetrics 1.9): the sum or mean of a per-row
value (``ValueMean``: one ``weighted_moments`` call over the ``[N]`` row
values), as ``KLDivergence`` in ``similarity.py``.

torchmetrics' ``reduction="none"`` keeps every row ever seen (a growing
state); it is refused with a ``ValueError`` naming the argument.
"""

from __future__ import annotations

import math

import torch

from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.similarity import _check_rows
from d9d_kernels.metrics.value_mean import ValueMean

__all__ = ["JensenShannonDivergence"]


def _xlogy(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x · log(y)``, 0 where ``x == 0`` whatever ``y`` (torchmetrics' ``_safe_xlogy``:
    a class absent from both rows has ``0 / 0`` there)."""
    return torch.where(x == 0, torch.zeros_like(x), x * torch.log(y))


class JensenShannonDivergence(ValueMean):
    """``D_JS(P || Q) = ½ D_KL(P || M) + ½ D_KL(Q || M)``, ``M = (P + Q) / 2``,
    per row of ``p``, ``q`` ``[N, D]``, averaged (``reduction="mean"``) or
    summed over rows (torchmetrics ``JensenShannonDivergence``; scipy
    ``distance.jensenshannon(p, q) ** 2``, natural log).

    ``log_prob=False``: rows are probabilities (normalised to sum 1 first;
    ``0 · log 0 = 0``); ``log_prob=True``: rows are log-probabilities
    (``M`` by a log-sum-exp). Computed in float64. ``mask`` (bool ``[N]``) drops rows.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.JensenShannonDivergence()
        >>> m.update(torch.tensor([[0.1, 0.9], [0.2, 0.8], [0.3, 0.7]]),
        ...          torch.tensor([[0.3, 0.7], [0.4, 0.6], [0.5, 0.5]]))
        >>> round(m.compute().item(), 4)
        0.0259
    """

    def __init__(self, log_prob: bool = False, reduction: str = "mean", nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)
        A.check(isinstance(log_prob, bool), "JensenShannonDivergence", "log_prob", f"must be a bool, got {log_prob!r}",
                TypeError)
        self.log_prob = log_prob
        self.reduction = self._check_reduction(reduction)

    def __repr__(self) -> str:
        return f"JensenShannonDivergence(log_prob={self.log_prob}, reduction={self.reduction!r})"

    def update(self, p: torch.Tensor, q: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Adds rows ``[N, D]``; ``mask`` (bool ``[N]``) drops rows."""
        _check_rows("JensenShannonDivergence", "p", "q", p, q)
        A.check_mask(type(self).__name__, mask, p.shape[:1])
        p, q = p.to(torch.float64), q.to(torch.float64)
        if self.log_prob:
            m = torch.logsumexp(torch.stack([p, q]), dim=0) - math.log(2.0)
            js = 0.5 * (p.exp() * (p - m)).sum(-1) + 0.5 * (q.exp() * (q - m)).sum(-1)
        else:
            p = p / p.sum(-1, keepdim=True)
            q = q / q.sum(-1, keepdim=True)
            m = (p + q) / 2
            js = 0.5 * _xlogy(p, p / m).sum(-1) + 0.5 * _xlogy(q, q / m).sum(-1)
        self._add(js, None, mask)
