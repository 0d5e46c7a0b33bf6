"""The classes of issue #35 (item 4) against torchmetrics 1.9 and, where it
has them, scikit-learn / scipy: random and adversarial inputs, weights and
masks, NaN under each nan_strategy, empty state, inside a MetricGroup,
forward, clone/merge, argument errors."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn import metrics as skm

import d9d_kernels as dk
from d9d_kernels.metrics.value_mean import ValueMean

tm = pytest.importorskip("torchmetrics")


def _tm(name, *args, **kw):
    return getattr(tm, name)(*args, **kw)


def _np(t):
    return np.asarray(t.detach().double().cpu().numpy())


def close(a, e, rtol=1e-9, atol=1e-9, msg=""):
    np.testing.assert_allclose(_np(a) if isinstance(a, torch.Tensor) else a,
                               _np(e) if isinstance(e, torch.Tensor) else e, rtol=rtol, atol=atol, err_msg=msg)


# -- regression ---------------------------------------------------------------------

#: name -> (constructor kwargs, positive inputs needed)
REGRESSION = {
    "MeanSquaredLogError": ({}, True),
    "NormalizedRootMeanSquaredError": ({"normalization": "mean"}, False),
    "NRMSE-range": ({"normalization": "range"}, False),
    "NRMSE-std": ({"normalization": "std"}, False),
    "NRMSE-l2": ({"normalization": "l2"}, False),
    "WeightedMeanAbsolutePercentageError": ({}, False),
    "LogCoshError": ({}, False),
    "MinkowskiDistance": ({"p": 3}, False),
    "Minkowski-1.5": ({"p": 1.5}, False),
    "RelativeSquaredError": ({}, False),
    "RRSE": ({"squared": False}, False),
    "ConcordanceCorrCoef": ({}, False),
    "TweedieDevianceScore": ({"power": 0.0}, False),
    "Tweedie-1": ({"power": 1}, True),
    "Tweedie-1.5": ({"power": 1.5}, True),
    "Tweedie-2": ({"power": 2}, True),
    "Tweedie-3": ({"power": 3}, True),
    "Tweedie--1": ({"power": -1.0}, True),
}


def _cls(name):
    if name.startswith("NRMSE"):
        return "NormalizedRootMeanSquaredError"
    if name == "RRSE":
        return "RelativeSquaredError"
    return {"Minkowski-1.5": "MinkowskiDistance"}.get(name, name.split("-")[0] if name.startswith("Tweedie") else name)


def _make(name, **extra):
    kw, _ = REGRESSION[name]
    cls = _cls(name).replace("Tweedie", "TweedieDevianceScore") if name.startswith("Tweedie-") else _cls(name)
    return getattr(dk, cls)(**kw, **extra), getattr(tm, cls)(**kw)


def _data(rng, n, positive, offset=0.0):
    if positive:
        y = rng.gamma(2.0, 2.0, n) + 0.1
        x = y * rng.uniform(0.5, 1.5, n) + 0.05
    else:
        y = offset + rng.normal(0, 2, n)
        x = y + rng.normal(0, 1, n)
    return torch.from_numpy(x), torch.from_numpy(y)


def _sklearn(name, x, y, w=None):
    """scikit-learn / scipy / numpy float64 reference on the kept elements (weighted)."""
    from scipy.spatial import distance

    x, y = x.numpy(), y.numpy()
    w = np.ones_like(x) if w is None else w
    kw, _ = REGRESSION[name]
    if name == "MeanSquaredLogError":
        return skm.mean_squared_log_error(y, x, sample_weight=w)
    if name.startswith("Tweedie"):
        return skm.mean_tweedie_deviance(y, x, sample_weight=w, power=kw["power"])
    if name.startswith("Minkowski"):
        return distance.minkowski(x, y, p=kw["p"], w=w)
    if name == "WeightedMeanAbsolutePercentageError":
        return np.sum(w * np.abs(x - y)) / np.sum(w * np.abs(y))
    if name == "LogCoshError":
        return np.average(np.log(np.cosh(x - y)), weights=w)
    if name in ("RelativeSquaredError", "RRSE"):
        r = 1 - skm.r2_score(y, x, sample_weight=w)
        return r if name == "RelativeSquaredError" else np.sqrt(r)
    if name == "ConcordanceCorrCoef":  # frequency weights: n = Σw, unbiased
        n = w.sum()
        mx, my = np.average(x, weights=w), np.average(y, weights=w)
        vx, vy = np.sum(w * (x - mx) ** 2) / (n - 1), np.sum(w * (y - my) ** 2) / (n - 1)
        cov = np.sum(w * (x - mx) * (y - my)) / (n - 1)
        return 2 * cov / (vx + vy + (mx - my) ** 2)
    rmse = skm.root_mean_squared_error(y, x, sample_weight=w)
    norm = kw["normalization"]
    den = {"mean": np.average(y, weights=w), "range": np.ptp(y), "std": np.sqrt(np.cov(y, aweights=w, ddof=0)),
           "l2": np.sqrt(np.sum(w * y * y))}[norm]
    return rmse / den


@pytest.mark.parametrize("name", list(REGRESSION))
@pytest.mark.parametrize("seed", [0, 1])
def test_regression_against_torchmetrics_and_sklearn(name, seed):
    rng = np.random.default_rng(seed)
    _, positive = REGRESSION[name]
    x, y = _data(rng, 57, positive)
    ours, theirs = _make(name)
    for idx in np.array_split(np.arange(57), 3):  # several updates
        ours.update(x[idx], y[idx])
        theirs.update(x[idx], y[idx])
    close(ours.compute(), theirs.compute(), rtol=2e-5, atol=1e-7, msg=name)  # its float32 state
    close(ours.compute(), _sklearn(name, x, y), rtol=1e-9, atol=1e-12, msg=name)
    # weights and mask: sklearn's sample_weight on the kept elements
    w = rng.random(57) + 0.1
    keep = rng.random(57) < 0.7
    if name.startswith("NRMSE-range"):
        w = np.ones(57)  # the range ignores weights (documented)
    m, _ = _make(name)
    for idx in np.array_split(np.arange(57), 2):
        m.update(x[idx], y[idx], weights=torch.from_numpy(w[idx]), mask=torch.from_numpy(keep[idx]))
    if name == "ConcordanceCorrCoef":
        w = np.round(w * 3) + 1  # frequency weights
        m, _ = _make(name)
        m.update(x, y, weights=torch.from_numpy(w), mask=torch.from_numpy(keep))
    close(m.compute(), _sklearn(name, x[keep], y[keep], w[keep]), rtol=1e-9, atol=1e-12, msg=f"{name} weighted")


@pytest.mark.parametrize("name", list(REGRESSION))
def test_regression_empty_nan_group_forward(name):
    rng = np.random.default_rng(3)
    _, positive = REGRESSION[name]
    m, theirs = _make(name)
    if isinstance(m, ValueMean):  # a mean of a per-element value: torchmetrics' no-data value
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its "compute called before update"
            empty = theirs.compute().item()
    else:
        empty = 0.0  # the regression catalogue rule (torchmetrics: NaN, but 0.0 for WMAPE and CSI)
    np.testing.assert_equal(m.compute().item(), empty, err_msg=name)
    x, y = _data(rng, 20, positive)
    m.update(x, y, mask=torch.zeros(20, dtype=torch.bool))
    np.testing.assert_equal(m.compute().item(), empty, err_msg=name)
    # NaN: propagate / ignore / error
    xn = x.clone()
    xn[3] = float("nan")
    keep = torch.ones(20, dtype=torch.bool)
    keep[3] = False
    if not name.startswith("Tweedie"):
        p, _ = _make(name)
        p.update(xn, y)
        assert torch.isnan(p.compute()).all(), name
    i, _ = _make(name, nan_strategy="ignore")
    i.update(xn, y)
    ref, _ = _make(name)
    ref.update(x[keep], y[keep])
    close(i.compute(), ref.compute(), rtol=1e-12, atol=0, msg=name)
    e, _ = _make(name, nan_strategy="error")
    e.update(xn, y)
    with pytest.raises(ValueError, match="1 invalid"):
        e.compute()
    # in a group with the plain regression metrics (shared moments where the inputs are the same)
    g = dk.MetricGroup({"new": _make(name)[0], "mse": dk.MeanSquaredError(), "r2": dk.R2Score()})
    alone, theirs = _make(name)
    batches = [_data(rng, n, positive) for n in (7, 13)]
    for bx, by in batches:
        out = g(preds=bx, target=by)  # forward: the batch values
        b, _ = _make(name)
        b.update(bx, by)
        close(out["new"], b.compute(), rtol=1e-12, atol=1e-15, msg=name)
        alone.update(bx, by)
        theirs.update(bx, by)
    close(g.compute()["new"], alone.compute(), rtol=1e-12, atol=1e-15, msg=name)
    close(g.compute()["new"], theirs.compute(), rtol=2e-5, atol=1e-7, msg=name)
    # clone + merge_state = the concatenation
    c = alone.clone()
    c.merge_state(alone)
    both, _ = _make(name)
    for bx, by in batches * 2:
        both.update(bx, by)
    close(c.compute(), both.compute(), rtol=1e-10, atol=1e-12, msg=name)


def test_regression_large_offset_and_multioutput():
    rng = np.random.default_rng(5)
    n = 20_000
    y = 1e6 + rng.normal(0, 1e-2, n)
    x = y + rng.normal(0, 5e-3, n)
    ccc, rse = dk.ConcordanceCorrCoef(), dk.RelativeSquaredError()
    g = dk.MetricGroup({"ccc": ccc, "rse": rse, "nrmse": dk.NormalizedRootMeanSquaredError(normalization="std")})
    for idx in np.array_split(np.arange(n), 4):
        g.update(preds=torch.from_numpy(x[idx]), target=torch.from_numpy(y[idx]))
    out = g.compute()
    close(out["ccc"], _sklearn("ConcordanceCorrCoef", torch.from_numpy(x), torch.from_numpy(y)), rtol=1e-7)
    close(out["rse"], 1 - skm.r2_score(y, x), rtol=1e-7)
    close(out["nrmse"], np.sqrt(np.mean((x - y) ** 2)) / np.std(y), rtol=1e-7)
    # num_outputs: one value per column, as torchmetrics
    xm, ym = torch.from_numpy(rng.normal(0, 1, (40, 3))), torch.from_numpy(rng.normal(0, 1, (40, 3)))
    for name, kw in (("ConcordanceCorrCoef", {}), ("RelativeSquaredError", {}), ("LogCoshError", {}),
                     ("NormalizedRootMeanSquaredError", {"normalization": "range"}),
                     ("NormalizedRootMeanSquaredError", {"normalization": "l2"}),
                     ("NormalizedRootMeanSquaredError", {"normalization": "std"})):
        ours, theirs = getattr(dk, name)(num_outputs=3, **kw), getattr(tm, name)(num_outputs=3, **kw)
        for idx in (slice(0, 15), slice(15, 40)):
            ours.update(xm[idx], ym[idx])
            theirs.update(xm[idx], ym[idx])
        close(ours.compute(), theirs.compute(), rtol=1e-6, atol=1e-9, msg=f"{name} {kw}")
    with pytest.raises(ValueError, match=r"LogCoshError: argument 'num_outputs'"):
        dk.LogCoshError().update(xm, ym)


def test_regression_adversarial():
    # LogCosh: finite for huge differences (torchmetrics' exp overflows in float32)
    m = dk.LogCoshError()
    m.update(torch.tensor([1000.0, 0.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    close(m.compute(), (1000 - np.log(2) + np.log(np.cosh(0.0))) / 2, rtol=1e-12)
    # CSI: nothing at or above the threshold -> 0.0; NaN reads as below
    c, t = dk.CriticalSuccessIndex(0.5), tm.regression.CriticalSuccessIndex(0.5)
    z = torch.zeros(4)
    c.update(z, z)
    assert c.compute().item() == 0.0
    p, q = torch.tensor([0.6, float("nan"), 0.7, 0.2, 0.5]), torch.tensor([0.9, 0.8, 0.1, 0.7, 0.5])
    c.update(p, q)
    t.update(p, q)
    close(c.compute(), t.compute(), rtol=1e-7)
    c2 = dk.CriticalSuccessIndex(0.5)
    c2.update(torch.cat([p, p]), torch.cat([q, q]), mask=torch.tensor([True] * 5 + [False] * 5))
    close(c2.compute(), t.compute(), rtol=1e-7)
    # Tweedie: outside the domain -> counted and raised (torchmetrics raises in update)
    tw = dk.TweedieDevianceScore(power=2)
    tw.update(torch.tensor([1.0, -1.0]), torch.tensor([1.0, 1.0]))
    with pytest.raises(ValueError, match="1 invalid"):
        tw.compute()
    with pytest.raises(ValueError):
        tm.regression.TweedieDevianceScore(power=2)(torch.tensor([1.0, -1.0]), torch.tensor([1.0, 1.0]))
    # RSE on a constant target: torchmetrics' float32-eps clamp
    r, rt = dk.RelativeSquaredError(), tm.regression.RelativeSquaredError()
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.full((3,), 2.0)
    r.update(a, b)
    rt.update(a, b)
    close(r.compute(), rt.compute(), rtol=1e-6)
    # WMAPE: all-zero target -> torchmetrics' epsilon
    wm, wt = dk.WeightedMeanAbsolutePercentageError(), tm.regression.WeightedMeanAbsolutePercentageError()
    wm.update(a, torch.zeros(3))
    wt.update(a, torch.zeros(3))
    close(wm.compute(), wt.compute(), rtol=1e-6)
    # CCC degenerate: constant equal inputs -> 0.0 (torchmetrics NaN)
    cc = dk.ConcordanceCorrCoef()
    cc.update(b, b)
    assert cc.compute().item() == 0.0


def test_regression_argument_errors():
    with pytest.raises(ValueError, match=r"NormalizedRootMeanSquaredError: argument 'normalization'"):
        dk.NormalizedRootMeanSquaredError(normalization="max")
    with pytest.raises(ValueError, match=r"MinkowskiDistance: argument 'p'"):
        dk.MinkowskiDistance(p=0.5)
    with pytest.raises(ValueError, match=r"TweedieDevianceScore: argument 'power'"):
        dk.TweedieDevianceScore(power=0.5)
    with pytest.raises(ValueError, match=r"CriticalSuccessIndex: argument 'keep_sequence_dim'"):
        dk.CriticalSuccessIndex(0.5, keep_sequence_dim=0)
    with pytest.raises(TypeError, match=r"RelativeSquaredError: argument 'squared'"):
        dk.RelativeSquaredError(squared=1)
    with pytest.raises(ValueError, match=r"MeanSquaredLogError: argument 'target'"):
        dk.MeanSquaredLogError().update(torch.zeros(3), torch.zeros(4))
    with pytest.raises(ValueError, match=r"ConcordanceCorrCoef: argument 'preds'"):
        dk.ConcordanceCorrCoef(num_outputs=2).update(torch.zeros(3), torch.zeros(3))
    with pytest.raises(TypeError, match=r"WeightedMeanAbsolutePercentageError: argument 'mask'"):
        dk.WeightedMeanAbsolutePercentageError().update(torch.zeros(3), torch.zeros(3), mask=torch.ones(3))


# -- classification -------------------------------------------------------------------

CLASSIFICATION = ["StatScores", "HammingDistance", "NegativePredictiveValue"]


def _cls_data(rng, task, n=60, C=4, L=3, kind="scores"):
    if task == "binary":
        p = torch.from_numpy(rng.random(n)) if kind == "scores" else torch.from_numpy(rng.normal(0, 3, n))
        return p.float(), torch.from_numpy(rng.integers(0, 2, n))
    if task == "multilabel":
        return torch.from_numpy(rng.random((n, L))).float(), torch.from_numpy(rng.integers(0, 2, (n, L)))
    logits = torch.from_numpy(rng.normal(0, 1, (n, C))).float()
    return (logits if kind == "scores" else logits.argmax(-1)), torch.from_numpy(rng.integers(0, C, n))


def _pair(name, task, **kw):
    size = {"multiclass": {"num_classes": 4}, "multilabel": {"num_labels": 3}, "binary": {}}[task]
    return getattr(dk, name)(task=task, **size, **kw), getattr(tm, name)(task=task, **size, **kw)


@pytest.mark.parametrize("name", CLASSIFICATION)
@pytest.mark.parametrize("task", ["binary", "multiclass", "multilabel"])
@pytest.mark.parametrize("average", ["micro", "macro", "weighted", "none"])
def test_classification_against_torchmetrics(name, task, average):
    rng = np.random.default_rng(hash((name, task, average)) % 2**32)
    for kw in ({}, {"ignore_index": 1} if task == "multiclass" else {"ignore_index": -1}, {"top_k": 2}):
        if "top_k" in kw and task != "multiclass":
            continue
        ours, theirs = _pair(name, task, average=average, **kw)
        for _ in range(3):
            p, t = _cls_data(rng, task)
            if kw.get("ignore_index") == -1:
                t = torch.where(torch.from_numpy(rng.random(t.shape) < 0.2), -1, t)
            ours.update(p, t)
            theirs.update(p, t)
        close(ours.compute(), theirs.compute().double(), rtol=1e-6, atol=1e-9, msg=f"{name} {task} {average} {kw}")


@pytest.mark.parametrize("name", CLASSIFICATION)
def test_classification_sklearn_samplewise_group(name):
    rng = np.random.default_rng(11)
    p, t = _cls_data(rng, "multilabel", n=50)
    m = dk.HammingDistance(task="multilabel", num_labels=3)
    m.update(p, t)
    close(m.compute(), skm.hamming_loss(t.numpy(), (p > 0.5).numpy()), rtol=1e-12)
    pb, tb = _cls_data(rng, "binary", n=50)
    npv = dk.NegativePredictiveValue(task="binary")
    npv.update(pb, tb)
    close(npv.compute(), skm.precision_score(1 - tb.numpy(), 1 - (pb > 0.5).numpy()), rtol=1e-12)
    # samplewise: the mean of torchmetrics' per-sample values
    ps, ts = torch.from_numpy(rng.normal(0, 1, (5, 4, 7))).float(), torch.from_numpy(rng.integers(0, 4, (5, 7)))
    ours, theirs = _pair(name, "multiclass", average="macro", multidim_average="samplewise")
    ours.update(ps, ts)
    theirs.update(ps, ts)
    close(ours.compute(), theirs.compute().double().mean(0), rtol=1e-6, msg=name)
    # in a group with Accuracy / F1 (one shared class statistic), forward, NaN
    g = dk.MetricGroup({"new": getattr(dk, name)(task="multiclass", num_classes=4, average="macro"),
                        "acc": dk.Accuracy(task="multiclass", num_classes=4)})
    theirs = getattr(tm, name)(task="multiclass", num_classes=4, average="macro")
    for _ in range(2):
        pm, tmm = _cls_data(rng, "multiclass")
        close(g(preds=pm, target=tmm)["new"], getattr(tm, name)(task="multiclass", num_classes=4,
                                                                 average="macro")(pm, tmm).double(), rtol=1e-6)
        theirs.update(pm, tmm)
    close(g.compute()["new"], theirs.compute().double(), rtol=1e-6)
    bad = dk.MetricGroup({"new": getattr(dk, name)(task="multiclass", num_classes=4)})
    pm[0, 0] = float("nan")
    bad.update(preds=pm, target=tmm)
    with pytest.raises(ValueError, match="nonfinite_preds=1"):
        bad.compute()
    with pytest.raises(ValueError, match=rf"{name}: argument 'average'"):
        getattr(dk, name)(task="multiclass", num_classes=4, average="samples")


def _exact_pair(task, **kw):
    size = {"num_classes": 3} if task == "multiclass" else {"num_labels": 3}
    return dk.ExactMatch(task=task, **size, **kw), tm.ExactMatch(task=task, **size, **kw)


@pytest.mark.parametrize("task", ["multiclass", "multilabel"])
@pytest.mark.parametrize("shape", [(40,), (10, 5), (6, 4, 3)])
def test_exact_match(task, shape):
    rng = np.random.default_rng(len(shape))
    for kw in ({}, {"ignore_index": 2 if task == "multiclass" else -1}):
        ours, theirs = _exact_pair(task, **kw)
        for _ in range(3):
            if task == "multiclass":
                t = torch.from_numpy(rng.integers(0, 3, shape))
                p = torch.where(torch.from_numpy(rng.random(shape) < 0.8), t, torch.from_numpy(rng.integers(0, 3, shape)))
                if len(shape) > 1 and rng.random() < 0.5:  # scores [N, C, d...]
                    s = torch.from_numpy(rng.random((shape[0], 3) + shape[1:]))
                    s.scatter_(1, p.unsqueeze(1), 2.0)
                    p = s
            else:
                if len(shape) == 1:
                    continue
                sh = (shape[0], 3) + shape[2:] if len(shape) > 2 else (shape[0], 3)
                t = torch.from_numpy(rng.integers(0, 2, sh))
                p = torch.from_numpy(rng.random(sh)).float()
                p = torch.where(torch.from_numpy(rng.random(sh) < 0.8), t.float() * 0.6 + 0.2, p)
            if "ignore_index" in kw and task == "multilabel":
                t = torch.where(torch.from_numpy(rng.random(t.shape) < 0.1), -1, t)
            ours.update(p, t)
            theirs.update(p, t)
        if task == "multilabel" and len(shape) == 1:
            continue
        close(ours.compute(), theirs.compute().double(), rtol=1e-7, msg=f"{task} {shape} {kw}")
    if task == "multilabel":
        t = torch.from_numpy(rng.integers(0, 2, (30, 3)))
        p = torch.from_numpy(rng.integers(0, 2, (30, 3)))
        m = dk.ExactMatch(task="multilabel", num_labels=3)
        m.update(p, t, mask=torch.ones(30, 1, dtype=torch.bool))
        close(m.compute(), skm.accuracy_score(t.numpy(), p.numpy()), rtol=1e-12)  # subset accuracy
        m2 = dk.ExactMatch(task="multilabel", num_labels=3)
        m2.update(torch.cat([p, p]), torch.cat([t, 1 - t]), mask=torch.arange(60)[:, None] < 30)
        close(m2.compute(), m.compute(), rtol=0)  # masked samples are no samples
    else:
        m = dk.ExactMatch(task="multiclass", num_classes=3)
        m.update(torch.tensor([[0, 1], [0, 1]]), torch.tensor([[0, 3], [0, 1]]))  # class 3 out of range
        with pytest.raises(ValueError, match="target_out_of_range=1"):
            m.compute()
        assert dk.ExactMatch(task="multiclass", num_classes=3).compute().item() == 0.0
        with pytest.raises(ValueError, match=r"ExactMatch: argument 'multidim_average'"):
            dk.ExactMatch(task="multiclass", num_classes=3, multidim_average="samplewise")
        with pytest.raises(ValueError, match=r"ExactMatch: argument 'task'"):
            dk.ExactMatch(task="binary")


# -- divergence -------------------------------------------------------------------------


@pytest.mark.parametrize("log_prob", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_jensen_shannon(log_prob, reduction):
    from scipy.spatial import distance

    rng = np.random.default_rng(2)
    p = rng.dirichlet(np.ones(5), 30)
    q = rng.dirichlet(np.ones(5), 30)
    p[0, :2] = 0.0  # zero probabilities: 0 log 0 = 0
    q[0, :2] = 0.0
    p, q = p / p.sum(1, keepdims=True), q / q.sum(1, keepdims=True)
    pt, qt = torch.from_numpy(p), torch.from_numpy(q)
    if log_prob:
        pt, qt = torch.log(pt + 1e-300), torch.log(qt + 1e-300)
    ours = dk.JensenShannonDivergence(log_prob=log_prob, reduction=reduction)
    theirs = tm.regression.JensenShannonDivergence(log_prob=log_prob, reduction=reduction)
    for idx in (slice(0, 10), slice(10, 30)):
        ours.update(pt[idx], qt[idx])
        theirs.update(pt[idx], qt[idx])
    rows = np.array([distance.jensenshannon(a, b) ** 2 for a, b in zip(p, q)])
    close(ours.compute(), rows.mean() if reduction == "mean" else rows.sum(), rtol=1e-9, atol=1e-12)
    close(ours.compute(), theirs.compute(), rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match=r"JensenShannonDivergence: argument 'reduction'"):
        dk.JensenShannonDivergence(reduction="none")


# -- running -------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [1, 3])
def test_running_wrapper_against_torchmetrics(window):
    rng = np.random.default_rng(window)
    cases = [
        (lambda: dk.SumMetric(), lambda: tm.aggregation.SumMetric(), "values"),
        (lambda: dk.MeanMetric(), lambda: tm.aggregation.MeanMetric(), "values"),
        (lambda: dk.MeanSquaredError(), lambda: tm.MeanSquaredError(), "pair"),
        (lambda: dk.R2Score(), lambda: tm.R2Score(), "pair"),
        (lambda: dk.MeanAbsoluteError(), lambda: tm.MeanAbsoluteError(), "pair"),
        (lambda: dk.Accuracy(task="multiclass", num_classes=4, average="macro"),
         lambda: tm.Accuracy(task="multiclass", num_classes=4, average="macro"), "cls"),
        (lambda: dk.ConfusionMatrix(task="multiclass", num_classes=4),
         lambda: tm.ConfusionMatrix(task="multiclass", num_classes=4), "cls"),
    ]
    for ours_f, theirs_f, kind in cases:
        ours, theirs = dk.Running(ours_f(), window=window), tm.wrappers.Running(theirs_f(), window=window)
        for step in range(5):
            if kind == "values":
                args = (torch.from_numpy(rng.normal(0, 1, 6)),)
            elif kind == "pair":
                x = torch.from_numpy(rng.normal(0, 1, 8))
                args = (x, x + torch.from_numpy(rng.normal(0, 0.5, 8)))
            else:
                args = _cls_data(rng, "multiclass", n=12)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                close(ours(*args), theirs(*args).double(), rtol=1e-5, atol=1e-7, msg=f"{kind} forward {step}")
                close(ours.compute(), theirs.compute().double(), rtol=1e-5, atol=1e-7, msg=f"{kind} {step}")
    # bases torchmetrics cannot wrap (full_state_update): Max / Min / Pearson over the last `window` batches
    mx, mn, vals = dk.Running(dk.MaxMetric(), window=window), dk.Running(dk.MinMetric(), window=window), []
    for _ in range(5):
        vals.append(torch.from_numpy(rng.normal(0, 1, 4)))
        assert mx(vals[-1]).item() == vals[-1].max().item()
        mn.update(vals[-1])
        assert mx.compute().item() == torch.cat(vals[-window:]).max().item()
        assert mn.compute().item() == torch.cat(vals[-window:]).min().item()
    run, batches = dk.Running(dk.PearsonCorrCoef(), window=window), []
    for _ in range(4):
        x = torch.from_numpy(rng.normal(0, 1, 9))
        batches.append((x, 2 * x + torch.from_numpy(rng.normal(0, 1, 9))))
        run.update(*batches[-1])
        ref = dk.PearsonCorrCoef()
        ref.update(torch.cat([b[0] for b in batches[-window:]]), torch.cat([b[1] for b in batches[-window:]]))
        close(run.compute(), ref.compute(), rtol=1e-12)
    # in a group, clone, reset, bad input inside the window
    g = dk.MetricGroup({"run": dk.Running(dk.Accuracy(task="multiclass", num_classes=3), window=2),
                        "acc": dk.Accuracy(task="multiclass", num_classes=3)})
    g.update(preds=torch.tensor([0, 1]), target=torch.tensor([0, 0]))
    g.update(preds=torch.tensor([0, 1]), target=torch.tensor([0, 1]))
    g.update(preds=torch.tensor([2, 2]), target=torch.tensor([2, 2]))
    out = g.compute()
    assert out["run"].item() == 1.0 and abs(out["acc"].item() - 5 / 6) < 1e-12
    c = g["run"].clone()
    c.update(preds=torch.tensor([0]), target=torch.tensor([1]))
    assert abs(c.compute().item() - 2 / 3) < 1e-12 and g["run"].compute().item() == 1.0
    r = dk.Running(dk.Accuracy(task="multiclass", num_classes=3), window=2)
    r.update(torch.tensor([0]), torch.tensor([5]))  # out of range: raises while in the window
    with pytest.raises(ValueError, match="target_out_of_range=1"):
        r.compute()
    r.update(torch.tensor([0]), torch.tensor([0]))
    r.update(torch.tensor([0]), torch.tensor([0]))
    assert r.compute().item() == 1.0
    r.reset()
    assert r.compute().item() == 0.0
    with pytest.raises(TypeError, match=r"Running: argument 'base_metric'"):
        dk.Running(tm.aggregation.SumMetric())
    with pytest.raises(ValueError, match=r"Running: argument 'base_metric'"):
        dk.Running(dk.RunningMean())
    with pytest.raises(ValueError, match=r"Running: argument 'window'"):
        dk.Running(dk.SumMetric(), window=0)


def test_running_sum():
    ours, theirs = dk.RunningSum(window=3), tm.aggregation.RunningSum(window=3)
    for i in range(6):
        v = torch.tensor([float(i), float(i) / 2])
        close(ours(v), theirs(v), rtol=1e-7)
        close(ours.compute(), theirs.compute(), rtol=1e-7)
    nan = dk.RunningSum(window=2, nan_strategy="ignore")
    nan.update(torch.tensor([1.0, float("nan")]))
    assert nan.compute().item() == 1.0
    assert dk.RunningSum().compute().item() == 0.0
    with pytest.raises(ValueError, match=r"RunningSum: argument 'window'"):
        dk.RunningSum(window=0)


# -- binned curves ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ROC", "PrecisionRecallCurve"])
@pytest.mark.parametrize("task", ["binary", "multiclass", "multilabel"])
@pytest.mark.parametrize("thresholds", [11, 101, [0.0, 0.1, 0.25, 0.5, 0.9]])
def test_binned_curves_against_torchmetrics(name, task, thresholds):
    rng = np.random.default_rng(7)
    size = {"multiclass": {"num_classes": 4}, "multilabel": {"num_labels": 3}, "binary": {}}[task]
    tm_thr = torch.tensor(thresholds) if isinstance(thresholds, list) else thresholds
    for kw in ({}, {"ignore_index": -1}):
        ours = getattr(dk, name)(task=task, thresholds=thresholds, **size, **kw)
        theirs = getattr(tm, name)(task=task, thresholds=tm_thr, **size, **kw)
        for step in range(3):
            p, t = _cls_data(rng, task, n=80, C=4, L=3, kind="scores" if step or task == "multiclass" else "logits")
            if task == "multiclass":
                p = p if step else p * 3  # logits: softmax over the row
            if "ignore_index" in kw:
                t = torch.where(torch.from_numpy(rng.random(t.shape) < 0.2), -1, t)
            ours.update(p, t)
            theirs.update(p, t)
        got, exp = ours.compute(), theirs.compute()
        for a, e, what in zip(got, exp, ("x", "y", "thresholds")):
            e = torch.stack(e) if isinstance(e, (list, tuple)) else e
            close(a, e.double(), rtol=1e-6, atol=1e-7, msg=f"{name} {task} {thresholds} {kw} {what}")
    # in a group with AUROC on the same bins: one histogram; forward = the batch's curve
    g = dk.MetricGroup({"curve": getattr(dk, name)(task=task, thresholds=11, **size),
                        "auroc": dk.AUROC(task=task, thresholds=11, **size)})
    p, t = _cls_data(rng, task, n=50, C=4, L=3)
    out = g(preds=p, target=t)
    ref = getattr(tm, name)(task=task, thresholds=11, **size)(p, t)
    close(out["curve"][1], torch.stack(ref[1]) if isinstance(ref[1], (list, tuple)) else ref[1].double(),
          rtol=1e-6, atol=1e-7)
    assert len(g._storage.layout.stats) == 1  # the curve and AUROC share one histogram


def test_binned_curves_errors_and_empty():
    with pytest.raises(ValueError, match=r"ROC: argument 'average'"):
        dk.ROC(task="multilabel", num_labels=3, average="macro")  # torchmetrics has no multilabel average
    with pytest.raises(ValueError, match=r"PrecisionRecallCurve: argument 'thresholds'"):
        dk.PrecisionRecallCurve(task="binary", thresholds=[0.5, 0.1])
    fpr, tpr, thr = dk.ROC(task="binary", thresholds=3).compute()
    assert fpr.tolist() == [0.0, 0.0, 0.0] and thr.tolist() == [1.0, 0.5, 0.0]
    nan = dk.ROC(task="binary", thresholds=3, nan_strategy="propagate")
    nan.update(torch.tensor([0.2, float("nan")]), torch.tensor([0, 1]))
    assert torch.isnan(nan.compute()[0]).all()
    err = dk.PrecisionRecallCurve(task="binary", thresholds=3)
    err.update(torch.tensor([0.2, float("nan")]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="nonfinite_preds=1"):
        err.compute()
