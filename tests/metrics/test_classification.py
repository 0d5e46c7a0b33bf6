"""Classification metrics against scikit-learn (torchmetrics where sklearn has
no counterpart) on random inputs: every metric x average x task, indices /
probabilities / logits, ignore_index, masks, one class absent, all absent."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn import metrics as skm
from torchmetrics.functional import classification as tmf

import d9d_kernels as dk
from tests.metrics._catalogue_utils import _one_thread, IGNORE, binary_data, close, multiclass_data, quiet  # noqa: F401

AVERAGES = ["micro", "macro", "weighted", "none"]
SK_RATIO = {
    "Precision": skm.precision_score,
    "Recall": skm.recall_score,
    "F1Score": skm.f1_score,
    "JaccardIndex": skm.jaccard_score,
}


def _mc(cls, C, **kw):
    return getattr(dk, cls)(task="multiclass", num_classes=C, **kw)


def _run(metric, preds, target, mask):
    metric.update(preds, target, mask=mask)
    return metric.compute()


def _sk_multiclass(name, y, p, C, average, beta=None, ignore=None):
    """scikit-learn reference on the kept rows; 0.0 (zeros) when nothing is kept.
    JaccardIndex with ``ignore`` a class: torchmetrics leaves that class out of
    micro / macro (``labels=`` the classes seen, without it)."""
    if len(y) == 0:
        return np.zeros(C) if average == "none" else 0.0
    if name == "JaccardIndex" and ignore is not None and 0 <= ignore < C and average in ("micro", "macro"):
        labels = sorted((set(y.tolist()) | set(p.tolist())) - {ignore})
        return quiet(skm.jaccard_score, y, p, labels=labels, average=average, zero_division=0)
    avg = None if average == "none" else average
    labels = list(range(C)) if average == "none" else None
    if name == "Accuracy":
        if average == "micro":
            return skm.accuracy_score(y, p)
        return quiet(skm.recall_score, y, p, labels=labels, average=avg, zero_division=0)
    if name == "FBetaScore":
        return quiet(skm.fbeta_score, y, p, beta=beta, labels=labels, average=avg, zero_division=0)
    return quiet(SK_RATIO[name], y, p, labels=labels, average=avg, zero_division=0)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 40),
    C=st.integers(2, 6),
    kind=st.sampled_from(["indices", "probs", "logits", "probs_f32"]),
    absent=st.sampled_from(["none", "none", "one", "all"]),
    ignore=st.sampled_from([None, IGNORE, 0]),
    masked=st.booleans(),
    shape3d=st.booleans(),
)
def test_multiclass_against_sklearn(seed, n, C, kind, absent, ignore, masked, shape3d):
    rng = np.random.default_rng(seed)
    preds, target, mask, y, p, _ = multiclass_data(rng, n, C, kind, absent, ignore, masked, shape3d)
    # [B, T, C] scores: channel-last, explicitly (T == C would otherwise be read channel-first, as torchmetrics does)
    lay = dict(class_dim=-1) if preds.dim() == 3 else {}
    for name in ["Accuracy", "Precision", "Recall", "F1Score", "JaccardIndex"]:
        for average in AVERAGES:
            got = _run(_mc(name, C, average=average, ignore_index=ignore, **lay), preds, target, mask)
            close(got, _sk_multiclass(name, y, p, C, average, ignore=ignore), msg=f"{name} {average}")
    for average in AVERAGES:
        got = _run(_mc("FBetaScore", C, beta=0.5, average=average, ignore_index=ignore, **lay), preds, target, mask)
        close(got, _sk_multiclass("FBetaScore", y, p, C, average, beta=0.5), msg=f"FBeta {average}")
        # specificity: no sklearn counterpart -> torchmetrics on the kept rows
        got = _run(_mc("Specificity", C, average=average, ignore_index=ignore, **lay), preds, target, mask)
        if len(y):  # torchmetrics computes in float32
            exp = tmf.multiclass_specificity(torch.from_numpy(p), torch.from_numpy(y), C, average=average).double()
            close(got, exp, atol=1e-6, msg=f"Specificity {average}")
        else:
            close(got, np.zeros(C) if average == "none" else 0.0, msg=f"Specificity {average}")
    mcc = _run(_mc("MatthewsCorrCoef", C, ignore_index=ignore, **lay), preds, target, mask)
    close(mcc, skm.matthews_corrcoef(y, p) if len(y) else 0.0, msg="MCC")
    for w in [None, "linear", "quadratic"]:
        kappa = _run(_mc("CohenKappa", C, weights=w, ignore_index=ignore, **lay), preds, target, mask)
        exp = quiet(skm.cohen_kappa_score, y, p, labels=list(range(C)), weights=w, replace_undefined_by=0.0) if len(y) else 0.0
        close(kappa, exp, atol=1e-10, msg=f"kappa {w}")
    for norm in [None, "true", "pred", "all"]:
        cm = _run(_mc("ConfusionMatrix", C, normalize=norm, ignore_index=ignore, **lay), preds, target, mask)
        exp = quiet(skm.confusion_matrix, y, p, labels=list(range(C)), normalize=norm) if len(y) else np.zeros((C, C))
        if norm is None:  # counts: exact
            assert np.array_equal(cm.numpy(), exp), (cm, exp)
        else:
            close(cm, exp, msg=f"confmat {norm}")


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 40),
    C=st.integers(3, 7),
    k=st.integers(2, 3),
    ignore=st.sampled_from([None, IGNORE]),
    masked=st.booleans(),
)
def test_multiclass_top_k_against_torchmetrics(seed, n, C, k, ignore, masked):
    rng = np.random.default_rng(seed)
    preds, target, mask, y, _, keep = multiclass_data(rng, n, C, "logits", "none", ignore, masked)
    kept = preds[torch.from_numpy(keep)]
    yt = torch.from_numpy(y)
    got = _run(_mc("Accuracy", C, top_k=k, ignore_index=ignore), preds, target, mask)
    exp = skm.top_k_accuracy_score(y, kept.numpy(), k=k, labels=list(range(C))) if len(y) else 0.0
    close(got, exp, msg="top-k accuracy vs sklearn")
    for name, fn in [("Accuracy", tmf.multiclass_accuracy), ("Recall", tmf.multiclass_recall)]:
        for average in AVERAGES:
            got = _run(_mc(name, C, top_k=k, average=average, ignore_index=ignore), preds, target, mask)
            if len(y):  # torchmetrics computes in float32
                close(got, fn(kept, yt, C, average=average, top_k=k).double(), atol=1e-6, msg=f"top-{k} {name} {average}")
            else:
                close(got, np.zeros(C) if average == "none" else 0.0, msg=f"top-{k} {name} {average}")
    # precision with top_k: every class of a row's top-k counts as predicted (documented; torchmetrics >= 1.6
    # instead predicts one class per row) -> numpy reference of that definition
    topk = np.argsort(-kept.numpy(), axis=1, kind="stable")[:, :k]
    in_top = np.zeros((len(y), C), dtype=bool)
    np.put_along_axis(in_top, topk, True, axis=1)
    hit = in_top & (np.arange(C)[None] == y[:, None])
    tp, pred, sup = hit.sum(0), in_top.sum(0), np.bincount(y, minlength=C)
    per = np.where(pred > 0, tp / np.maximum(pred, 1), 0.0)
    present = sup > 0
    exp = {
        "micro": tp.sum() / max(pred.sum(), 1),
        "macro": per[present].mean() if present.any() else 0.0,
        "weighted": (per * sup).sum() / sup.sum() if sup.sum() else 0.0,
        "none": per,
    }
    for average in AVERAGES:
        got = _run(_mc("Precision", C, top_k=k, average=average, ignore_index=ignore), preds, target, mask)
        close(got, exp[average], msg=f"top-{k} Precision {average}")


def _sk_binary(y, p):
    """All binary references on kept entries (0.0 when empty)."""
    if len(y) == 0:
        return None
    z = dict(zero_division=0)
    return {
        "Accuracy": skm.accuracy_score(y, p),
        "Precision": quiet(skm.precision_score, y, p, **z),
        "Recall": quiet(skm.recall_score, y, p, **z),
        "F1Score": quiet(skm.f1_score, y, p, **z),
        "FBetaScore": quiet(skm.fbeta_score, y, p, beta=2.0, **z),
        "JaccardIndex": quiet(skm.jaccard_score, y, p, **z),
        "Specificity": quiet(skm.recall_score, y, p, pos_label=0, **z),
    }


def _binary_metric(name, task, **kw):
    if name == "FBetaScore":
        kw["beta"] = 2.0
    return getattr(dk, name)(task=task, **kw)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 50),
    kind=st.sampled_from(["ints", "probs", "logits"]),
    threshold=st.sampled_from([0.5, 0.3]),
    ignore=st.sampled_from([None, -1]),
    masked=st.booleans(),
)
def test_binary_against_sklearn(seed, n, kind, threshold, ignore, masked):
    rng = np.random.default_rng(seed)
    preds, target, mask, prob, tgt, keep = binary_data(rng, (n,), kind, ignore, masked)
    y, p = tgt[keep], (prob[keep] > threshold).astype(np.int64)
    ref = _sk_binary(y, p)
    kw = dict(threshold=threshold, ignore_index=ignore)
    for name in ["Accuracy", "Precision", "Recall", "F1Score", "FBetaScore", "JaccardIndex", "Specificity"]:
        got = _run(_binary_metric(name, "binary", **kw), preds, target, mask)
        close(got, 0.0 if ref is None else ref[name], msg=name)
    close(_run(dk.MatthewsCorrCoef(task="binary", **kw), preds, target, mask), skm.matthews_corrcoef(y, p) if len(y) else 0.0)
    kappa = quiet(skm.cohen_kappa_score, y, p, labels=[0, 1], replace_undefined_by=0.0) if len(y) else 0.0
    close(_run(dk.CohenKappa(task="binary", **kw), preds, target, mask), kappa, atol=1e-10)
    cm = _run(dk.ConfusionMatrix(task="binary", **kw), preds, target, mask)
    assert np.array_equal(cm.numpy(), skm.confusion_matrix(y, p, labels=[0, 1]) if len(y) else np.zeros((2, 2)))


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(0, 30),
    L=st.integers(1, 5),
    kind=st.sampled_from(["ints", "probs", "logits"]),
    ignore=st.sampled_from([None, -1]),
    masked=st.booleans(),
)
def test_multilabel_against_sklearn(seed, n, L, kind, ignore, masked):
    """Per label: sklearn binary scores on that label's kept entries; micro:
    the binary score of all kept entries together; weighted: by positives."""
    rng = np.random.default_rng(seed)
    preds, target, mask, prob, tgt, keep = binary_data(rng, (n, L), kind, ignore, masked)
    per = [_sk_binary(tgt[keep[:, l], l], (prob[keep[:, l], l] > 0.5).astype(np.int64)) for l in range(L)]
    allk = _sk_binary(tgt[keep], (prob[keep] > 0.5).astype(np.int64))
    support = np.array([(tgt[keep[:, l], l] == 1).sum() for l in range(L)], dtype=np.float64)
    for name in ["Accuracy", "Precision", "Recall", "F1Score", "FBetaScore", "JaccardIndex", "Specificity"]:
        vals = np.array([0.0 if r is None else r[name] for r in per])
        exp = {
            "micro": 0.0 if allk is None else allk[name],
            "macro": vals.mean(),
            "weighted": (vals * support).sum() / support.sum() if support.sum() else 0.0,
            "none": vals,
        }
        for average in AVERAGES:
            got = _run(_binary_metric(name, "multilabel", num_labels=L, average=average, ignore_index=ignore), preds, target, mask)
            close(got, exp[average], msg=f"{name} {average}")
    cm = _run(dk.ConfusionMatrix(task="multilabel", num_labels=L, ignore_index=ignore), preds, target, mask)
    exp = np.stack([skm.confusion_matrix(tgt[keep[:, l], l], (prob[keep[:, l], l] > 0.5).astype(int), labels=[0, 1])
                    if keep[:, l].any() else np.zeros((2, 2)) for l in range(L)])
    assert np.array_equal(cm.numpy(), exp)
    # MCC of the summed 2x2 matrices (torchmetrics' multilabel MCC)
    mcc = _run(dk.MatthewsCorrCoef(task="multilabel", num_labels=L, ignore_index=ignore), preds, target, mask)
    allp = (prob[keep] > 0.5).astype(np.int64)
    close(mcc, skm.matthews_corrcoef(tgt[keep], allp) if keep.any() else 0.0)


def test_multiclass_bt_layout_and_128k_vocabulary():
    """[B, T, V] logits with a 128k vocabulary: O(C) state, small N."""
    V = 131_072
    logits = torch.randn(2, 3, V)
    target = torch.randint(0, V, (2, 3))
    target[0, 0] = logits[0, 0].argmax()
    acc = dk.Accuracy(task="multiclass", num_classes=V)
    f1 = dk.F1Score(task="multiclass", num_classes=V, average="macro")
    g = dk.MetricGroup({"acc": acc, "f1": f1})
    g.update(preds=logits, target=target)
    out = g.compute()
    p = logits.reshape(-1, V).argmax(-1).numpy()
    y = target.reshape(-1).numpy()
    close(out["acc"], skm.accuracy_score(y, p))
    close(out["f1"], skm.f1_score(y, p, average="macro", zero_division=0))
    total = sum(b.numel() for b in g._storage.local.values())
    assert total < 4 * V + 64, f"state must stay O(C) without a ConfusionMatrix, got {total} floats"


@pytest.mark.parametrize(
    "make, arg, exc",
    [
        (lambda: dk.Accuracy(task="multi"), "task", ValueError),
        (lambda: dk.Accuracy(task="multiclass"), "num_classes", ValueError),
        (lambda: dk.Precision(task="multiclass", num_classes=5, average="avg"), "average", ValueError),
        (lambda: dk.Recall(task="multiclass", num_classes=5, top_k=6), "top_k", ValueError),
        (lambda: dk.F1Score(task="binary", top_k=2), "top_k", ValueError),
        (lambda: dk.Accuracy(task="multilabel"), "num_labels", ValueError),
        (lambda: dk.Accuracy(task="binary", threshold=1.5), "threshold", ValueError),
        (lambda: dk.FBetaScore(task="binary", beta=0.0), "beta", ValueError),
        (lambda: dk.ConfusionMatrix(task="binary", normalize="rows"), "normalize", ValueError),
        (lambda: dk.CohenKappa(task="multilabel"), "task", ValueError),
        (lambda: dk.MatthewsCorrCoef(task="multiclass", num_classes=4, top_k=2), "top_k", ValueError),
        (lambda: dk.Accuracy(task="binary", ignore_index="pad"), "ignore_index", TypeError),
        (lambda: dk.Accuracy(task="binary", nan_strategy="skip"), "nan_strategy", ValueError),
    ],
)
def test_constructor_errors_name_metric_and_argument(make, arg, exc):
    with pytest.raises(exc, match=arg):
        make()


@pytest.mark.parametrize(
    "metric, preds, target, mask, arg",
    [
        (lambda: dk.Accuracy(task="multiclass", num_classes=5), torch.randn(4, 6), torch.zeros(4, dtype=torch.long), None, "preds"),
        (lambda: dk.Accuracy(task="multiclass", num_classes=5), torch.zeros(3, dtype=torch.long), torch.zeros(4, dtype=torch.long), None, "preds"),
        (lambda: dk.Accuracy(task="multiclass", num_classes=5, top_k=2), torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long), None, "preds"),
        (lambda: dk.Accuracy(task="binary"), torch.rand(4), torch.zeros(5, dtype=torch.long), None, "preds"),
        (lambda: dk.Accuracy(task="multilabel", num_labels=3), torch.rand(4, 2), torch.zeros(4, 2, dtype=torch.long), None, "preds"),
        (lambda: dk.Accuracy(task="binary"), torch.rand(4), torch.zeros(4, dtype=torch.long), torch.ones(4, dtype=torch.int64), "mask"),
        (lambda: dk.Accuracy(task="binary"), torch.rand(4), torch.zeros(4, dtype=torch.long), torch.ones(3, dtype=torch.bool), "mask"),
        (lambda: dk.Accuracy(task="binary"), [0.5], torch.zeros(1, dtype=torch.long), None, "preds"),
    ],
)
def test_update_metadata_errors_raise_immediately(metric, preds, target, mask, arg):
    m = metric()
    with pytest.raises((ValueError, TypeError), match=f"Accuracy: argument '{arg}'"):
        m.update(preds, target, mask=mask)


def test_data_errors_are_counted_and_raised_by_compute():
    m = dk.Accuracy(task="multiclass", num_classes=3)
    m.update(torch.tensor([0, 1, 2, 1]), torch.tensor([0, 3, -2, 1]))  # no raise here
    with pytest.raises(ValueError, match="2 invalid"):
        m.compute()
    b = dk.Precision(task="binary")
    b.update(torch.tensor([0.2, 0.9]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="1 invalid"):
        b.compute()


def test_nan_strategy():
    logits = torch.tensor([[2.0, 0.0], [float("nan"), 1.0], [0.0, 3.0]])
    target = torch.tensor([0, 1, 0])
    err = dk.Accuracy(task="multiclass", num_classes=2)
    err.update(logits, target)
    with pytest.raises(ValueError, match="1 invalid"):
        err.compute()
    ign = dk.Accuracy(task="multiclass", num_classes=2, nan_strategy="ignore")
    ign.update(logits, target)
    close(ign.compute(), 0.5)  # the NaN row is left out
    prop = dk.Accuracy(task="multiclass", num_classes=2, nan_strategy="propagate")
    prop.update(logits, target)
    assert torch.isnan(prop.compute())
    # out-of-range targets raise under every strategy
    ign.update(torch.tensor([[1.0, 0.0]]), torch.tensor([5]))
    with pytest.raises(ValueError, match="1 invalid"):
        ign.compute()
    bprop = dk.F1Score(task="binary", nan_strategy="propagate")
    bprop.update(torch.tensor([0.2, float("nan")]), torch.tensor([0, 1]))
    assert torch.isnan(bprop.compute())


def test_defaults_follow_torchmetrics():
    assert dk.Accuracy(task="multiclass", num_classes=3).average == "micro"
    assert dk.F1Score(task="multiclass", num_classes=3).average == "micro"
    assert dk.JaccardIndex(task="multiclass", num_classes=3).average == "macro"
    assert dk.AUROC(task="multiclass", num_classes=3).average == "macro"
    assert dk.Accuracy(task="binary").threshold == 0.5


def test_reset_and_empty_give_zero():
    m = dk.F1Score(task="multiclass", num_classes=4, average="none")
    close(m.compute(), np.zeros(4))
    m.update(torch.tensor([1, 2]), torch.tensor([1, 2]))
    close(m.compute(), [0, 1, 1, 0])
    m.reset()
    close(m.compute(), np.zeros(4))


TM_FUNCS = {
    "Accuracy": "accuracy",
    "Precision": "precision",
    "Recall": "recall",
    "F1Score": "f1_score",
    "Specificity": "specificity",
    "JaccardIndex": "jaccard_index",
}


@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 40),
    C=st.integers(2, 6),
    task=st.sampled_from(["multiclass", "multilabel"]),
    masked=st.booleans(),
)
def test_against_torchmetrics(seed, n, C, task, masked):
    """Averaging conventions follow torchmetrics 1.9 (masked elements are given
    torchmetrics as ignore_index targets; it computes in float32)."""
    rng = np.random.default_rng(seed)
    if task == "multiclass":
        preds, target, mask, *_ = multiclass_data(rng, n, C, "logits", "none", IGNORE, masked)
        kw = dict(num_classes=C)
    else:
        preds, target, mask, *_ = binary_data(rng, (n, C), "probs", -1, masked)
        kw = dict(num_labels=C)
    ignore = IGNORE if task == "multiclass" else -1
    tm_target = target if mask is None else torch.where(mask, target, torch.full_like(target, ignore))
    for name, fn in TM_FUNCS.items():
        for average in AVERAGES:
            ours = getattr(dk, name)(task=task, average=average, ignore_index=ignore, **kw)
            ours.update(preds, target, mask=mask)
            exp = getattr(tmf, f"{task}_{fn}")(preds.float(), tm_target, *kw.values(), average=average, ignore_index=ignore)
            # torchmetrics' JaccardIndex gives NaN for an empty average (0/0); our convention is 0.0
            close(ours.compute(), torch.nan_to_num(exp.double(), nan=0.0), atol=1e-6, msg=f"{task} {name} {average}")


def test_input_layouts():
    """Float class indices, [B, T] indices, bool binary inputs, [B, T, L] multilabel."""
    a = dk.Accuracy(task="multiclass", num_classes=3)
    a.update(torch.tensor([0.0, 2.0, 1.0, 1.0]), torch.tensor([0, 1, 1, 1]))
    close(a.compute(), 0.75)
    b = dk.Accuracy(task="multiclass", num_classes=3)
    b.update(torch.tensor([[0, 2], [1, 1]]), torch.tensor([[0, 1], [1, 1]]), mask=torch.tensor([True, False]))
    close(b.compute(), 1.0)  # mask [T] broadcast over [B, T]: column 1 (the miss) dropped
    c = dk.Recall(task="binary")
    c.update(torch.tensor([True, False, True]), torch.tensor([True, True, False]))
    close(c.compute(), 0.5)
    p = torch.rand(2, 5, 3)
    t = torch.randint(0, 2, (2, 5, 3))
    d = dk.F1Score(task="multilabel", num_labels=3, average="none")
    d.update(p, t)
    e = dk.F1Score(task="multilabel", num_labels=3, average="none")
    e.update(p.reshape(10, 3), t.reshape(10, 3))
    assert torch.equal(d.compute(), e.compute())
    f = dk.Accuracy(task="multiclass", num_classes=3)
    f.update(torch.tensor([0.5, 1.0]), torch.tensor([0, 1]))  # non-integral class index: bad, counted
    with pytest.raises(ValueError, match="1 invalid"):
        f.compute()


#: configurations whose counting or formula an argument selects (multiclass top_k > 1: one prediction per
#: row; JaccardIndex's ignore_index of a class), each with the plain configuration of the same class
SELECTED = [
    (dk.Specificity, {"top_k": 2}),
    (dk.StatScores, {"top_k": 2}),
    (dk.HammingDistance, {"top_k": 2}),
    (dk.NegativePredictiveValue, {"top_k": 2}),
    (dk.JaccardIndex, {"ignore_index": 1}),
]


@pytest.mark.parametrize("cls,kw", SELECTED, ids=[f"{c.__name__}-{next(iter(k))}" for c, k in SELECTED])
def test_argument_selected_configurations_are_the_public_class(cls, kw):
    """The instance is the public class itself, through pickle, deepcopy, clone and a group,
    and a merge / load across configurations says which state differs (not the class)."""
    import copy
    import pickle

    C = 4
    m = cls(task="multiclass", num_classes=C, **kw)
    assert type(m) is cls
    for c in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m), m.clone()):
        assert type(c) is cls
    g = dk.MetricGroup({"m": cls(task="multiclass", num_classes=C, **kw)})
    assert type(g["m"]) is cls
    assert type(pickle.loads(pickle.dumps(g))["m"]) is cls
    plain = cls(task="multiclass", num_classes=C)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.merge_state: state 'stats' differs"):
        m.merge_state(plain)
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.load_state_dict: checkpoint schema"):
        m.load_state_dict(plain.state_dict())
    with pytest.raises(ValueError, match=rf"^{cls.__name__}\.merge_state: expected a {cls.__name__}, got Accuracy"):
        m.merge_state(dk.Accuracy(task="multiclass", num_classes=C))
