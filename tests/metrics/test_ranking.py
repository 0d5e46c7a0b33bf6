"""AUROC / AveragePrecision from 10,000-bin histograms against scikit-learn.

Two claims are tested. (1) Exactly (1e-9) the scikit-learn value on the
bin-quantised scores ``floor(p * B)``: ties within a bin count as ties, which
is all the binning changes. (2) Within 1e-3 of scikit-learn on the raw scores
on realistic sizes (thousands of samples); for a handful of samples one
positive/negative pair sharing a bin moves AUROC by ``0.5 / (P N)``, which
can exceed 1e-3, so the hypothesis tests check (1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn import metrics as skm

import d9d_kernels as dk
from tests.metrics._catalogue_utils import _one_thread, IGNORE, binary_data, close, multiclass_data, quiet, softmax  # noqa: F401

TOL = 1e-3
EXACT = 1e-9
B = 10_000


def quantise(p):
    return np.clip(np.floor(p * B), 0, B - 1)


def _per_label_ref(Y, P, K):
    """Per label (kept entries only): AUROC (NaN if undefined), AP (0 without positives), positives."""
    auc, ap, pos = [], [], []
    for l in range(Y.shape[1]):
        y, p = Y[K[:, l], l], P[K[:, l], l]
        npos = int((y == 1).sum())
        auc.append(skm.roc_auc_score(y, p) if 0 < npos < len(y) else np.nan)
        ap.append(quiet(skm.average_precision_score, y, p) if npos > 0 else 0.0)
        pos.append(npos)
    return np.array(auc), np.array(ap), np.array(pos, dtype=np.float64)


def _avg(vals, pos, average, nan_out=True):
    if average == "none":
        return vals
    ok = ~np.isnan(vals)
    w = np.ones_like(vals) if average == "macro" else pos
    w = np.where(ok, w, 0.0)
    return float((w * np.nan_to_num(vals)).sum() / w.sum()) if w.sum() > 0 else 0.0


def _micro(Y, P, K):
    y, p = Y[K], P[K]
    npos = int((y == 1).sum())
    auc = skm.roc_auc_score(y, p) if 0 < npos < len(y) else 0.0
    ap = quiet(skm.average_precision_score, y, p) if npos > 0 else 0.0
    return auc, ap


def _check(Y, P, K, make, preds, target, mask, tol=EXACT):
    P = quantise(P) if tol == EXACT else P
    auc, ap, pos = _per_label_ref(Y, P, K)
    mauc, map_ = _micro(Y, P, K)
    for average in ["macro", "weighted", "none", "micro"]:
        a = make(dk.AUROC, average)
        a.update(preds, target, mask=mask)
        b = make(dk.AveragePrecision, average)
        b.update(preds, target, mask=mask)
        ea = mauc if average == "micro" else _avg(auc, pos, average)
        eb = map_ if average == "micro" else _avg(ap, pos, average)
        got_a = a.compute().numpy()
        if average == "none":
            assert np.array_equal(np.isnan(got_a), np.isnan(ea)), (got_a, ea)
            got_a, ea = np.nan_to_num(got_a), np.nan_to_num(ea)
        np.testing.assert_allclose(got_a, ea, rtol=0, atol=tol, err_msg=f"AUROC {average}")
        close(b.compute(), eb, atol=tol, msg=f"AP {average}")


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 300),
    kind=st.sampled_from(["probs", "logits"]),
    ignore=st.sampled_from([None, -1]),
    masked=st.booleans(),
)
def test_binary_against_sklearn(seed, n, kind, ignore, masked):
    rng = np.random.default_rng(seed)
    preds, target, mask, prob, tgt, keep = binary_data(rng, (n,), kind, ignore, masked)
    auc, ap, _ = _per_label_ref(tgt[:, None], quantise(prob)[:, None], keep[:, None])
    a = dk.AUROC(task="binary", ignore_index=ignore)
    a.update(preds, target, mask=mask)
    close(a.compute(), 0.0 if np.isnan(auc[0]) else auc[0], atol=EXACT, msg="AUROC")
    b = dk.AveragePrecision(task="binary", ignore_index=ignore)
    b.update(preds, target, mask=mask)
    close(b.compute(), ap[0], atol=EXACT, msg="AP")


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 200),
    C=st.integers(2, 5),
    kind=st.sampled_from(["probs", "logits"]),
    absent=st.sampled_from(["none", "none", "one", "all"]),
    ignore=st.sampled_from([None, IGNORE]),
    masked=st.booleans(),
)
def test_multiclass_one_vs_rest_against_sklearn(seed, n, C, kind, absent, ignore, masked):
    rng = np.random.default_rng(seed)
    preds, target, mask, y, _, keep = multiclass_data(rng, n, C, kind, absent, ignore, masked)
    P = preds.double().numpy()
    if kind == "logits" and n:
        P = softmax(P)
    Y = np.eye(C, dtype=np.int64)[np.where(keep, target.numpy(), 0)] if n else np.zeros((0, C), dtype=np.int64)
    K = np.repeat(keep[:, None], C, axis=1)
    make = lambda cls, average: cls(task="multiclass", num_classes=C, average=average, ignore_index=ignore)  # noqa: E731
    _check(Y, P, K, make, preds, target, mask)


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 150),
    L=st.integers(1, 4),
    kind=st.sampled_from(["probs", "logits"]),
    ignore=st.sampled_from([None, -1]),
    masked=st.booleans(),
)
def test_multilabel_against_sklearn(seed, n, L, kind, ignore, masked):
    rng = np.random.default_rng(seed)
    preds, target, mask, prob, tgt, keep = binary_data(rng, (n, L), kind, ignore, masked)
    make = lambda cls, average: cls(task="multilabel", num_labels=L, average=average, ignore_index=ignore)  # noqa: E731
    _check(tgt, prob, keep, make, preds, target, mask)
    if not masked and ignore is None and n and all(0 < tgt[:, l].sum() < n for l in range(L)):
        m = make(dk.AUROC, "macro")
        m.update(preds, target)
        close(m.compute(), skm.roc_auc_score(tgt, quantise(prob), average="macro"), atol=EXACT)


def test_large_n_many_ties_within_bins_stays_within_1e3():
    rng = np.random.default_rng(1)
    n = 50_000
    y = rng.integers(0, 2, n)
    p = np.clip(rng.normal(0.5 + 0.1 * (2 * y - 1), 0.2), 0, 1)
    a = dk.AUROC(task="binary")
    b = dk.AveragePrecision(task="binary")
    for chunk in np.array_split(np.arange(n), 7):  # several updates: histograms add up
        a.update(torch.from_numpy(p[chunk]), torch.from_numpy(y[chunk]))
        b.update(torch.from_numpy(p[chunk]), torch.from_numpy(y[chunk]))
    close(a.compute(), skm.roc_auc_score(y, p), atol=TOL)
    close(b.compute(), skm.average_precision_score(y, p), atol=TOL)


def test_large_n_multiclass_and_multilabel_within_1e3():
    rng = np.random.default_rng(2)
    n, C = 20_000, 4
    y = rng.integers(0, C, n)
    logits = rng.normal(0, 1, (n, C)) + 0.8 * np.eye(C)[y]
    preds, target = torch.from_numpy(logits), torch.from_numpy(y)
    Y = np.eye(C, dtype=np.int64)[y]
    make = lambda cls, average: cls(task="multiclass", num_classes=C, average=average)  # noqa: E731
    _check(Y, softmax(logits), np.ones_like(Y, dtype=bool), make, preds, target, None, tol=TOL)
    close_auc = dk.AUROC(task="multiclass", num_classes=C)
    close_auc.update(preds, target)
    close(close_auc.compute(), skm.roc_auc_score(y, softmax(logits), multi_class="ovr"), atol=TOL)
    yl = rng.integers(0, 2, (n, 3))
    pl = 1 / (1 + np.exp(-(rng.normal(0, 2, (n, 3)) + yl)))  # probabilities
    make = lambda cls, average: cls(task="multilabel", num_labels=3, average=average)  # noqa: E731
    _check(yl, pl, np.ones_like(yl, dtype=bool), make, torch.from_numpy(pl), torch.from_numpy(yl), None, tol=TOL)


def test_degenerate_labels():
    a = dk.AUROC(task="multilabel", num_labels=3, average="none")
    preds = torch.tensor([[0.9, 0.1, 0.3], [0.2, 0.8, 0.6]])
    target = torch.tensor([[1, 0, 1], [0, 0, 1]])  # label 1: no positives; label 2: no negatives
    a.update(preds, target)
    out = a.compute()
    assert out[0] == 1.0 and torch.isnan(out[1]) and torch.isnan(out[2])
    m = dk.AUROC(task="multilabel", num_labels=3)
    m.update(preds, target)
    close(m.compute(), 1.0)  # undefined labels are left out of the macro mean
    e = dk.AUROC(task="binary")
    close(e.compute(), 0.0)  # nothing seen
    ap = dk.AveragePrecision(task="multilabel", num_labels=3, average="none")
    ap.update(preds, target)
    close(ap.compute(), [1.0, 0.0, 1.0])  # no positives -> 0 (sklearn)


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: dk.AUROC(task="multiclass"), "num_classes"),
        (lambda: dk.AUROC(task="binary", num_bins=0), "num_bins"),
        (lambda: dk.AveragePrecision(task="multilabel", num_labels=2, average="samples"), "average"),
    ],
)
def test_constructor_errors(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


def test_update_errors():
    m = dk.AUROC(task="multiclass", num_classes=4)
    with pytest.raises(ValueError, match="AUROC: argument 'preds'"):
        m.update(torch.rand(5, 3), torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="AUROC: argument 'preds'"):
        m.update(torch.zeros(5, 4, dtype=torch.long), torch.zeros(5, dtype=torch.long))
    m.update(torch.rand(2, 4), torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="1 invalid"):
        m.compute()


def test_thresholds_as_torchmetrics_grid():
    """thresholds=T is torchmetrics' linspace(0, 1, T): T - 1 bins (tests/metrics/test_torchmetrics_args.py
    compares the values); a list off every uniform grid is refused naming num_bins."""
    m = dk.AUROC(task="binary", thresholds=101)
    assert m.num_bins == 100
    assert dk.AUROC(task="binary", thresholds=[0.1, 0.5]).num_bins == 10
    with pytest.raises(ValueError, match="AUROC: argument 'thresholds'.*num_bins"):
        dk.AUROC(task="binary", thresholds=[0.14142135, 0.17320508, 0.27182818, 0.31415926])
