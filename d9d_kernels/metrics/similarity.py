"""Row-wise similarity / divergence metrics: ``CosineSimilarity`` and
``KLDivergence`` (torchmetrics 1.9), as the sum or mean of a per-row value
(``ValueMean``: one ``weighted_moments`` call over the ``[N]`` row values).

torchmetrics' ``reduction="none"`` returns every row ever seen (a growing
state); it is refused here with a clear error: the packed state is fixed-size.
"""

from __future__ import annotations

import torch

from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.value_mean import ValueMean

__all__ = ["CosineSimilarity", "KLDivergence"]


def _check_rows(name: str, a_name: str, b_name: str, a, b) -> None:
    A.check_tensor(name, a_name, a)
    A.check_tensor(name, b_name, b)
    A.check(a.device == b.device, name, b_name, f"must be on {a_name}'s device {a.device}, got {b.device}")
    A.check(tuple(a.shape) == tuple(b.shape), name, b_name,
            f"must have {a_name}'s shape {tuple(a.shape)}, got {tuple(b.shape)}")
    A.check(a.dim() == 2, name, a_name, f"must be 2-D [N, D], got shape {tuple(a.shape)}")


class CosineSimilarity(ValueMean):
    """Cosine similarity of each row of preds and target ``[N, D]``, summed
    (``reduction="sum"``, torchmetrics' default) or averaged over rows.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.CosineSimilarity(reduction="mean")
        >>> m.update(torch.tensor([[1.0, 2, 3, 4], [-1, -2, -3, -4]]), torch.tensor([[1.0, 2, 3, 4], [1, 2, 3, 4]]))
        >>> m.compute().item()
        0.0
    """

    def __init__(self, reduction: str = "sum", nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)
        self.reduction = self._check_reduction(reduction)

    def __repr__(self) -> str:
        return f"CosineSimilarity(reduction={self.reduction!r})"

    def update(self, preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Adds rows ``[N, D]``; ``mask`` (bool ``[N]``) drops rows."""
        _check_rows("CosineSimilarity", "preds", "target", preds, target)
        A.check_mask(type(self).__name__, mask, preds.shape[:1])
        p, t = preds.to(torch.float64), target.to(torch.float64)
        cos = (p * t).sum(-1) / (p.norm(dim=-1) * t.norm(dim=-1))
        self._add(cos, None, mask)


class KLDivergence(ValueMean):
    """``D_KL(P || Q)`` per row of ``p``, ``q`` ``[N, D]``, averaged
    (``reduction="mean"``) or summed over rows (torchmetrics ``KLDivergence``).

    ``log_prob=False``: rows are probabilities (normalised to sum 1 first;
    ``0 · log 0 = 0``); ``log_prob=True``: rows are log-probabilities.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.KLDivergence()
        >>> m.update(torch.tensor([[0.36, 0.48, 0.16]]), torch.tensor([[1 / 3, 1 / 3, 1 / 3]]))
        >>> round(m.compute().item(), 4)
        0.0853
    """

    def __init__(self, log_prob: bool = False, reduction: str = "mean", nan_strategy: str = "propagate"):
        super().__init__(nan_strategy=nan_strategy)
        A.check(isinstance(log_prob, bool), "KLDivergence", "log_prob", f"must be a bool, got {log_prob!r}", TypeError)
        self.log_prob = log_prob
        self.reduction = self._check_reduction(reduction)

    def __repr__(self) -> str:
        return f"KLDivergence(log_prob={self.log_prob}, reduction={self.reduction!r})"

    def update(self, p: torch.Tensor, q: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Adds rows ``[N, D]``; ``mask`` (bool ``[N]``) drops rows."""
        _check_rows("KLDivergence", "p", "q", p, q)
        A.check_mask(type(self).__name__, mask, p.shape[:1])
        p, q = p.to(torch.float64), q.to(torch.float64)
        if self.log_prob:
            kl = (p.exp() * (p - q)).sum(-1)
        else:
            p = p / p.sum(-1, keepdim=True)
            q = q / q.sum(-1, keepdim=True)
            kl = torch.where(p == 0, torch.zeros_like(p), p * torch.log(p / q)).sum(-1)
        self._add(kl, None, mask)
