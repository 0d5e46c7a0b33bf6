"""Regression formulas from one-pass weighted moments about pivots.

``m``: float64 ``[..., 9]`` slots (leading dims: outputs) as ``d9d_kernels.reference.MOMENTS`` with
``x = preds``, ``y = target``: ``w, sx, sxx, sy, syy, sxy, sae, sse, n``;
sums of ``x - px`` and ``y - py`` about the pivots ``px, py``. Centred sums
``Sxx = sxx - sx²/w`` are then exact for data like ``1e6 + noise`` (the
pivot is a data point, so the shifted values are small).

Degenerate inputs (never NaN, never a crash): no samples (``Σw == 0``) gives
0.0 for every metric. Zero target variance: R² and explained variance follow
scikit-learn's ``force_finite=True`` (1.0 for a perfect fit, else 0.0);
Pearson with a zero variance is 0.0.
"""

from __future__ import annotations

import torch

from d9d_kernels.metrics.formulas.classification import safe_div

W, SX, SXX, SY, SYY, SXY, SAE, SSE, N = range(9)


def _centred(m: torch.Tensor):
    w = m[..., W]
    sxx = m[..., SXX] - safe_div(m[..., SX] * m[..., SX], w)
    syy = m[..., SYY] - safe_div(m[..., SY] * m[..., SY], w)
    sxy = m[..., SXY] - safe_div(m[..., SX] * m[..., SY], w)
    # rounding can leave a tiny negative variance: clamp
    return w, torch.clamp(sxx, min=0.0), torch.clamp(syy, min=0.0), sxy


def mean_squared_error(m: torch.Tensor, squared: bool = True) -> torch.Tensor:
    mse = safe_div(m[..., SSE], m[..., W])
    return mse if squared else torch.sqrt(mse)


def mean_absolute_error(m: torch.Tensor) -> torch.Tensor:
    return safe_div(m[..., SAE], m[..., W])


def _force_finite(num: torch.Tensor, den: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``1 - num/den`` with scikit-learn's force_finite rule; 0.0 when w == 0."""
    val = 1.0 - safe_div(num, den)
    one = torch.ones_like(val)
    zero = torch.zeros_like(val)
    degenerate = torch.where(num == 0, one, zero)
    out = torch.where(den != 0, val, degenerate)
    return torch.where(w != 0, out, zero)


def r2_score(m: torch.Tensor) -> torch.Tensor:
    """``1 - Σw(y - x)² / Σw(y - ȳ)²`` (scikit-learn ``r2_score`` with sample_weight)."""
    w, _, syy, _ = _centred(m)
    return _force_finite(m[..., SSE], syy, w)


def explained_variance(m: torch.Tensor, pivots: torch.Tensor | None = None) -> torch.Tensor:
    """``1 - Var_w(y - x) / Var_w(y)`` (scikit-learn ``explained_variance_score``).

    ``Var_w(y - x)`` from the centred sums ``Syy + Sxx - 2 Sxy`` (about the
    pivots, so exact for one sample and for large offsets); ``pivots`` is
    accepted for API symmetry and not needed.
    """
    w, sxx, syy, sxy = _centred(m)
    num = torch.clamp(syy + sxx - 2.0 * sxy, min=0.0)
    return _force_finite(num, syy, w)


def r2_adjust(r2: torch.Tensor, m: torch.Tensor, adjusted: int) -> torch.Tensor:
    """torchmetrics' adjusted R² ``1 - (1 - r2)(n - 1)/(n - adjusted - 1)``
    with ``n`` the element count; ``r2`` itself where ``n <= adjusted + 1``
    (torchmetrics falls back there too, with a warning)."""
    if adjusted == 0:
        return r2
    n = m[..., N]
    adj = 1.0 - (1.0 - r2) * safe_div(n - 1.0, n - adjusted - 1.0)
    return torch.where(n > adjusted + 1, adj, r2)


def average_outputs(scores: torch.Tensor, m: torch.Tensor, multioutput: str) -> torch.Tensor:
    """Per-output ``scores`` [M] reduced as torchmetrics' / scikit-learn's
    ``multioutput``: ``"raw_values"`` (as is), ``"uniform_average"`` (mean),
    ``"variance_weighted"`` (weighted by each target variance; scikit-learn's
    rule where every target variance is 0: 1.0 if every score is 1.0, else 0.0)."""
    if multioutput == "raw_values":
        return scores
    if multioutput == "uniform_average":
        return scores.mean(-1)
    _, _, syy, _ = _centred(m)
    total = syy.sum(-1)
    weighted = safe_div((syy * scores).sum(-1), total)
    return torch.where(total > 0, weighted, (scores == 1.0).all(-1).to(scores.dtype))


def pearson_corrcoef(m: torch.Tensor) -> torch.Tensor:
    """Weighted Pearson ``Sxy / sqrt(Sxx Syy)``; 0.0 if a variance is 0."""
    w, sxx, syy, sxy = _centred(m)
    r = safe_div(sxy, torch.sqrt(sxx * syy))
    return torch.clamp(r, -1.0, 1.0)
