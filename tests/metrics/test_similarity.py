"""KLDivergence, CosineSimilarity, MeanAbsolutePercentageError,
SymmetricMeanAbsolutePercentageError and RunningMean vs torchmetrics 1.9
(and scikit-learn / numpy where they define the same quantity), over several
updates, adversarial values (zeros in p, targets near 0, 1e6 offsets);
bad input names metric and argument, state intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchmetrics
from sklearn.metrics import mean_absolute_percentage_error as sk_mape

import d9d_kernels as dk
from tests.metrics._catalogue_utils import quiet


def _probs(rng, n, d, zeros=False):
    x = rng.random((n, d)) + 0.01
    if zeros:
        x[rng.random((n, d)) < 0.3] = 0.0
        x[:, 0] += 0.1  # no all-zero row
    return x


@pytest.mark.parametrize("log_prob", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("zeros", [False, True])
def test_kl_divergence(log_prob, reduction, zeros):
    if log_prob and zeros:
        pytest.skip("log-probabilities hold no exact zeros")
    rng = np.random.default_rng(1)
    m = dk.KLDivergence(log_prob=log_prob, reduction=reduction)
    ref = torchmetrics.KLDivergence(log_prob=log_prob, reduction=reduction)
    rows = []
    for n in (5, 1, 9):
        p, q = _probs(rng, n, 6, zeros), _probs(rng, n, 6)
        if log_prob:
            p, q = np.log(p / p.sum(1, keepdims=True)), np.log(q / q.sum(1, keepdims=True))
        P, Q = torch.tensor(p), torch.tensor(q)
        m.update(P, Q)
        ref.update(P, Q)
        pn = np.exp(p) if log_prob else p / p.sum(1, keepdims=True)
        qn = np.exp(q) if log_prob else q / q.sum(1, keepdims=True)
        rows.append(np.where(pn > 0, pn * np.log(np.where(pn > 0, pn, 1) / qn), 0).sum(1))
    rows = np.concatenate(rows)
    exp = rows.mean() if reduction == "mean" else rows.sum()
    np.testing.assert_allclose(m.compute().item(), exp, rtol=1e-12)
    np.testing.assert_allclose(m.compute().item(), ref.compute().item(), rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_cosine_similarity(reduction):
    rng = np.random.default_rng(2)
    m, ref = dk.CosineSimilarity(reduction=reduction), torchmetrics.CosineSimilarity(reduction=reduction)
    rows = []
    for n in (4, 1, 7):
        p, t = rng.normal(size=(n, 5)), rng.normal(size=(n, 5))
        p[0] = -t[0] * 3.0  # exactly opposite
        m.update(torch.tensor(p), torch.tensor(t))
        ref.update(torch.tensor(p), torch.tensor(t))
        rows.append((p * t).sum(1) / np.linalg.norm(p, axis=1) / np.linalg.norm(t, axis=1))
    rows = np.concatenate(rows)
    np.testing.assert_allclose(m.compute().item(), rows.mean() if reduction == "mean" else rows.sum(), rtol=1e-12)
    np.testing.assert_allclose(m.compute().item(), ref.compute().item(), rtol=1e-5)


@pytest.mark.parametrize("cls", ["MeanAbsolutePercentageError", "SymmetricMeanAbsolutePercentageError"])
def test_percentage_errors(cls):
    rng = np.random.default_rng(3)
    m, ref = getattr(dk, cls)(), getattr(torchmetrics, cls)()
    errs = []
    for shape in ((7,), (2, 3), (1,)):
        t = rng.normal(0, 5, size=shape)
        t.flat[0] = 0.0  # epsilon clamp (and for SMAPE with p == 0: 0 / eps)
        p = t + rng.normal(0, 1, size=shape)
        if cls.startswith("Symmetric"):
            p.flat[0] = 0.0
        m.update(torch.tensor(p), torch.tensor(t))
        ref.update(torch.tensor(p), torch.tensor(t))
        den = np.abs(t) + (np.abs(p) if cls.startswith("Symmetric") else 0)
        errs.append(((2 if cls.startswith("Symmetric") else 1) * np.abs(p - t) / np.maximum(den, 1.17e-6)).ravel())
    np.testing.assert_allclose(m.compute().item(), np.concatenate(errs).mean(), rtol=1e-12)
    # torchmetrics keeps a float32 sum state
    np.testing.assert_allclose(m.compute().item(), ref.compute().item(), rtol=1e-6)


def test_mape_vs_sklearn_with_weights_and_mask():
    rng = np.random.default_rng(4)
    t = 1e6 + rng.normal(0, 100, 50)  # large offset: sums about a pivot stay exact
    p = t + rng.normal(0, 10, 50)
    w = rng.random(50)
    keep = rng.random(50) < 0.7
    m = dk.MeanAbsolutePercentageError()
    m.update(torch.tensor(p[:20]), torch.tensor(t[:20]), weights=torch.tensor(w[:20]), mask=torch.tensor(keep[:20]))
    m.update(torch.tensor(p[20:]), torch.tensor(t[20:]), weights=torch.tensor(w[20:]), mask=torch.tensor(keep[20:]))
    exp = sk_mape(t[keep], p[keep], sample_weight=w[keep])
    np.testing.assert_allclose(m.compute().item(), exp, rtol=1e-9)


def test_running_mean_matches_torchmetrics_each_step():
    rng = np.random.default_rng(5)
    for window in (1, 3, 7):
        m, ref = dk.RunningMean(window=window), torchmetrics.aggregation.RunningMean(window=window)
        hist = []
        for step in range(12):
            v = torch.tensor(rng.normal(size=int(rng.integers(1, 5))))
            w = torch.tensor(rng.random(v.shape) + 0.1)
            m.update(v, w)
            ref.update(v, w)
            hist.append(((v * w).sum().item(), w.sum().item()))
            last = np.array(hist[-window:])
            np.testing.assert_allclose(m.compute().item(), last[:, 0].sum() / last[:, 1].sum(), rtol=1e-12)
            # torchmetrics keeps float32 states
            np.testing.assert_allclose(m.compute().item(), ref.compute().item(), rtol=1e-6, err_msg=f"{window} {step}")
        m.reset()
        ref.reset()
        m.update(2.0)
        ref.update(2.0)
        assert m.compute().item() == ref.compute().item() == 2.0


def test_running_mean_forward_in_a_group_matches_torchmetrics():
    """A group's forward runs RunningMean's update on the state (its ring slot
    depends on it) while the other members go through the scratch: batch
    values and the window mean both equal torchmetrics' at every step."""
    rng = np.random.default_rng(6)
    g = dk.MetricGroup({"rm": dk.RunningMean(window=3), "mean": dk.MeanMetric(), "rm2": dk.RunningMean(window=2)})
    refs = {"rm": torchmetrics.aggregation.RunningMean(window=3), "mean": torchmetrics.MeanMetric(),
            "rm2": torchmetrics.aggregation.RunningMean(window=2)}
    for step in range(8):
        v = torch.tensor(rng.normal(size=int(rng.integers(1, 5))))
        got = g(value=v)
        for k, ref in refs.items():
            np.testing.assert_allclose(got[k].item(), ref(v).item(), rtol=1e-6, err_msg=f"batch {k} {step}")
        for k, val in g.compute().items():
            np.testing.assert_allclose(val.item(), refs[k].compute().item(), rtol=1e-6, err_msg=f"{k} {step}")
    with pytest.raises(ValueError, match="weight"):  # a failing member check writes nothing
        g(value=torch.ones(3), weight=torch.ones(2))
    np.testing.assert_allclose(g.compute()["rm"].item(), refs["rm"].compute().item(), rtol=1e-6)


def test_running_mean_nan_strategies():
    v = torch.tensor([1.0, float("nan"), 3.0])
    warn = dk.RunningMean(window=2)  # torchmetrics' default "warn": NaN left out
    warn.update(v)
    assert warn.compute().item() == quiet(torchmetrics.aggregation.RunningMean(window=2), v).item() == 2.0
    assert torch.isnan(_fed(dk.RunningMean(window=2, nan_strategy="disable"), v).compute())
    err = _fed(dk.RunningMean(window=2, nan_strategy="error"), v)
    with pytest.raises(ValueError, match="1 invalid"):
        err.compute()
    imputed = _fed(dk.RunningMean(window=2, nan_strategy=0.0), v).compute()  # a float imputes NaN, as torchmetrics
    assert imputed.item() == pytest.approx(quiet(torchmetrics.aggregation.RunningMean(window=2, nan_strategy=0.0), v).item())
    with pytest.raises(ValueError, match=r"RunningMean.*'nan_strategy'"):
        dk.RunningMean(nan_strategy="sometimes")


def _fed(m, v):
    m.update(v)
    return m


def test_bad_input_names_metric_and_argument_state_intact():
    cases = [
        (dk.KLDivergence(), (torch.rand(3, 4), torch.rand(3, 4)), [((torch.rand(3, 4), torch.rand(3, 5)), "'q'"),
                                                                   ((torch.rand(3), torch.rand(3)), "'p'")]),
        (dk.CosineSimilarity(), (torch.rand(3, 4), torch.rand(3, 4)), [((torch.rand(3, 4), torch.rand(2, 4)), "'target'")]),
        (dk.MeanAbsolutePercentageError(), (torch.rand(5), torch.rand(5)), [((torch.rand(5), torch.rand(4)), "'target'")]),
        (dk.SymmetricMeanAbsolutePercentageError(), (torch.rand(5), torch.rand(5)), [((torch.rand(5), "x"), "'target'")]),
        (dk.RunningMean(), (torch.rand(5),), [((torch.rand(5), torch.rand(3)), "'weight'"), (("x",), "'value'")]),
    ]
    for metric, good, bads in cases:
        metric.update(*good)
        before = metric.compute().clone()
        for args, arg in bads:
            with pytest.raises((ValueError, TypeError), match=rf"{type(metric).__name__}.*{arg}"):
                metric.update(*args)
        torch.testing.assert_close(metric.compute(), before)
    for cls in (dk.KLDivergence, dk.CosineSimilarity):
        with pytest.raises(ValueError, match=rf"{cls.__name__}.*'reduction'"):
            cls(reduction="none")
