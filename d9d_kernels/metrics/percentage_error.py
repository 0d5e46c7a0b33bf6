"""MeanAbsolutePercentageError and SymmetricMeanAbsolutePercentageError
(torchmetrics 1.9 formulas, epsilon 1.17e-6) as weighted means of the
per-element error (``ValueMean``: one ``weighted_moments`` call)."""

from __future__ import annotations

import torch

from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.value_mean import ValueMean

__all__ = ["MeanAbsolutePercentageError", "SymmetricMeanAbsolutePercentageError"]

EPSILON = 1.17e-06


class _PercentageError(ValueMean):
    def update(self, preds: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None,
               mask: torch.Tensor | None = None) -> None:
        """Adds a batch (any equal shapes; ``weights``/``mask`` broadcastable)."""
        A.check_pairs(type(self).__name__, preds, target, weights, mask)
        # the error in the inputs' floating dtype (torchmetrics' precision; a float32
        # batch needs no float64 copies), summed in float64 by the kernel
        dtype = torch.promote_types(preds.dtype, target.dtype)
        if not dtype.is_floating_point:
            dtype = torch.float64
        self._add(self._error(preds.to(dtype), target.to(dtype)), weights, mask)


class MeanAbsolutePercentageError(_PercentageError):
    """Mean of ``|p - t| / max(|t|, 1.17e-6)`` (torchmetrics ``MeanAbsolutePercentageError``).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.MeanAbsolutePercentageError()
        >>> m.update(torch.tensor([0.9, 15, 1.2e6]), torch.tensor([1, 10, 1e6]))
        >>> round(m.compute().item(), 4)
        0.2667
    """

    @staticmethod
    def _error(p, t):
        return (p - t).abs_().div_(t.abs().clamp_(min=EPSILON))


class SymmetricMeanAbsolutePercentageError(_PercentageError):
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
    def _error(p, t):
        return (p - t).abs_().mul_(2.0).div_((t.abs() + p.abs()).clamp_(min=EPSILON))
