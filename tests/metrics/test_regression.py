"""Regression metrics against scikit-learn / numpy float64, with sample
weights, masks, degenerate inputs and large offsets (1e6 + noise)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn import metrics as skm

import d9d_kernels as dk
from tests.metrics._catalogue_utils import _one_thread, close  # noqa: F401

NAMES = ["MeanSquaredError", "RMSE", "MeanAbsoluteError", "R2Score", "PearsonCorrCoef", "ExplainedVariance"]


def make(name, **kw):
    if name == "RMSE":
        return dk.MeanSquaredError(squared=False, **kw)
    return getattr(dk, name)(**kw)


def weighted_pearson(x, y, w):
    if np.ptp(x) == 0 or np.ptp(y) == 0:
        return 0.0  # zero variance (numpy's weighted mean may leave rounding noise instead)
    mx, my = np.average(x, weights=w), np.average(y, weights=w)
    cov = np.sum(w * (x - mx) * (y - my))
    den = np.sqrt(np.sum(w * (x - mx) ** 2) * np.sum(w * (y - my) ** 2))
    return cov / den if den > 0 else 0.0


def reference(name, x, y, w):
    """scikit-learn (weighted) on the kept elements; documented conventions
    where sklearn is undefined (no samples -> 0; < 2 samples -> force_finite rule)."""
    if len(x) == 0 or w.sum() == 0:
        return 0.0
    if name == "MeanSquaredError":
        return skm.mean_squared_error(y, x, sample_weight=w)
    if name == "RMSE":
        return skm.root_mean_squared_error(y, x, sample_weight=w)
    if name == "MeanAbsoluteError":
        return skm.mean_absolute_error(y, x, sample_weight=w)
    if name == "PearsonCorrCoef":
        return weighted_pearson(x, y, w)
    if np.ptp(y) == 0 and name in ("R2Score", "ExplainedVariance"):
        # constant target: sklearn's weighted mean can leave a ~1e-31 variance and return -1e28;
        # the pivoted moments see exactly 0 -> force_finite rule
        resid = y - x
        num = np.sum((resid - np.average(resid, weights=w)) ** 2) if name == "ExplainedVariance" else np.sum(resid**2)
        return 1.0 if num == 0 or (name == "ExplainedVariance" and np.ptp(resid) == 0) else 0.0
    if len(x) < 2:  # sklearn returns NaN for one sample; we apply force_finite (zero variance)
        # R2: residual sum 0 only for a perfect fit; EV: the residual's variance is always 0
        return 1.0 if (x[0] == y[0] or name == "ExplainedVariance") else 0.0
    if name == "R2Score":
        return skm.r2_score(y, x, sample_weight=w)
    return skm.explained_variance_score(y, x, sample_weight=w)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 60),
    weighted=st.booleans(),
    masked=st.booleans(),
    const_target=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    offset=st.sampled_from([0.0, 1e3]),
    chunks=st.integers(1, 3),
)
def test_against_sklearn(seed, n, weighted, masked, const_target, dtype, offset, chunks):
    rng = np.random.default_rng(seed)
    y = offset + (np.full(n, 2.5) if const_target else rng.normal(0, 2, n))
    x = y + rng.normal(0, 1, n) * rng.random()
    if const_target and rng.random() < 0.3:
        x = y.copy()  # perfect fit on constant target -> R2 = 1 (force_finite)
    xt, yt = torch.from_numpy(x).to(dtype), torch.from_numpy(y).to(dtype)
    w = rng.random(n) + 0.1 if weighted else np.ones(n)
    keep = rng.random(n) < 0.7 if masked else np.ones(n, dtype=bool)
    xr, yr = xt.double().numpy()[keep], yt.double().numpy()[keep]
    wr = torch.from_numpy(w).to(dtype).double().numpy()[keep]
    for name in NAMES:
        m = make(name)
        for idx in np.array_split(np.arange(n), chunks):
            idx = torch.from_numpy(idx)
            m.update(xt[idx], yt[idx], weights=torch.from_numpy(w).to(dtype)[idx] if weighted else None,
                     mask=torch.from_numpy(keep)[idx] if masked else None)
        exp = reference(name, xr, yr, wr)
        np.testing.assert_allclose(m.compute().item(), exp, rtol=1e-9, atol=1e-9, err_msg=name)


def test_large_offset_pearson_r2_match_numpy_float64():
    """1e6 + small noise: one-pass moments about a pivot keep 1e-6 relative accuracy."""
    rng = np.random.default_rng(0)
    n = 100_000
    y = 1e6 + rng.normal(0, 1e-2, n)
    x = y + rng.normal(0, 5e-3, n)
    pc, r2, ev = dk.PearsonCorrCoef(), dk.R2Score(), dk.ExplainedVariance()
    g = dk.MetricGroup({"pc": pc, "r2": r2, "ev": ev})
    for idx in np.array_split(np.arange(n), 5):
        g.update(preds=torch.from_numpy(x[idx]), target=torch.from_numpy(y[idx]))
    out = g.compute()
    r_np = np.corrcoef(x, y)[0, 1]
    r2_np = 1 - np.sum((y - x) ** 2) / np.sum((y - y.mean()) ** 2)
    ev_np = 1 - np.var(y - x) / np.var(y)
    np.testing.assert_allclose(out["pc"].item(), r_np, rtol=1e-6)
    np.testing.assert_allclose(out["r2"].item(), r2_np, rtol=1e-6)
    np.testing.assert_allclose(out["ev"].item(), ev_np, rtol=1e-6)
    # and weighted, against sklearn
    w = rng.random(n)
    r2w = dk.R2Score()
    r2w.update(torch.from_numpy(x), torch.from_numpy(y), weights=torch.from_numpy(w))
    np.testing.assert_allclose(r2w.compute().item(), skm.r2_score(y, x, sample_weight=w), rtol=1e-6)


def test_degenerate_inputs_are_defined():
    for name in NAMES:
        assert make(name).compute().item() == 0.0, name  # nothing seen
    r2 = dk.R2Score()
    r2.update(torch.full((5,), 3.0), torch.full((5,), 3.0))
    assert r2.compute().item() == 1.0  # zero variance, perfect
    pc = dk.PearsonCorrCoef()
    pc.update(torch.arange(5.0), torch.full((5,), 3.0))
    assert pc.compute().item() == 0.0  # zero target variance
    m = dk.MeanSquaredError()
    m.update(torch.ones(3), torch.zeros(3), mask=torch.zeros(3, dtype=torch.bool))
    assert m.compute().item() == 0.0  # everything masked


def test_nan_strategy():
    x = torch.tensor([1.0, float("nan"), 3.0])
    y = torch.tensor([1.0, 2.0, 2.0])
    p = dk.MeanAbsoluteError()
    p.update(x, y)
    assert torch.isnan(p.compute())  # propagate (default, as torchmetrics)
    i = dk.MeanAbsoluteError(nan_strategy="ignore")
    i.update(x, y)
    assert i.compute().item() == 0.5
    e = dk.MeanAbsoluteError(nan_strategy="error")
    e.update(x, y)
    with pytest.raises(ValueError, match="1 invalid"):
        e.compute()


def test_metadata_errors():
    m = dk.R2Score()
    with pytest.raises(ValueError, match="R2Score: argument 'target'"):
        m.update(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match="R2Score: argument 'weights'"):
        m.update(torch.zeros(3), torch.zeros(3), weights=torch.ones(2))
    with pytest.raises(TypeError, match="R2Score: argument 'mask'"):
        m.update(torch.zeros(3), torch.zeros(3), mask=torch.ones(3))
    with pytest.raises(TypeError, match="MeanSquaredError: argument 'squared'"):
        dk.MeanSquaredError(squared="no")
