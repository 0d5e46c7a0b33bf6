"""Regression formulas over a moments statistic's named state.

``m``: ``d9d_kernels.metrics.moments.Moments`` (``weight``, ``ss_x``,
``ss_y``, ``sp_xy``, ``sse``, ``sae``, ``count``; leading dims: outputs)
with ``x = preds``, ``y = target``. The statistic keeps its sums about
pivots near the data, so the central sums are exact for data like
``1e6 + noise``; formulas never see the pivots.

Degenerate inputs (never NaN, never a crash): no samples (``Σw == 0``) gives
0.0 for every metric. Zero target variance: R² and explained variance follow
scikit-learn's ``force_finite=True`` (1.0 for a perfect fit, else 0.0);
Pearson with a zero variance is 0.0.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from d9d_kernels.metrics.formulas.classification import safe_div


def mean_squared_error(m: Mapping, squared: bool = True) -> torch.Tensor:
    mse = safe_div(m["sse"], m["weight"])
    return mse if squared else torch.sqrt(mse)


def mean_absolute_error(m: Mapping) -> torch.Tensor:
    return safe_div(m["sae"], m["weight"])


def _force_finite(num: torch.Tensor, den: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``1 - num/den`` with scikit-learn's force_finite rule; 0.0 when w == 0."""
    val = 1.0 - safe_div(num, den)
    one = torch.ones_like(val)
    zero = torch.zeros_like(val)
    degenerate = torch.where(num == 0, one, zero)
    out = torch.where(den != 0, val, degenerate)
    return torch.where(w != 0, out, zero)


def r2_score(m: Mapping) -> torch.Tensor:
    """``1 - Σw(y - x)² / Σw(y - ȳ)²`` (scikit-learn ``r2_score`` with sample_weight)."""
    return _force_finite(m["sse"], m["ss_y"], m["weight"])


def explained_variance(m: Mapping) -> torch.Tensor:
    """``1 - Var_w(y - x) / Var_w(y)`` (scikit-learn ``explained_variance_score``),
    ``Var_w(y - x)`` from the central sums ``ss_y + ss_x - 2 sp_xy``."""
    num = torch.clamp(m["ss_y"] + m["ss_x"] - 2.0 * m["sp_xy"], min=0.0)
    return _force_finite(num, m["ss_y"], m["weight"])


def r2_adjust(r2: torch.Tensor, m: Mapping, adjusted: int) -> torch.Tensor:
    """torchmetrics' adjusted R² ``1 - (1 - r2)(n - 1)/(n - adjusted - 1)``
    with ``n`` the element count; ``r2`` itself where ``n <= adjusted + 1``
    (torchmetrics falls back there too, with a warning)."""
    if adjusted == 0:
        return r2
    n = m["count"]
    adj = 1.0 - (1.0 - r2) * safe_div(n - 1.0, n - adjusted - 1.0)
    return torch.where(n > adjusted + 1, adj, r2)


def average_outputs(scores: torch.Tensor, m: Mapping, multioutput: str) -> torch.Tensor:
    """Per-output ``scores`` [M] reduced as torchmetrics' / scikit-learn's
    ``multioutput``: ``"raw_values"`` (as is), ``"uniform_average"`` (mean),
    ``"variance_weighted"`` (weighted by each target variance; scikit-learn's
    rule where every target variance is 0: 1.0 if every score is 1.0, else 0.0)."""
    if multioutput == "raw_values":
        return scores
    if multioutput == "uniform_average":
        return scores.mean(-1)
    syy = m["ss_y"]
    total = syy.sum(-1)
    weighted = safe_div((syy * scores).sum(-1), total)
    return torch.where(total > 0, weighted, (scores == 1.0).all(-1).to(scores.dtype))


def pearson_corrcoef(m: Mapping) -> torch.Tensor:
    """Weighted Pearson ``sp_xy / sqrt(ss_x ss_y)``; 0.0 if a variance is 0."""
    r = safe_div(m["sp_xy"], torch.sqrt(m["ss_x"] * m["ss_y"]))
    return torch.clamp(r, -1.0, 1.0)
