"""Issue #35, item 4 (rest): the curve-derived scores (LogAUC,
PrecisionAtFixedRecall, RecallAtFixedPrecision, SensitivityAtSpecificity,
SpecificityAtSensitivity), multiclass ROC / PrecisionRecallCurve with
average="micro" / "macro", and NegativePredictiveValue's zero_division,
against torchmetrics 1.9 (binned mode: thresholds=<int> and a list; the
functional API where the modular class does not apply an argument)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import d9d_kernels as dk

tm = pytest.importorskip("torchmetrics")
TF = pytest.importorskip("torchmetrics.functional.classification")

SIZE = {"binary": {}, "multiclass": {"num_classes": 4}, "multilabel": {"num_labels": 3}}
#: name -> constructor arguments besides task / thresholds / size
DERIVED = {
    "LogAUC": {"fpr_range": (0.01, 0.5)},
    "PrecisionAtFixedRecall": {"min_recall": 0.5},
    "RecallAtFixedPrecision": {"min_precision": 0.5},
    "SensitivityAtSpecificity": {"min_specificity": 0.6},
    "SpecificityAtSensitivity": {"min_sensitivity": 0.6},
}
THRESHOLDS = [11, 41, [0.0, 0.1, 0.25, 0.5, 0.9]]
#: LogAUC: torchmetrics' interpolation argsorts the curve, unstably past 16 points on CPU (points tied at one fpr
#: reorder; ours keeps their order, docs/metrics.md): compared on curves of at most 16 points
LOGAUC_MAX_POINTS = 16


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _batch(rng, task, n=50, ignore=False):
    if task == "binary":
        p, t = torch.from_numpy(rng.random(n)).float(), torch.from_numpy(rng.integers(0, 2, n))
    elif task == "multilabel":
        p, t = torch.from_numpy(rng.random((n, 3))).float(), torch.from_numpy(rng.integers(0, 2, (n, 3)))
    else:  # logits: softmax over the row
        p, t = torch.from_numpy(rng.normal(0, 1.5, (n, 4))).float(), torch.from_numpy(rng.integers(0, 4, n))
    if ignore:
        t = torch.where(torch.from_numpy(rng.random(t.shape) < 0.2), -1, t)
    return p, t


def _tm_thr(thresholds):
    return torch.tensor(thresholds) if isinstance(thresholds, list) else thresholds


def _close(got, exp, msg, rtol=1e-5, atol=1e-6):
    got = got if isinstance(got, tuple) else (got,)
    exp = exp if isinstance(exp, tuple) else (exp,)
    assert len(got) == len(exp), msg
    for a, e in zip(got, exp):
        e = torch.stack(list(e)) if isinstance(e, (list, tuple)) else e
        assert a.shape == e.shape, f"{msg}: shape {tuple(a.shape)} vs {tuple(e.shape)}"
        assert a.dtype == torch.float64, msg
        torch.testing.assert_close(a, e.double(), rtol=rtol, atol=atol, equal_nan=True, msg=msg)


@pytest.mark.parametrize("name", sorted(DERIVED))
@pytest.mark.parametrize("task", ["binary", "multiclass", "multilabel"])
@pytest.mark.parametrize("thresholds", THRESHOLDS, ids=["11", "41", "list"])
def test_derived_against_torchmetrics(name, task, thresholds):
    rng = np.random.default_rng(sorted(DERIVED).index(name) * 100 + len(str(thresholds)) + len(task))
    if name == "LogAUC" and isinstance(thresholds, int):
        thresholds = min(thresholds, LOGAUC_MAX_POINTS)
    variants = [{}, {"ignore_index": -1}]
    if name == "LogAUC":
        variants += [{"fpr_range": (0.001, 0.1)}] + ([{"average": "macro"}] if task != "binary" else [])
    for kw in variants:
        args = {**DERIVED[name], **kw}
        ours = getattr(dk, name)(task=task, thresholds=thresholds, **SIZE[task], **args)
        theirs = getattr(tm, name)(task=task, thresholds=_tm_thr(thresholds), **SIZE[task], **args)
        for _ in range(3):
            p, t = _batch(rng, task, ignore="ignore_index" in kw)
            ours.update(p, t)
            theirs.update(p, t)
        _close(ours.compute(), theirs.compute(), f"{name} {task} {thresholds} {kw}")


@pytest.mark.parametrize("name", sorted(DERIVED))
def test_derived_minimums_and_degenerate(name):
    """Every minimum from 0 to 1 (the 'no threshold qualifies' sentinels), a
    class without positives, a label without negatives, one update."""
    rng = np.random.default_rng(5)
    p, t = _batch(rng, "multilabel", n=40)
    t[:, 1] = 0  # label 1: no positives
    t[:, 2] = 1  # label 2: no negatives
    arg = next((k for k in DERIVED[name] if k.startswith("min_")), None)
    values = [0.0, 0.3, 0.7, 1.0] if arg else [(0.001, 0.1), (0.0001, 0.5), (0.2, 1.0)]
    for v in values:
        args = {arg: v} if arg else {"fpr_range": v}
        for task, (pp, tt) in (("multilabel", (p, t)), ("binary", (p[:, 0], t[:, 0]))):
            if name == "RecallAtFixedPrecision" and v == 0.0 and task == "multilabel":
                continue  # torchmetrics raises IndexError for a label without positives at min_precision=0
            ours = getattr(dk, name)(task=task, thresholds=11, **SIZE[task], **args)
            theirs = getattr(tm, name)(task=task, thresholds=11, **SIZE[task], **args)
            ours.update(pp, tt)
            _close(ours.compute(), theirs(pp, tt), f"{name} {task} {args}")


def test_derived_in_a_group_share_the_histogram():
    rng = np.random.default_rng(9)
    members = {n: getattr(dk, n)(task="multiclass", thresholds=11, num_classes=4, ignore_index=-1, **a)
               for n, a in DERIVED.items()}
    members["roc"] = dk.ROC(task="multiclass", thresholds=11, num_classes=4, ignore_index=-1)
    members["auroc"] = dk.AUROC(task="multiclass", thresholds=11, num_classes=4, ignore_index=-1)
    g = dk.MetricGroup(members)
    refs = {n: getattr(tm, n)(task="multiclass", thresholds=11, num_classes=4, ignore_index=-1, **a)
            for n, a in DERIVED.items()}
    assert len(g._storage.layout.stats) == 1  # one histogram for all seven
    for step in range(3):
        p, t = _batch(rng, "multiclass", ignore=True)
        out = g(preds=p, target=t)  # forward: this batch's values
        for n, ref in refs.items():
            _close(out[n], ref(p, t), f"{n} forward step {step}")
    values = g.compute()
    for n, ref in refs.items():
        _close(values[n], ref.compute(), f"{n} group compute")
    # clone / merge_state: the histogram adds up
    a = dk.SensitivityAtSpecificity(task="binary", min_specificity=0.5, thresholds=21)
    b = a.clone()
    ref = tm.SensitivityAtSpecificity(task="binary", min_specificity=0.5, thresholds=21)
    for m in (a, b):
        p, t = _batch(rng, "binary")
        m.update(p, t)
        ref.update(p, t)
    a.merge_state(b)
    _close(a.compute(), ref.compute(), "merge_state")


def test_derived_errors_empty_and_nan():
    for name, arg in (("PrecisionAtFixedRecall", "min_recall"), ("RecallAtFixedPrecision", "min_precision"),
                      ("SensitivityAtSpecificity", "min_specificity"),
                      ("SpecificityAtSensitivity", "min_sensitivity")):
        for bad in (1.5, -0.1, "0.5", None, True):
            with pytest.raises(ValueError, match=rf"{name}: argument '{arg}'"):
                getattr(dk, name)(task="binary", thresholds=11, **{arg: bad})
        with pytest.raises(ValueError, match=rf"{name}: argument 'thresholds'"):
            getattr(dk, name)(task="binary", thresholds=[0.5, 0.1], **{arg: 0.5})
        with pytest.raises(ValueError, match=rf"{name}: argument 'num_classes'"):
            getattr(dk, name)(task="multiclass", thresholds=11, **{arg: 0.5})
    for bad in ((0.1, 0.01), (0.0, 1.5), 0.1, (0.1,), ("a", 0.2)):
        with pytest.raises(ValueError, match=r"LogAUC: argument 'fpr_range'"):
            dk.LogAUC(task="binary", fpr_range=bad)
    with pytest.raises(ValueError, match=r"LogAUC: argument 'average'"):
        dk.LogAUC(task="multiclass", num_classes=3, average="weighted")
    # nothing seen: torchmetrics' values on empty counts
    v, thr = dk.RecallAtFixedPrecision(task="binary", min_precision=0.5, thresholds=5).compute()
    assert v.item() == 0.0 and torch.isnan(thr)
    v, thr = dk.SensitivityAtSpecificity(task="binary", min_specificity=0.5, thresholds=5).compute()
    assert v.item() == 0.0 and thr.item() == 1.0  # specificity 1 everywhere: the highest threshold (ties)
    # NaN scores: counted and raised (default), or NaN values (propagate)
    p = torch.tensor([0.2, float("nan"), 0.7])
    t = torch.tensor([0, 1, 1])
    err = dk.PrecisionAtFixedRecall(task="binary", min_recall=0.5, thresholds=5)
    err.update(p, t)
    with pytest.raises(ValueError, match="nonfinite_preds=1"):
        err.compute()
    prop = dk.LogAUC(task="binary", thresholds=5, nan_strategy="propagate")
    prop.update(p, t)
    assert torch.isnan(prop.compute())
    prop = dk.SpecificityAtSensitivity(task="binary", min_sensitivity=0.5, thresholds=5, nan_strategy="propagate")
    prop.update(p, t)
    assert torch.isnan(prop.compute()[0])


# -- ROC / PrecisionRecallCurve: multiclass average="micro" / "macro" ------------------------


@pytest.mark.parametrize("name", ["ROC", "PrecisionRecallCurve"])
@pytest.mark.parametrize("average", ["micro", "macro"])
@pytest.mark.parametrize("thresholds", [11, 101, [0.0, 0.1, 0.25, 0.5, 0.9]], ids=["11", "101", "list"])
def test_curve_averages_against_torchmetrics(name, average, thresholds):
    """micro: against torchmetrics' functional curve on the concatenated data
    (its modular class cannot accumulate a binned micro curve: its state has
    the per-class shape); macro: against the modular class."""
    rng = np.random.default_rng(len(name) + len(average) + len(str(thresholds)))
    functional = {"ROC": TF.multiclass_roc, "PrecisionRecallCurve": TF.multiclass_precision_recall_curve}[name]
    for kw in ({}, {"ignore_index": -1}):
        ours = getattr(dk, name)(task="multiclass", num_classes=4, thresholds=thresholds, average=average, **kw)
        theirs = getattr(tm, name)(task="multiclass", num_classes=4, thresholds=_tm_thr(thresholds),
                                   average=average, **kw) if average == "macro" else None
        seen = []
        for _ in range(3):
            p, t = _batch(rng, "multiclass", n=60, ignore="ignore_index" in kw)
            ours.update(p, t)
            seen.append((p, t))
            if theirs is not None:
                theirs.update(p, t)
        if theirs is None:
            p, t = (torch.cat(x) for x in zip(*seen))
            exp = functional(p, t, 4, thresholds=_tm_thr(thresholds), average="micro", **kw)
        else:
            exp = theirs.compute()
        # macro PR interpolates over the non-monotone precision axis (torchmetrics' rule): steep extrapolated
        # segments amplify torchmetrics' float32 rounding to ~1e-5 absolute
        tol = 1e-4 if name == "PrecisionRecallCurve" and average == "macro" else 1e-6
        _close(ours.compute(), tuple(exp), f"{name} {average} {thresholds} {kw}", rtol=1e-4, atol=tol)


def test_curve_average_errors():
    for name in ("ROC", "PrecisionRecallCurve"):
        for task, size in (("binary", {}), ("multilabel", {"num_labels": 3})):
            with pytest.raises(ValueError, match=rf"{name}: argument 'average'"):
                getattr(dk, name)(task=task, thresholds=11, average="macro", **size)
        with pytest.raises(ValueError, match=rf"{name}: argument 'average'"):
            getattr(dk, name)(task="multiclass", num_classes=3, thresholds=11, average="weighted")
    # a group: the micro / macro curves share the per-class histogram with the plain curve and AUROC
    g = dk.MetricGroup({"micro": dk.ROC(task="multiclass", num_classes=4, thresholds=11, average="micro"),
                        "macro": dk.ROC(task="multiclass", num_classes=4, thresholds=11, average="macro"),
                        "auroc": dk.AUROC(task="multiclass", num_classes=4, thresholds=11)})
    assert len(g._storage.layout.stats) == 1
    p, t = _batch(np.random.default_rng(1), "multiclass")
    g.update(preds=p, target=t)
    out = g.compute()
    exp = TF.multiclass_roc(p, t, 4, thresholds=11, average="micro")
    _close(out["micro"], tuple(exp), "group micro")
    assert out["macro"][0].shape == (44,)


# -- NegativePredictiveValue: zero_division ------------------------------------------------


@pytest.mark.parametrize("zero_division", [0, 1, 0.0, 1.0])
@pytest.mark.parametrize("task", ["binary", "multiclass", "multilabel"])
def test_npv_zero_division_against_torchmetrics(zero_division, task):
    """Against torchmetrics' functional NPV on the concatenated data: its
    modular NegativePredictiveValue takes zero_division and does not apply
    it (1.9), the functional one does."""
    rng = np.random.default_rng(int(zero_division) * 10 + len(task))
    fn = TF.negative_predictive_value
    for average in ("micro", "macro", "weighted", "none"):
        for kw in ({}, {"top_k": 2}, {"multidim_average": "samplewise"}, {"ignore_index": -1}):
            if "top_k" in kw and task != "multiclass":
                continue
            ours = dk.NegativePredictiveValue(task=task, average=average, zero_division=zero_division,
                                              **SIZE[task], **kw)
            seen = []
            for _ in range(2):
                if task == "binary":  # every prediction positive in some samples: tn + fn == 0
                    p = torch.from_numpy(rng.random((6, 5)) > 0.2).float()
                    p[:3] = 1.0
                    t = torch.from_numpy(rng.integers(0, 2, (6, 5)))
                elif task == "multilabel":
                    p = torch.from_numpy(rng.random((6, 3, 5)) > 0.3).float()
                    p[:, 0] = 1.0  # label 0 never predicted negative
                    t = torch.from_numpy(rng.integers(0, 2, (6, 3, 5)))
                else:  # class 3 is predicted for every row of sample 0: its tn + fn is 0 there
                    p = torch.from_numpy(rng.normal(0, 1, (6, 4, 5))).float()
                    p[:, 3] += 3.0
                    t = torch.from_numpy(rng.integers(0, 4, (6, 5)))
                if "ignore_index" in kw:
                    t = torch.where(torch.from_numpy(rng.random(t.shape) < 0.2), -1, t)
                ours.update(p, t)
                seen.append((p, t))
            p, t = (torch.cat(x) for x in zip(*seen))
            exp = fn(p, t, task=task, average=average, zero_division=zero_division, **SIZE[task], **kw)
            if "multidim_average" in kw:
                exp = exp.double().mean(0)
            _close(ours.compute(), exp, f"NPV {task} {average} zd={zero_division} {kw}", rtol=1e-6, atol=1e-7)


def test_npv_zero_division_values_and_errors():
    m = dk.NegativePredictiveValue(task="binary", zero_division=1)
    m.update(torch.tensor([1, 1, 1]), torch.tensor([0, 1, 1]))  # nothing predicted negative
    assert m.compute().item() == 1.0
    m = dk.NegativePredictiveValue(task="binary", zero_division=float("nan"))
    m.update(torch.tensor([1, 1]), torch.tensor([0, 1]))
    assert torch.isnan(m.compute())
    assert dk.NegativePredictiveValue(task="binary").zero_division == 0.0
    with pytest.raises(ValueError, match=r"NegativePredictiveValue: argument 'zero_division'"):
        dk.NegativePredictiveValue(task="binary", zero_division=0.5)
    # in a group with Precision (shared counts): each applies its own zero_division
    g = dk.MetricGroup({"npv1": dk.NegativePredictiveValue(task="multiclass", num_classes=3, average="none",
                                                           zero_division=1),
                        "npv0": dk.NegativePredictiveValue(task="multiclass", num_classes=3, average="none"),
                        "prec": dk.Precision(task="multiclass", num_classes=3, average="none")})
    p, t = torch.tensor([2, 2, 2, 2]), torch.tensor([0, 1, 2, 2])
    g.update(preds=p, target=t)
    out = g.compute()
    assert out["npv1"].tolist() == [0.75, 0.75, 1.0] and out["npv0"].tolist() == [0.75, 0.75, 0.0]
