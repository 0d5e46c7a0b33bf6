"""Update plans (d9d_kernels/core/plan.py): after the first checked call of an input
signature, updates skip the Python checks and call the kernels directly.
They must give bit-identical results to the checked path, still reject bad
input (a new signature runs checked), and actually be taken."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, f1_score

import d9d_kernels as dk
from d9d_kernels.core import plan
from tests.metrics._catalogue_utils import _one_thread  # noqa: F401

C = 7


def _group():
    kw = dict(task="multiclass", num_classes=C)
    return dk.MetricGroup(
        {
            "loss": dk.WeightedMeanMetric(),
            "acc": dk.Accuracy(**kw, average="micro"),
            "top3": dk.Accuracy(**kw, average="micro", top_k=3),
            "f1": dk.F1Score(**kw, average="macro"),
            "cm": dk.ConfusionMatrix(**kw),
            "peak": dk.MaxMetric(),
        }
    )


def _steps(seed: int):
    g = torch.Generator().manual_seed(seed)
    for step in range(12):
        n = (8, 8, 16)[step % 3]  # signatures repeat: plans are built and then hit
        logits = torch.randn(n, C, generator=g)
        logits[0, 1] = logits[0, 2]  # a tie: lowest index wins on both paths
        target = torch.randint(0, C, (n,), generator=g)
        mask = (torch.rand(n, generator=g) > 0.2) if step % 2 else None
        loss = torch.rand((), generator=g)
        weight = (n, float(n) / 2, torch.tensor(float(n)))[step % 3]  # int, float, tensor weights
        yield logits, target, mask, loss, weight


def _feed(grp, seed):
    for logits, target, mask, loss, weight in _steps(seed):
        grp["loss"].update(values=loss, weights=weight)
        grp["peak"].update(loss)
        if mask is None:
            grp.update(preds=logits, target=target)
        else:
            grp.update(preds=logits, target=target, mask=mask)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_planned_updates_equal_checked_updates_and_sklearn(monkeypatch, seed):
    planned = _group()
    _feed(planned, seed)
    assert planned._storage.plans, "plans were built"
    monkeypatch.setattr(plan, "MAX_PLANS", 0)  # no plan: every update runs the checked path
    checked = _group()
    _feed(checked, seed)
    assert not checked._storage.plans
    got, ref = planned.compute(), checked.compute()
    for name in ref:
        assert torch.equal(got[name], ref[name]), name

    # and against independent references on the kept rows
    p, t, losses, weights = [], [], [], []
    for logits, target, mask, loss, weight in _steps(seed):
        keep = torch.ones_like(target, dtype=torch.bool) if mask is None else mask
        p.append(logits.argmax(1)[keep])
        t.append(target[keep])
        losses.append(float(loss))
        weights.append(float(weight))
    p, t = torch.cat(p).numpy(), torch.cat(t).numpy()
    assert got["acc"].item() == pytest.approx(accuracy_score(t, p), abs=1e-12)
    assert got["f1"].item() == pytest.approx(f1_score(t, p, average="macro", labels=range(C), zero_division=0), abs=1e-12)
    assert got["loss"].item() == pytest.approx(np.average(losses, weights=weights), rel=1e-12)
    assert got["peak"].item() == max(losses)


def test_plans_skip_the_checked_wrappers(monkeypatch):
    calls = []
    for name in ("class_stats", "weighted_moments"):
        real = getattr(dk.ops, name)
        monkeypatch.setattr(dk.ops, name, lambda *a, _real=real, _n=name, **k: (calls.append(_n), _real(*a, **k)))
    g = _group()
    logits, target = torch.randn(16, C), torch.randint(0, C, (16,))
    for _ in range(3):
        g.update(preds=logits, target=target)
        g["loss"].update(values=torch.tensor(2.0), weights=16)
    assert calls == ["class_stats", "weighted_moments"], "only the first call of each signature is checked"


def test_bad_input_after_a_plan_raises_and_leaves_state(monkeypatch):
    g = _group()
    logits, target = torch.randn(16, C), torch.randint(0, C, (16,))
    g.update(preds=logits, target=target)
    g.update(preds=logits, target=target)  # planned
    before = {k: v.clone() for k, v in g._storage.local.items()}
    with pytest.raises(ValueError, match=r"Accuracy.*preds|preds.*num_classes"):
        g.update(preds=torch.randn(16, C + 1), target=target)
    with pytest.raises(ValueError, match=r"preds"):
        g.update(preds=torch.randn(15, C), target=target)
    with pytest.raises(TypeError, match=r"WeightedMeanMetric.*weights"):
        g["loss"].update(values=torch.tensor(1.0), weights="16")
    for k, v in g._storage.local.items():
        assert torch.allclose(v, before[k], rtol=0, atol=0, equal_nan=True), k  # unset pivots are NaN


def test_moving_or_grouping_drops_plans():
    m = dk.WeightedMeanMetric()
    m.update(torch.ones(4))
    m.update(torch.ones(4))
    assert m._storage.plans
    m.to("cpu")
    assert not m._storage.plans
    m.update(torch.full((4,), 3.0))
    assert m.compute().item() == pytest.approx((8 * 1.0 + 4 * 3.0) / 12)
    fresh = dk.WeightedMeanMetric()
    fresh.update(torch.ones(4))
    g = dk.MetricGroup({"m": fresh})  # a new storage: the metric's plans went with the old one
    assert not g._storage.plans
    g["m"].update(torch.full((4,), 5.0))
    assert g.compute()["m"].item() == 5.0  # members start fresh in a group


def test_inputs_the_metric_transforms_are_not_planned():
    class Doubled(dk.Metric):
        def __init__(self):
            super().__init__()
            self.add_state("total", kind="sum", shape=())

        def _update(self, values):
            self.total += 2 * values.sum()

        def _compute(self, state):
            return state["total"]

    m = Doubled()
    for v in (1.0, 2.0, 3.0):
        m.update(torch.tensor([v]))
    assert m.compute().item() == 12.0


def _number_steps():
    # repeated values (the fill is reused), changes, int/float of equal value, NaN, inf
    xs = [96, 96, 96.0, 128, 0.5, 0.5, -3, 1e300, float("nan"), 7, 7, float("inf"), 2]
    ws = [1, 1, 2, 2.0, 2.0, 0.25, 3, 1, 1, 5, 5, 0, 1]
    return list(zip(xs, ws))


@pytest.mark.parametrize("nan_strategy", ["propagate", "ignore"])
def test_number_updates_planned_equal_checked_and_numpy(monkeypatch, nan_strategy):
    """Python-number values (and weights), e.g. SumMetric.update(float(n)),
    take a planned path that fills each new value once: every value change is
    seen (no stale fill), and results equal the checked path and numpy."""
    def run():
        s, w = dk.SumMetric(nan_strategy=nan_strategy), dk.WeightedMeanMetric(nan_strategy=nan_strategy)
        finite_s = dk.SumMetric()
        for x, wt in _number_steps():
            s.update(x)
            w.update(x, weights=wt)
            if np.isfinite(x):
                finite_s.update(x)
        return s, w, finite_s

    planned = run()
    assert all(m._storage.plans for m in planned)
    monkeypatch.setattr(plan, "MAX_PLANS", 0)
    checked = run()
    for a, b in zip(planned, checked):
        torch.testing.assert_close(a.compute(), b.compute(), rtol=0, atol=0, equal_nan=True)
    xs = np.array([x for x, _ in _number_steps()], dtype=np.float64)
    ws = np.array([w for _, w in _number_steps()], dtype=np.float64)
    ok = np.isfinite(xs)
    assert planned[2].compute().item() == pytest.approx(np.sum(xs[ok]), rel=1e-15)
    if nan_strategy == "ignore":  # non-finite values left out
        assert planned[0].compute().item() == pytest.approx(np.sum(xs[ok]), rel=1e-15)
        assert planned[1].compute().item() == pytest.approx(np.average(xs[ok], weights=ws[ok]), rel=1e-12)
    else:
        assert np.isnan(planned[0].compute().item()) and np.isnan(planned[1].compute().item())


def test_number_updates_skip_the_checked_wrapper(monkeypatch):
    calls = []
    real = dk.ops.weighted_moments
    monkeypatch.setattr(dk.ops, "weighted_moments", lambda *a, **k: (calls.append(1), real(*a, **k)))
    s = dk.SumMetric()
    for v in (1.0, 2.0, 2.0, 4.5):
        s.update(v)
    assert len(calls) == 1, "only the first float update is checked"
    assert s.compute().item() == 9.5


@pytest.mark.parametrize("nan_strategy", ["propagate", "ignore"])
def test_extrema_planned_equal_checked_and_numpy(monkeypatch, nan_strategy):
    """MaxMetric/MinMetric plans (0-d and n-d tensors, masks, Python numbers
    with NaN/inf) give the checked path's results and numpy's, and skip the
    op wrapper after the first call of a signature."""
    g = torch.Generator().manual_seed(3)
    steps = []
    for i in range(10):
        steps.append(torch.randn((), generator=g) * 10)
        v = torch.randn(5, 3, generator=g)
        steps.append((v, torch.rand(5, 3, generator=g) > 0.3))
        steps.append([1.5, -7.0, 3, float("nan"), float("inf"), 2.25][i % 6])

    def run():
        ms = dk.MaxMetric(nan_strategy=nan_strategy), dk.MinMetric(nan_strategy=nan_strategy)
        for st in steps:
            for m in ms:
                if isinstance(st, tuple):
                    m.update(st[0], mask=st[1])
                else:
                    m.update(st)
        return [m.compute() for m in ms]

    calls = []
    real = dk.ops.running_extrema
    monkeypatch.setattr(dk.ops, "running_extrema", lambda *a, **k: (calls.append(1), real(*a, **k)))
    planned = run()
    assert len(calls) == 2 * 4, "one checked call per metric and signature (0-d, masked 2-d, int, float)"
    monkeypatch.setattr(plan, "MAX_PLANS", 0)
    checked = run()
    for a, b in zip(planned, checked):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    vals = []
    for st in steps:
        if isinstance(st, tuple):
            vals += st[0][st[1]].tolist()
        elif isinstance(st, torch.Tensor):
            vals.append(float(st))
        else:
            vals.append(float(st))
    vals = np.array(vals)
    if nan_strategy == "ignore":
        kept = vals[~np.isnan(vals)]
        assert planned[0].item() == kept.max() and planned[1].item() == kept.min()
    else:
        assert np.isnan(planned[0].item()) and np.isnan(planned[1].item())
