"""ExponentialMovingAverage against a plain-Python reference (the bias-corrected
EMA recursion, and the decayed weighted-sum formula), its forward, groups,
bad input, state round trips and a 2-rank gloo sync (EMA of the global
per-step sums)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import d9d_kernels as dk
from tests.dist_utils import run_distributed


def _steps(seed: int, n: int = 12, weighted: bool = True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        k = int(torch.randint(1, 6, (1,), generator=g))
        v = torch.randn(k, generator=g, dtype=torch.float64) * 3
        w = torch.rand(k, generator=g, dtype=torch.float64) + 0.1 if weighted else torch.ones(k, dtype=torch.float64)
        out.append((v, w))
    return out


def _reference(steps, decay: float) -> float:
    """Σ_t decay^(T-t) Σ w_t v_t / Σ_t decay^(T-t) Σ w_t, in numpy float64."""
    T = len(steps)
    num = sum(decay ** (T - 1 - t) * float(np.dot(v.numpy(), w.numpy())) for t, (v, w) in enumerate(steps))
    den = sum(decay ** (T - 1 - t) * float(w.numpy().sum()) for t, (_, w) in enumerate(steps))
    return num / den


@pytest.mark.parametrize("decay", [0.0, 0.5, 0.9, 0.999])
def test_unit_weights_equal_the_bias_corrected_ema_recursion(decay):
    g = torch.Generator().manual_seed(int(decay * 1000))
    xs = (torch.randn(30, generator=g, dtype=torch.float64) * 5).tolist()
    m = dk.ExponentialMovingAverage(decay=decay)
    ema = 0.0
    for t, x in enumerate(xs, 1):
        m.update(x)
        ema = decay * ema + (1 - decay) * x
        assert m.compute().item() == pytest.approx(ema / (1 - decay ** t), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_weighted_updates_and_forward(seed):
    steps = _steps(seed)
    upd, fwd = dk.ExponentialMovingAverage(decay=0.8), dk.ExponentialMovingAverage(decay=0.8)
    for t, (v, w) in enumerate(steps, 1):
        upd.update(v, w)
        batch = fwd(v, w)
        assert batch.item() == pytest.approx(float(np.average(v.numpy(), weights=w.numpy())), rel=1e-12)
        assert upd.compute().item() == pytest.approx(_reference(steps[:t], 0.8), rel=1e-12)
        torch.testing.assert_close(fwd.compute(), upd.compute(), rtol=0, atol=0)


def test_in_a_group_and_state_round_trip():
    steps = _steps(7)
    g = dk.MetricGroup({"ema": dk.ExponentialMovingAverage(decay=0.7), "mean": dk.WeightedMeanMetric()})
    for v, w in steps:
        g["ema"](v, w)  # a member's forward writes the group's buffers
        g["mean"].update(v, w)
    assert g.compute()["ema"].item() == pytest.approx(_reference(steps, 0.7), rel=1e-12)
    other = dk.MetricGroup({"ema": dk.ExponentialMovingAverage(decay=0.7), "mean": dk.WeightedMeanMetric()})
    other.load_state_dict(g.state_dict())
    torch.testing.assert_close(other.compute()["ema"], g.compute()["ema"], rtol=0, atol=0)
    g.reset()
    assert math.isnan(g["ema"].compute().item())  # nothing seen: 0 / 0


def test_nan_strategies():
    m = dk.ExponentialMovingAverage(decay=0.5)  # "warn": NaN values left out
    m.update(torch.tensor([1.0, float("nan"), 3.0]))
    assert m.compute().item() == pytest.approx(2.0)
    e = dk.ExponentialMovingAverage(decay=0.5, nan_strategy="error")
    e.update(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="ExponentialMovingAverage"):
        e.compute()
    p = dk.ExponentialMovingAverage(decay=0.5, nan_strategy="disable")
    p.update(torch.tensor([float("nan")]))
    assert math.isnan(p.compute().item())


@pytest.mark.parametrize("decay", [1.0, -0.1, True, "0.9", float("nan")])
def test_bad_decay_names_the_argument(decay):
    with pytest.raises(ValueError, match=r"ExponentialMovingAverage.*'decay'"):
        dk.ExponentialMovingAverage(decay=decay)


def test_bad_update_leaves_the_state_intact():
    m = dk.ExponentialMovingAverage(decay=0.5)
    m.update(torch.tensor([2.0]))
    before = m.compute().clone()
    with pytest.raises(TypeError, match=r"ExponentialMovingAverage.*'value'"):
        m.update("x")
    with pytest.raises(ValueError, match=r"ExponentialMovingAverage.*'weight'"):
        m.update(torch.ones(3), torch.ones(2))
    torch.testing.assert_close(m.compute(), before, rtol=0, atol=0)


def _worker(rank, world):
    m = dk.ExponentialMovingAverage(decay=0.6)
    for v, w in _steps(20 + rank):
        m.update(v, w)
    m.trigger_sync(dk.DistributedContext())
    m.wait_sync()
    return m.compute().item()


def test_sync_is_the_ema_of_the_global_step_sums():
    out = run_distributed(_worker, 2, timeout=120.0)
    merged = [(torch.cat([a[0], b[0]]), torch.cat([a[1], b[1]])) for a, b in zip(_steps(20), _steps(21))]
    for rank in range(2):
        assert out[rank] == pytest.approx(_reference(merged, 0.6), rel=1e-12)
