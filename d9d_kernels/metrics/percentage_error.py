"""MeanAbsolutePercentageError and SymmetricMeanAbsolutePercentageError
(torchmetrics 1.9 formulas, epsilon 1.17e-6) as weighted means of the
per-element error (``PairValueMean``: one ``weighted_moments`` call)."""

from __future__ import annotations

from d9d_kernels.metrics.value_mean import PairValueMean

__all__ = ["MeanAbsolutePercentageError", "SymmetricMeanAbsolutePercentageError"]

EPSILON = 1.17e-06


class MeanAbsolutePercentageError(PairValueMean):
    """Mean of ``|p - t| / max(|t|, 1.17e-6)`` (torchmetrics ``MeanAbsolutePercentageError``).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.MeanAbsolutePercentageError()
        >>> m.update(torch.tensor([0.9, 15, 1.2e6]), torch.tensor([1, 10, 1e6]))
        >>> round(m.compute().item(), 4)
        0.2667
    """

    @staticmethod
    def _value(p, t):
        return (p - t).abs_().div_(t.abs().clamp_(min=EPSILON))


class SymmetricMeanAbsolutePercentageError(PairValueMean):
    """Mean of ``2 |p - t| / max(|t| + |p|, 1.17e-6)`` (torchmetrics
    ``SymmetricMeanAbsolutePercentageError``).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.SymmetricMeanAbsolutePercentageError()
        >>> m.update(torch.tensor([0.9, 15, 1.2e6]), torch.tensor([1, 10, 1e6]))
        >>> round(m.compute().item(), 4)
        0.229
    """

    @staticmethod
    def _value(p, t):
        return (p - t).abs_().mul_(2.0).div_((t.abs() + p.abs()).clamp_(min=EPSILON))
