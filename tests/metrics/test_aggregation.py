"""Aggregation metrics vs plain numpy/fsum on the same data."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import d9d_kernels as dk


def _data(n=37):
    x = torch.randn(n, dtype=torch.float32) * 3 + 1
    w = torch.rand(n, dtype=torch.float32) + 0.1
    mask = torch.rand(n) > 0.3
    return x, w, mask


@pytest.mark.parametrize("shape", [(37,), (5, 7), ()])
def test_values_weights_mask_match_numpy(shape):
    x = torch.randn(shape) * 2
    w = torch.rand(shape) + 0.5
    mask = torch.rand(shape) > 0.4
    xs, ws, ms = x.double().numpy().ravel(), w.double().numpy().ravel(), mask.numpy().ravel()
    s, m, mx, mn = dk.SumMetric(), dk.WeightedMeanMetric(), dk.MaxMetric(), dk.MinMetric()
    s.update(x, weights=w, mask=mask)
    m.update(x, weights=w, mask=mask)
    mx.update(x, weights=w, mask=mask)
    mn.update(x, mask=mask)
    s.update(2.5)  # python float, weight 1
    m.update(2.5, weights=3.0)
    exp_sum = math.fsum((xs * ws)[ms]) + 2.5
    exp_mean = (math.fsum((xs * ws)[ms]) + 7.5) / (math.fsum(ws[ms]) + 3.0)
    assert s.compute().item() == pytest.approx(exp_sum, rel=1e-12, abs=1e-12)
    assert m.compute().item() == pytest.approx(exp_mean, rel=1e-12)
    if ms.any():
        assert mx.compute().item() == xs[ms].max()
        assert mn.compute().item() == xs[ms].min()
    else:
        assert mx.compute().item() == -math.inf and mn.compute().item() == math.inf


def test_defaults_and_empty():
    assert dk.SumMetric().compute().item() == 0.0
    assert math.isnan(dk.WeightedMeanMetric().compute().item())
    assert dk.MaxMetric().compute().item() == -math.inf
    assert dk.MinMetric().compute().item() == math.inf
    m = dk.WeightedMeanMetric()
    m.update(torch.tensor([1.0, 2.0]), weights=torch.zeros(2))  # Σw == 0 -> NaN
    assert math.isnan(m.compute().item())
    mx = dk.MaxMetric()
    mx.update(torch.tensor([1.0, 9.0]), weights=torch.tensor([100.0, 0.0]))  # weights ignored
    assert mx.compute().item() == 9.0


def test_count_past_2_pow_24_is_exact():
    s, c = dk.SumMetric(), dk.WeightedMeanMetric()
    ones = torch.ones(2**22, dtype=torch.float32)
    for _ in range(4):
        s.update(ones)
    s.update(1.0)
    assert s.compute().item() == 2**24 + 1  # float32 accumulation would give 2**24
    assert float(np.float32(2**24) + np.float32(1)) == 2**24  # why float64 state matters
    c.update(ones * 3.0)
    assert c.compute().item() == 3.0


def test_pivot_keeps_large_offset_exact():
    base = 1e8
    noise = torch.randn(1000, dtype=torch.float64)
    m, s = dk.WeightedMeanMetric(), dk.SumMetric()
    for chunk in (base + noise).split(100):
        m.update(chunk)
        s.update(chunk)
    exact = math.fsum((base + noise).tolist())
    assert s.compute().item() == pytest.approx(exact, rel=1e-15)
    assert m.compute().item() == pytest.approx(exact / 1000, rel=1e-15)


def test_nan_strategies():
    x = torch.tensor([1.0, float("nan"), 3.0, float("inf")])
    p, i, e = (dk.WeightedMeanMetric(nan_strategy="disable"), dk.WeightedMeanMetric(nan_strategy="ignore"),
               dk.SumMetric(nan_strategy="error"))
    for m in (p, i, e):
        m.update(x)
    assert math.isnan(p.compute().item())
    assert i.compute().item() == 2.0
    with pytest.raises(ValueError, match=r"SumMetric.*\b2\b"):
        e.compute()
    mx = dk.MaxMetric(nan_strategy="ignore")
    mx.update(x)
    assert mx.compute().item() == math.inf  # Inf is a valid max under "ignore"
    mn = dk.MinMetric(nan_strategy="error")
    mn.update(x, mask=torch.tensor([True, False, True, False]))  # masked NaN/Inf are not counted
    assert mn.compute().item() == 1.0
    with pytest.raises(ValueError, match="SumMetric: argument 'nan_strategy'"):
        dk.SumMetric(nan_strategy="drop")


def test_metadata_errors_raise_immediately_and_leave_state():
    m = dk.WeightedMeanMetric()
    m.update(torch.tensor([1.0, 3.0]))
    before = m.state_dict()["rank_0"]["sum"].clone()
    with pytest.raises(ValueError, match="WeightedMeanMetric.*'weights'"):
        m.update(torch.ones(3), weights=torch.ones(4))
    with pytest.raises(ValueError, match="WeightedMeanMetric.*'values'.*meta"):
        m.update(torch.ones(3, device="meta"))
    with pytest.raises(TypeError, match="'mask'"):
        m.update(torch.ones(3), mask=torch.ones(3))
    with pytest.raises(ValueError, match="'mask'"):
        m.update(torch.ones(3), mask=torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="'values'"):
        m.update("3")
    with pytest.raises(TypeError, match="'values'"):
        m.update(torch.ones(2, dtype=torch.complex64))
    assert torch.equal(m.state_dict()["rank_0"]["sum"], before)
    assert m.compute().item() == 2.0


def test_weighted_mean_zero_weight_sum_is_nan_and_forward_matches_numpy():
    m = dk.WeightedMeanMetric()
    x = np.array([1.0, 2.0, 5.0])
    w = np.array([1.0, -1.0, 0.0])
    assert np.isnan(m(torch.from_numpy(x), weights=torch.from_numpy(w)).item())  # batch: Σw = 0
    assert np.isnan(m.compute().item())
    x2, w2 = np.array([3.0, 4.0]), np.array([0.5, 1.5])
    assert m(torch.from_numpy(x2), weights=torch.from_numpy(w2)).item() == pytest.approx(np.average(x2, weights=w2), rel=1e-15)
    xs, ws = np.concatenate([x, x2]), np.concatenate([w, w2])
    assert m.compute().item() == pytest.approx((xs * ws).sum() / ws.sum(), rel=1e-15)


def test_mean_metric_is_the_weighted_mean_with_torchmetrics_names():
    rng = np.random.default_rng(3)
    x, w = rng.normal(size=7), rng.random(7)
    m = dk.MeanMetric()
    m.update(torch.from_numpy(x), weight=torch.from_numpy(w))
    m.update(value=2.0)
    ref = (np.sum(x * w) + 2.0) / (np.sum(w) + 1.0)
    assert m.compute().item() == pytest.approx(ref, rel=1e-14)
    with pytest.raises(ValueError, match=r"MeanMetric\.update: argument 'weight' of shape \(4,\) does not broadcast to value \(3,\)"):
        m.update(torch.zeros(3), weight=torch.ones(4))


def test_integer_token_counts_are_exact_and_take_the_planned_update():
    """An int64 0-d token count ((labels != -100).sum()) as the value of a SumMetric or
    the weight of a loss mean: exact past 2^24 (float32 would round), on the checked
    first call and on the planned calls after it."""
    big = 2**24 + 1
    s, loss = dk.SumMetric(), dk.WeightedMeanMetric()
    ref_n, ref_num = 0, 0.0
    rng = np.random.default_rng(4)
    for step in range(4):
        n = torch.tensor(big + step)  # int64, 0-d
        v = torch.tensor(rng.normal(), dtype=torch.float32)
        s.update(n)
        loss.update(values=v, weights=n)
        ref_n += big + step
        ref_num += float(v) * (big + step)
    assert s.compute().item() == ref_n  # exact integer
    assert loss.compute().item() == pytest.approx(ref_num / ref_n, rel=1e-15)
    s.update(torch.tensor(3))  # the planned update of the same signature
    assert s.compute().item() == ref_n + 3
