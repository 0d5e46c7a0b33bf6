"""Multidim classification inputs exactly as torchmetrics 1.9 takes them.

Channel-first scores ``[N, C, d1, ...]`` with targets ``[N, d1, ...]``,
index preds ``[N, d1, ...]``, multilabel / binary ``[N, L, d1, ...]``, and
``multidim_average="samplewise"`` (our value: the mean of torchmetrics'
per-sample vector, docs/metrics.md), on random and adversarial inputs (ties,
shapes read both ways, strided views, masks, ignore_index), against
torchmetrics' functional API (it computes in float32: atol 1e-6) and
scikit-learn on arrays flattened by numpy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn import metrics as skm
from torchmetrics.functional import classification as tmf

import d9d_kernels as dk
from d9d_kernels.metrics import class_stats as class_stats_mod
from tests.dist_utils import run_distributed
from tests.metrics._catalogue_utils import _one_thread, close, quiet  # noqa: F401

IGNORE = -100
AVERAGES = ["micro", "macro", "weighted", "none"]
# metrics with torchmetrics' multidim_average, and their functional names
SAMPLEWISE = {
    "Accuracy": "accuracy",
    "Precision": "precision",
    "Recall": "recall",
    "F1Score": "f1_score",
    "FBetaScore": "fbeta_score",
    "Specificity": "specificity",
}


def _metric(name, task, **kw):
    if name == "FBetaScore":
        kw["beta"] = 0.5
    return getattr(dk, name)(task=task, **kw)


def _tm(name, task, preds, target, **kw):
    fn = getattr(tmf, f"{task}_{SAMPLEWISE.get(name, 'jaccard_index' if name == 'JaccardIndex' else None)}")
    if name == "FBetaScore":
        kw["beta"] = 0.5
    return fn(preds, target, **kw).double()


def _run(metric, preds, target, mask=None):
    metric.update(preds, target, mask=mask)
    return metric.compute()


def _scores(rng, shape, kind):
    """Float scores: "logits", "probs" (softmax over dim 1) or "ties" (small integers: many equal maxima)."""
    if kind == "ties":
        return torch.from_numpy(rng.integers(0, 3, size=shape).astype(np.float32))
    x = torch.from_numpy(rng.normal(0, 2, size=shape).astype(np.float32))
    return x.softmax(1) if kind == "probs" else x


def _tm_target(target, mask, ignore):
    """Our mask as torchmetrics' ignore_index (torchmetrics has no mask)."""
    if mask is None:
        return target, ignore
    ig = IGNORE if ignore is None else ignore
    return torch.where(torch.broadcast_to(mask, target.shape), target, torch.full_like(target, ig)), ig


# ---------------------------------------------------------------------------
# multiclass
# ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 5),
    C=st.integers(2, 5),
    extra=st.lists(st.integers(1, 6), min_size=1, max_size=2),
    kind=st.sampled_from(["logits", "probs", "ties", "indices"]),
    ignore=st.sampled_from([None, IGNORE, 0]),
    masked=st.booleans(),
    multidim_average=st.sampled_from(["global", "samplewise"]),
)
def test_multiclass_channel_first_against_torchmetrics(seed, n, C, extra, kind, ignore, masked, multidim_average):
    rng = np.random.default_rng(seed)
    tshape = (n, *extra)
    target = torch.from_numpy(rng.integers(0, C, size=tshape))
    if ignore is not None:
        target = torch.where(torch.from_numpy(rng.random(tshape) < 0.2), torch.full_like(target, ignore), target)
    if kind == "indices":
        preds = torch.from_numpy(rng.integers(0, C, size=tshape))
    else:
        preds = _scores(rng, (n, C, *extra), kind)
    mask = torch.from_numpy(rng.random(tshape) < 0.7) if masked else None
    tm_target, tm_ignore = _tm_target(target, mask, ignore)
    sw = multidim_average == "samplewise"
    for name in SAMPLEWISE:
        for average in AVERAGES:
            ours = _run(_metric(name, "multiclass", num_classes=C, average=average, ignore_index=ignore,
                                multidim_average=multidim_average), preds, target, mask)
            exp = _tm(name, "multiclass", preds, tm_target, num_classes=C, average=average, ignore_index=tm_ignore,
                      multidim_average=multidim_average)
            close(ours, exp.mean(0) if sw else exp, atol=1e-6, msg=f"{name} {average} {multidim_average}")
    if sw:
        return
    # torchmetrics' JaccardIndex also drops an in-range ignore_index's predicted column (a difference
    # independent of the input layout): compared with out-of-range ignore_index only
    for average in AVERAGES if ignore != 0 else []:  # torchmetrics: NaN for an empty average (0/0), ours 0.0
        ours = _run(_metric("JaccardIndex", "multiclass", num_classes=C, average=average, ignore_index=ignore),
                    preds, target, mask)
        exp = tmf.multiclass_jaccard_index(preds, tm_target, C, average=average, ignore_index=tm_ignore).double()
        close(ours, torch.nan_to_num(exp, nan=0.0), atol=1e-6, msg=f"JaccardIndex {average}")
    cm = _run(dk.ConfusionMatrix(task="multiclass", num_classes=C, ignore_index=ignore), preds, target, mask)
    exp = tmf.multiclass_confusion_matrix(preds, tm_target, C, ignore_index=tm_ignore)
    assert torch.equal(cm, exp.double()), (cm, exp)
    # MCC / kappa: scikit-learn on numpy-flattened kept rows
    lab = preds.numpy() if kind == "indices" else np.moveaxis(preds.numpy(), 1, -1).reshape(-1, C).argmax(-1)
    y = tm_target.numpy().reshape(-1)
    keep = y != tm_ignore if tm_ignore is not None else np.ones_like(y, dtype=bool)
    y, p = y[keep], lab.reshape(-1)[keep]
    mcc = _run(dk.MatthewsCorrCoef(task="multiclass", num_classes=C, ignore_index=ignore), preds, target, mask)
    close(mcc, skm.matthews_corrcoef(y, p) if len(y) else 0.0, atol=1e-10, msg="MCC")
    kappa = _run(dk.CohenKappa(task="multiclass", num_classes=C, ignore_index=ignore), preds, target, mask)
    exp = quiet(skm.cohen_kappa_score, y, p, labels=list(range(C)), replace_undefined_by=0.0) if len(y) else 0.0
    close(kappa, exp, atol=1e-10, msg="kappa")


@pytest.mark.parametrize("seed", range(4))
def test_ambiguous_bct_is_read_as_torchmetrics_reads_it(seed):
    """[B, C, T] scores with T == num_classes fit both readings: torchmetrics'
    channel-first one wins; class_dim=-1 asks for channel-last explicitly."""
    g = torch.Generator().manual_seed(seed)
    B, C = 8, 5
    preds = torch.randn(B, C, C, generator=g)
    target = torch.randint(0, C, (B, C), generator=g)
    for average in AVERAGES:
        for name in ["Accuracy", "F1Score", "Recall"]:
            exp = _tm(name, "multiclass", preds, target, num_classes=C, average=average)
            close(_run(_metric(name, "multiclass", num_classes=C, average=average), preds, target), exp, atol=1e-6)
            close(_run(_metric(name, "multiclass", num_classes=C, average=average, class_dim=1), preds, target), exp,
                  atol=1e-6)
            last = _tm(name, "multiclass", preds.movedim(-1, 1), target, num_classes=C, average=average)
            close(_run(_metric(name, "multiclass", num_classes=C, average=average, class_dim=-1), preds, target),
                  last, atol=1e-6)
    # the two readings really differ on this data (else the test above proves nothing)
    assert not torch.equal(preds.argmax(1), preds.argmax(-1))


def test_channel_last_stays_available():
    """[B, T, C] with T != C: only channel-last fits, read as before without class_dim."""
    g = torch.Generator().manual_seed(0)
    preds, target = torch.randn(3, 7, 4, generator=g), torch.randint(0, 4, (3, 7), generator=g)
    exp = tmf.multiclass_accuracy(preds.movedim(-1, 1), target, 4, average="macro").double()
    close(_run(dk.Accuracy(task="multiclass", num_classes=4, average="macro"), preds, target), exp, atol=1e-6)
    close(_run(dk.Accuracy(task="multiclass", num_classes=4, average="macro", class_dim=-1), preds, target), exp,
          atol=1e-6)
    with pytest.raises(ValueError, match="Accuracy: argument 'preds'.*class_dim=1"):
        dk.Accuracy(task="multiclass", num_classes=4, class_dim=1).update(preds, target)


@pytest.mark.parametrize("view_min, block", [(1, 1), (10**9, 50), (10**9, 10**9)])
@pytest.mark.parametrize("layout", ["contiguous", "sliced", "channel_last_view", "permuted_batch"])
def test_strided_scores_every_block_size(monkeypatch, view_min, block, layout):
    """Views that do not flatten to [R, C]: blocks of one sample (a view), of
    several samples (a copy of the block) or the whole batch; adversarial
    strides (a slice, channel-last memory seen channel-first, batch permuted)."""
    monkeypatch.setattr(class_stats_mod, "SAMPLE_VIEW_SCORES", view_min)
    monkeypatch.setattr(class_stats_mod, "BLOCK_SCORES", block)
    g = torch.Generator().manual_seed(1)
    N, C, H, W = 4, 6, 5, 7
    base = torch.randn(N, C, H, 2 * W, generator=g)
    preds = {
        "contiguous": base[..., :W].contiguous(),
        "sliced": base[..., ::2],
        "channel_last_view": base[..., :W].permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2),
        "permuted_batch": base[..., :W].contiguous()[torch.tensor([2, 0, 3, 1])].transpose(0, 0)[[1, 0, 3, 2]],
    }[layout]
    target = torch.randint(0, C, (N, H, W), generator=g)
    target[0, 0, 0] = IGNORE
    mask = torch.rand(N, 1, W, generator=g) < 0.8  # broadcast over H
    tm_target, tm_ignore = _tm_target(target, mask, IGNORE)
    for average in AVERAGES:
        got = _run(dk.F1Score(task="multiclass", num_classes=C, average=average, ignore_index=IGNORE), preds, target,
                   mask)
        exp = tmf.multiclass_f1_score(preds, tm_target, C, average=average, ignore_index=tm_ignore).double()
        close(got, exp, atol=1e-6, msg=f"{layout} {average}")
    cm = _run(dk.ConfusionMatrix(task="multiclass", num_classes=C, ignore_index=IGNORE), preds, target, mask)
    assert torch.equal(cm, tmf.multiclass_confusion_matrix(preds, tm_target, C, ignore_index=tm_ignore).double())
    top2 = _run(dk.Accuracy(task="multiclass", num_classes=C, top_k=2, ignore_index=IGNORE), preds, target, mask)
    close(top2, tmf.multiclass_accuracy(preds, tm_target, C, average="micro", top_k=2, ignore_index=tm_ignore),
          atol=1e-6)


def test_nan_and_out_of_range_in_multidim_input_are_counted():
    """Data errors in channel-first input: counted on the device per row (pixel),
    as for [N, C] input; nan_strategy="ignore" leaves NaN pixels out."""
    g = torch.Generator().manual_seed(2)
    preds, target = torch.randn(2, 3, 4, 4, generator=g), torch.randint(0, 3, (2, 4, 4), generator=g)
    preds[0, 1, 2, 3] = float("nan")  # one pixel, one class score
    bad = target.clone()
    bad[1, 0, 0] = 7
    m = dk.Accuracy(task="multiclass", num_classes=3)
    m.update(preds, bad)
    with pytest.raises(ValueError, match="2 invalid"):
        m.compute()
    ign = dk.Accuracy(task="multiclass", num_classes=3, nan_strategy="ignore", multidim_average="samplewise")
    ign.update(preds, target)
    keep = torch.ones(2, 4, 4, dtype=torch.bool)
    keep[0, 2, 3] = False
    exp = tmf.multiclass_accuracy(torch.nan_to_num(preds), torch.where(keep, target, IGNORE), 3, average="micro",
                                  ignore_index=IGNORE, multidim_average="samplewise").mean()
    close(ign.compute(), exp, atol=1e-6)
    prop = dk.Accuracy(task="multiclass", num_classes=3, nan_strategy="propagate", multidim_average="samplewise")
    prop.update(preds, target)
    assert torch.isnan(prop.compute())


# ---------------------------------------------------------------------------
# binary / multilabel
# ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(2, 5),  # torchmetrics' samplewise multilabel fails on N = 1
    L=st.integers(2, 4),  # torchmetrics needs num_labels >= 2
    extra=st.lists(st.integers(1, 5), min_size=1, max_size=2),
    kind=st.sampled_from(["logits", "probs", "ints"]),
    ignore=st.sampled_from([None, -1]),
    masked=st.booleans(),
    multidim_average=st.sampled_from(["global", "samplewise"]),
    float_target=st.booleans(),
)
def test_multilabel_channel_first_against_torchmetrics(seed, n, L, extra, kind, ignore, masked, multidim_average,
                                                       float_target):
    rng = np.random.default_rng(seed)
    shape = (n, L, *extra)
    target = torch.from_numpy(rng.integers(0, 2, size=shape))
    if ignore is not None:
        target = torch.where(torch.from_numpy(rng.random(shape) < 0.2), torch.full_like(target, ignore), target)
    if kind == "ints":
        preds = torch.from_numpy(rng.integers(0, 2, size=shape))
    else:
        preds = torch.from_numpy(rng.normal(0, 3, size=shape).astype(np.float32))
        preds = preds.sigmoid() if kind == "probs" else preds
    mask = torch.from_numpy(rng.random(shape) < 0.7) if masked else None
    tm_target, tm_ignore = _tm_target(target, mask, -1 if ignore is None and masked else ignore)
    # logits are recognised from the kept entries only (ours) / all entries (torchmetrics): left-out entries
    # are given to torchmetrics as 0.5, so both see logits exactly when a kept entry lies outside [0, 1]
    tm_preds = preds if tm_ignore is None else torch.where(tm_target != tm_ignore, preds, torch.full_like(preds, 0.5))
    # float 0/1 targets (BCE labels) are accepted as torchmetrics accepts them
    ours_target = target.float() if float_target else target
    sw = multidim_average == "samplewise"
    for name in SAMPLEWISE:
        for average in ["micro", "macro", "weighted", "none"]:
            ours = _run(_metric(name, "multilabel", num_labels=L, average=average, ignore_index=ignore,
                                multidim_average=multidim_average), preds, ours_target, mask)
            exp = _tm(name, "multilabel", tm_preds, tm_target, num_labels=L, average=average, ignore_index=tm_ignore,
                      multidim_average=multidim_average)
            close(ours, exp.mean(0) if sw else exp, atol=1e-6, msg=f"multilabel {name} {average} {multidim_average}")
        # binary: the same tensors as [N, d1, ...] (label dim included)
        ours = _run(_metric(name, "binary", ignore_index=ignore, multidim_average=multidim_average), preds,
                    ours_target, mask)
        exp = _tm(name, "binary", tm_preds, tm_target, ignore_index=tm_ignore, multidim_average=multidim_average)
        close(ours, exp.mean(0) if sw else exp, atol=1e-6, msg=f"binary {name} {multidim_average}")
    if not sw:
        cm = _run(dk.ConfusionMatrix(task="multilabel", num_labels=L, ignore_index=ignore), preds, target, mask)
        exp = tmf.multilabel_confusion_matrix(tm_preds, tm_target, L, ignore_index=tm_ignore)
        assert torch.equal(cm, exp.double()), (cm, exp)


def test_multilabel_ambiguous_and_channel_last():
    """[N, T, L] with T == L: torchmetrics reads dim 1 as the labels; class_dim=-1 the last dim."""
    g = torch.Generator().manual_seed(3)
    preds, target = torch.rand(6, 3, 3, generator=g), torch.randint(0, 2, (6, 3, 3), generator=g)
    exp = tmf.multilabel_f1_score(preds, target, 3, average="none").double()
    close(_run(dk.F1Score(task="multilabel", num_labels=3, average="none"), preds, target), exp, atol=1e-6)
    last = tmf.multilabel_f1_score(preds.movedim(-1, 1), target.movedim(-1, 1), 3, average="none").double()
    close(_run(dk.F1Score(task="multilabel", num_labels=3, average="none", class_dim=-1), preds, target), last,
          atol=1e-6)
    assert not torch.allclose(exp, last)
    # [N, T, L] with T != L: channel-last, as before
    p, t = torch.rand(4, 5, 3, generator=g), torch.randint(0, 2, (4, 5, 3), generator=g)
    exp = tmf.multilabel_recall(p.movedim(-1, 1), t.movedim(-1, 1), 3, average="macro").double()
    close(_run(dk.Recall(task="multilabel", num_labels=3, average="macro"), p, t), exp, atol=1e-6)


# ---------------------------------------------------------------------------
# ranking
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("metric", ["AUROC", "AveragePrecision"])
def test_ranking_channel_first_against_torchmetrics(metric):
    """Multiclass [N, C, d] and multilabel [N, L, d]; 10k bins vs torchmetrics'
    exact curves on ~4k rows: within 1e-3 (test_ranking.py's claim)."""
    g = torch.Generator().manual_seed(4)
    C, n, d = 4, 16, 256
    preds = torch.randn(n, C, d, generator=g).softmax(1)
    target = torch.randint(0, C, (n, d), generator=g)
    fn = getattr(tmf, f"multiclass_{'auroc' if metric == 'AUROC' else 'average_precision'}")
    ours = _run(getattr(dk, metric)(task="multiclass", num_classes=C, average="none"), preds, target)
    close(ours, fn(preds, target, C, average="none").double(), atol=1e-3, msg="multiclass")
    last = _run(getattr(dk, metric)(task="multiclass", num_classes=C, average="none", class_dim=-1),
                preds.movedim(1, -1).contiguous(), target)
    close(ours, last, atol=1e-12, msg="the same as the channel-last input")
    lp = torch.rand(n, C, d, generator=g)
    lt = (torch.rand(n, C, d, generator=g) < lp).long()
    fn = getattr(tmf, f"multilabel_{'auroc' if metric == 'AUROC' else 'average_precision'}")
    ours = _run(getattr(dk, metric)(task="multilabel", num_labels=C, average="none"), lp, lt)
    close(ours, fn(lp, lt, C, average="none").double(), atol=1e-3, msg="multilabel")
    # a mask [N, 1, d] broadcast over the labels: the same as torchmetrics' ignore_index on those entries
    mask = torch.rand(n, 1, d, generator=g) < 0.6
    ours = _run(getattr(dk, metric)(task="multilabel", num_labels=C, average="none"), lp, lt, mask)
    exp = fn(lp, torch.where(mask, lt, -1), C, average="none", ignore_index=-1).double()
    close(ours, exp, atol=1e-3, msg="multilabel masked")


def test_ranking_ambiguous_shape_and_float_target():
    g = torch.Generator().manual_seed(5)
    preds = torch.randn(64, 3, 3, generator=g).softmax(1)
    target = torch.randint(0, 3, (64, 3), generator=g)
    ours = _run(dk.AUROC(task="multiclass", num_classes=3), preds, target)
    close(ours, tmf.multiclass_auroc(preds, target, 3).double(), atol=1e-3)
    with pytest.raises(TypeError, match="AUROC: argument 'target'.*integer"):
        dk.AUROC(task="multiclass", num_classes=3).update(preds, target.float())


# ---------------------------------------------------------------------------
# metadata errors (raised at update, state untouched) and constructor arguments
# ---------------------------------------------------------------------------


LONG = dict(dtype=torch.long)
MC3 = dict(task="multiclass", num_classes=3)
SW = dict(multidim_average="samplewise")


@pytest.mark.parametrize(
    "make, good, bad, arg, exc",
    [
        # float targets are dtype mistakes for class indices (1.5 and 1.0 alike: no value is read)
        (lambda: dk.Accuracy(**MC3), (torch.tensor([0, 1]), torch.tensor([0, 2])),
         (torch.tensor([0, 1]), torch.tensor([1.5, 0.0])), "target", TypeError),
        (lambda: dk.F1Score(**MC3), (torch.randn(2, 3, 4), torch.ones(2, 4, **LONG)),
         (torch.randn(2, 3, 4), torch.ones(2, 4)), "target", TypeError),
        (lambda: dk.ConfusionMatrix(**MC3), (torch.randn(2, 3), torch.ones(2, **LONG)),
         (torch.randn(2, 3), torch.ones(2, dtype=torch.float64)), "target", TypeError),
        # integer "scores" with a class dim
        (lambda: dk.Accuracy(**MC3), (torch.randn(2, 3, 4), torch.ones(2, 4, **LONG)),
         (torch.ones(2, 3, 4, **LONG), torch.ones(2, 4, **LONG)), "preds", TypeError),
        # shapes that fit neither reading
        (lambda: dk.Accuracy(**MC3), (torch.randn(2, 3, 5), torch.ones(2, 5, **LONG)),
         (torch.randn(2, 4, 5), torch.ones(2, 5, **LONG)), "preds", ValueError),
        (lambda: dk.Accuracy(task="multilabel", num_labels=3), (torch.rand(2, 3, 5), torch.ones(2, 3, 5, **LONG)),
         (torch.rand(2, 4, 5), torch.ones(2, 4, 5, **LONG)), "preds", ValueError),
        # samplewise needs sample dims
        (lambda: dk.Recall(**MC3, **SW), (torch.randn(4, 3, 2), torch.ones(4, 2, **LONG)),
         (torch.randn(4, 3), torch.ones(4, **LONG)), "preds", ValueError),
        (lambda: dk.Recall(task="binary", **SW), (torch.rand(4, 2), torch.ones(4, 2, **LONG)),
         (torch.rand(4), torch.ones(4, **LONG)), "preds", ValueError),
        (lambda: dk.Recall(task="multilabel", num_labels=2, **SW), (torch.rand(4, 2, 3), torch.ones(4, 2, 3, **LONG)),
         (torch.rand(4, 2), torch.ones(4, 2, **LONG)), "preds", ValueError),
    ],
)
def test_update_dtype_and_shape_errors_leave_state_intact(make, good, bad, arg, exc):
    m = make()
    m.update(*good)
    before = m.compute().clone()
    with pytest.raises(exc, match=f"{type(m).__name__}: argument '{arg}'"):
        m.update(*bad)
    assert torch.equal(m.compute(), before)


def test_float_binary_targets_are_accepted_and_bad_values_counted():
    """Float 0/1 targets are BCE labels (torchmetrics takes them); 1.5 is a
    data error only visible in the values: counted, raised by compute()."""
    p = torch.tensor([0.9, 0.2, 0.7, 0.1])
    a = dk.Accuracy(task="binary")
    a.update(p, torch.tensor([1.0, 0.0, 0.0, 1.0]))
    close(a.compute(), tmf.binary_accuracy(p, torch.tensor([1, 0, 0, 1])).double())
    a.update(p, torch.tensor([1.5, 0.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="1 invalid"):
        a.compute()


@pytest.mark.parametrize(
    "make, arg, exc",
    [
        (lambda: dk.Accuracy(task="binary", multidim_average="per_sample"), "multidim_average", ValueError),
        (lambda: dk.JaccardIndex(task="binary", multidim_average="samplewise"), "multidim_average", ValueError),
        (lambda: dk.MatthewsCorrCoef(task="binary", multidim_average="samplewise"), "multidim_average", ValueError),
        (lambda: dk.Accuracy(task="multiclass", num_classes=3, class_dim=2), "class_dim", ValueError),
        (lambda: dk.Accuracy(task="multiclass", num_classes=3, class_dim="last"), "class_dim", TypeError),
        (lambda: dk.AUROC(task="multiclass", num_classes=3, class_dim=0), "class_dim", ValueError),
    ],
)
def test_constructor_argument_errors(make, arg, exc):
    with pytest.raises(exc, match=f"argument '{arg}'"):
        make()


def test_group_with_channel_first_and_samplewise_members():
    """One MetricGroup: global members share one class_stats state, samplewise
    ones their own; all equal torchmetrics on a segmentation-like batch."""
    g = torch.Generator().manual_seed(6)
    C = 4
    preds, target = torch.randn(3, C, 6, 5, generator=g), torch.randint(0, C, (3, 6, 5), generator=g)
    grp = dk.MetricGroup({
        "acc": dk.Accuracy(task="multiclass", num_classes=C),
        "miou": dk.JaccardIndex(task="multiclass", num_classes=C),
        "cm": dk.ConfusionMatrix(task="multiclass", num_classes=C),
        "acc_sw": dk.Accuracy(task="multiclass", num_classes=C, multidim_average="samplewise", average="macro"),
        "f1_sw": dk.F1Score(task="multiclass", num_classes=C, multidim_average="samplewise", average="none"),
    })
    for _ in range(2):
        grp.update(preds=preds, target=target)
    out = grp.compute()
    close(out["acc"], tmf.multiclass_accuracy(preds, target, C, average="micro"), atol=1e-6)
    close(out["miou"], tmf.multiclass_jaccard_index(preds, target, C), atol=1e-6)
    assert torch.equal(out["cm"], 2 * tmf.multiclass_confusion_matrix(preds, target, C).double())
    sw = dict(multidim_average="samplewise")
    close(out["acc_sw"], tmf.multiclass_accuracy(preds, target, C, average="macro", **sw).mean(), atol=1e-6)
    close(out["f1_sw"], tmf.multiclass_f1_score(preds, target, C, average="none", **sw).mean(0), atol=1e-6)


def test_confusion_matrix_constructor_allocates_nothing_big():
    """The classification constructor only records its configuration; the
    [C, C] state's size is known from metadata before any allocation."""
    def resident_kib(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key))

    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5": reset the resident high-water mark (Linux)
            f.write("5")
        base = resident_kib("VmRSS")
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs to measure the peak")
    m = dk.ConfusionMatrix.__new__(dk.ConfusionMatrix)
    m.__init__(task="multiclass", num_classes=200_000)  # without the core's storage allocation
    sizes = {s.name: s.shape for stat in m._statistics().values() for s in stat.slots()}
    assert sizes["confmat"] == (200_000, 200_000)
    assert resident_kib("VmHWM") - base < 64 * 1024, "the constructor touched > 64 MiB"


def test_confusion_matrix_too_big_raises_value_error_with_size():
    with pytest.raises(ValueError, match=r"298(\.\d+)? GiB"):
        dk.ConfusionMatrix(task="multiclass", num_classes=200_000)


def test_multidim_updates_run_under_torch_compile_fullgraph(monkeypatch):
    """Channel-first, strided-block, label-column and samplewise updates trace
    without a graph break (no host sync, no data-dependent shape) and equal eager."""
    monkeypatch.setattr(class_stats_mod, "SAMPLE_VIEW_SCORES", 10**9)  # several copied blocks at this size
    monkeypatch.setattr(class_stats_mod, "BLOCK_SCORES", 40)
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(7)
    C = 3
    p, t = torch.randn(3, C, 4, 5, generator=g), torch.randint(0, C, (3, 4, 5), generator=g)
    lp, lt = torch.randn(3, C, 4, generator=g), torch.randint(0, 2, (3, C, 4), generator=g)

    def build():
        return [
            (dk.F1Score(task="multiclass", num_classes=C, average="macro"), (p, t)),
            (dk.Accuracy(task="multiclass", num_classes=C, multidim_average="samplewise"), (p, t)),
            (dk.Recall(task="multilabel", num_labels=C, average="none"), (lp, lt)),
            (dk.Precision(task="multilabel", num_labels=C, multidim_average="samplewise"), (lp, lt)),
            (dk.Specificity(task="binary", multidim_average="samplewise"), (lp, lt)),
        ]

    compiled, eager = build(), build()

    def step():
        for m, a in compiled:
            m.update(*a)

    torch.compile(step, fullgraph=True, backend="aot_eager")()
    for (m, _), (e, a) in zip(compiled, eager):
        e.update(*a)
        torch.testing.assert_close(m.compute(), e.compute(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("k", [2, 3])
def test_samplewise_top_k_against_torchmetrics(k):
    """Top-k accuracy / recall per sample (the two top-k definitions agree on these)."""
    g = torch.Generator().manual_seed(8)
    C = 5
    preds, target = torch.randn(4, C, 6, 3, generator=g), torch.randint(0, C, (4, 6, 3), generator=g)
    sw = dict(multidim_average="samplewise", top_k=k)
    for average in AVERAGES:
        for name, fn in [("Accuracy", tmf.multiclass_accuracy), ("Recall", tmf.multiclass_recall)]:
            got = _run(getattr(dk, name)(task="multiclass", num_classes=C, average=average, **sw), preds, target)
            close(got, fn(preds, target, C, average=average, **sw).double().mean(0), atol=1e-6, msg=f"{name} {average}")


SEG_C = 4


def _seg_data():
    g = torch.Generator().manual_seed(9)
    preds = torch.randn(7, SEG_C, 5, 6, generator=g, dtype=torch.float64)
    target = torch.randint(0, SEG_C, (7, 5, 6), generator=g)
    target[torch.rand(7, 5, 6, generator=g) < 0.1] = IGNORE
    lp = torch.rand(7, SEG_C, 5, generator=g, dtype=torch.float64)
    lt = (torch.rand(7, SEG_C, 5, generator=g, dtype=torch.float64) < lp).long()
    return preds, target, lp, lt


def _seg_metrics():
    sw = dict(multidim_average="samplewise")
    mc = dict(task="multiclass", num_classes=SEG_C, ignore_index=IGNORE)
    ml = dict(task="multilabel", num_labels=SEG_C)
    return {
        "mc": dk.MetricGroup({"acc": dk.Accuracy(**mc), "miou": dk.JaccardIndex(**mc),
                              "f1_sw": dk.F1Score(**mc, average="macro", **sw),
                              "rec_sw": dk.Recall(**mc, average="none", **sw)}),
        "ml": dk.MetricGroup({"prec": dk.Precision(**ml, average="macro"),
                              "prec_sw": dk.Precision(**ml, average="none", **sw)}),
    }


def _seg_worker(rank, world):
    preds, target, lp, lt = _seg_data()
    ms = _seg_metrics()
    rows = torch.tensor_split(torch.arange(preds.shape[0]), world)[rank]  # uneven: 7 samples
    ms["mc"].update(preds=preds[rows], target=target[rows])
    ms["ml"].update(preds=lp[rows], target=lt[rows])
    for g in ms.values():
        g.trigger_sync(dk.DistributedContext())
    for g in ms.values():
        g.wait_sync()
    return {f"{n}.{k}": v.tolist() for n, g in ms.items() for k, v in g.compute().items()}


@pytest.mark.parametrize("world", [2, 3])
def test_samplewise_and_channel_first_synced_equal_torchmetrics_on_all_samples(world):
    """Per-rank samples, one sync: the samplewise mean over every rank's samples
    (sum and count are additive) and the global values equal torchmetrics on
    the concatenated batch."""
    out = run_distributed(_seg_worker, world, timeout=180.0)
    preds, target, lp, lt = _seg_data()
    sw = dict(multidim_average="samplewise")
    mc = dict(num_classes=SEG_C, ignore_index=IGNORE)
    ref = {
        "mc.acc": tmf.multiclass_accuracy(preds, target, average="micro", **mc),
        "mc.miou": tmf.multiclass_jaccard_index(preds, target, **mc),
        "mc.f1_sw": tmf.multiclass_f1_score(preds, target, average="macro", **mc, **sw).mean(0),
        "mc.rec_sw": tmf.multiclass_recall(preds, target, average="none", **mc, **sw).mean(0),
        "ml.prec": tmf.multilabel_precision(lp, lt, SEG_C, average="macro"),
        "ml.prec_sw": tmf.multilabel_precision(lp, lt, SEG_C, average="none", **sw).mean(0),
    }
    for rank in range(world):
        assert out[rank].keys() == ref.keys()
        for k, v in ref.items():
            close(torch.tensor(out[rank][k]), v.double(), atol=1e-6, msg=f"rank {rank} {k}")


def test_shifted_lm_logits_are_read_as_views():
    """``logits[:, :-1]`` (next-token shift) does not flatten to [R, V] as a
    view: every sample's rows are one view (row stride V, class stride 1), read
    in place; results equal torchmetrics on the contiguous copy."""
    from torchmetrics.functional.text import perplexity as tm_perplexity

    g = torch.Generator().manual_seed(10)
    V = 300
    logits, tokens = torch.randn(3, 9, V, generator=g), torch.randint(0, V, (3, 9), generator=g)
    preds, target = logits[:, :-1], tokens[:, 1:]
    assert not preds.is_contiguous()
    acc = _run(dk.Accuracy(task="multiclass", num_classes=V, class_dim=-1), preds, target)
    close(acc, tmf.multiclass_accuracy(preds.contiguous().movedim(-1, 1), target, V, average="micro"), atol=1e-6)
    ppl = _run(dk.Perplexity(num_classes=V), preds, target)
    torch.testing.assert_close(ppl, tm_perplexity(preds.contiguous(), target).double(), rtol=1e-5, atol=0)
