"""Bad inputs are counted by cause on the device, under every nan_strategy:
a target (class index) out of range, or a NaN/Inf prediction with a good
target (the target is judged first). Expected counts come from plain torch
on the inputs; every family with a two-count ``bad`` slot is covered, alone
and inside a group (the fused compute path)."""

from __future__ import annotations

import pytest
import torch

import d9d_kernels as dk

C, N = 5, 64
STRATEGIES = ["error", "ignore", "propagate"]


def _inputs(seed: int, rows: tuple[int, ...] = (N, C)):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(*rows, generator=g)
    t = torch.randint(-2, C + 2, rows[:1], generator=g)  # some below 0 / past C
    p[::7, 1] = float("nan")
    p[3::11, 2] = float("inf")
    p[5, :] = float("-inf")  # a row of only -Inf: bad scores for class rows
    t[::9] = -100  # ignored whatever the row holds
    return p, t


def _class_rows_expected(p, t, ignore=-100):
    kept = t != ignore
    t_ok = (t >= 0) & (t < p.shape[-1])
    rows_ok = (p < float("inf")).all(-1) & (p > float("-inf")).any(-1)  # -Inf alone is a masked logit
    return {"target_out_of_range": int((kept & ~t_ok).sum()), "nonfinite_preds": int((kept & t_ok & ~rows_ok).sum())}


def _check(m, want, nan_strategy):
    assert m.bad_input_counts() == want
    raising = want["target_out_of_range"] + (want["nonfinite_preds"] if nan_strategy == "error" else 0)
    assert raising > 0
    with pytest.raises(ValueError) as e:
        m.compute()
    msg = str(e.value)
    assert f"{raising} invalid" in msg
    assert f"target_out_of_range={want['target_out_of_range']}, nonfinite_preds={want['nonfinite_preds']}" in msg


@pytest.mark.parametrize("nan_strategy", STRATEGIES)
def test_multiclass_scores_and_indices(nan_strategy):
    p, t = _inputs(0)
    want = _class_rows_expected(p, t)
    assert min(want.values()) > 0
    m = dk.Accuracy(task="multiclass", num_classes=C, ignore_index=-100, nan_strategy=nan_strategy)
    m.update(p, t)
    _check(m, want, nan_strategy)
    # index preds out of range are label mistakes as well
    idx = torch.randint(0, C, (N,))
    idx[::5] = C + 3
    m = dk.Accuracy(task="multiclass", num_classes=C, ignore_index=-100, nan_strategy=nan_strategy)
    m.update(idx, t)
    kept = t != -100
    n_bad = int((kept & ~((t >= 0) & (t < C) & (idx < C))).sum())
    _check(m, {"target_out_of_range": n_bad, "nonfinite_preds": 0}, nan_strategy)


@pytest.mark.parametrize("nan_strategy", STRATEGIES)
def test_perplexity_with_and_without_num_classes(nan_strategy):
    p, t = _inputs(1)
    want = _class_rows_expected(p, t)
    for num_classes in (None, C):
        m = dk.Perplexity(ignore_index=-100, num_classes=num_classes, nan_strategy=nan_strategy)
        m.update(p[None], t[None])
        _check(m, want, nan_strategy)


@pytest.mark.parametrize("nan_strategy", STRATEGIES)
def test_binary_multilabel_and_ranking(nan_strategy):
    g = torch.Generator().manual_seed(2)
    p = torch.rand(N, 3, generator=g)
    p[::6, 0] = float("nan")
    p[1::10, 2] = float("-inf")
    t = torch.randint(-1, 3, (N, 3), generator=g)  # -1 ignored, 2 bad
    kept, t_ok = t != -1, (t == 0) | (t == 1)
    want = {"target_out_of_range": int((kept & ~t_ok).sum()),
            "nonfinite_preds": int((kept & t_ok & ~torch.isfinite(p)).sum())}
    assert min(want.values()) > 0
    for m in (dk.Accuracy(task="multilabel", num_labels=3, ignore_index=-1, nan_strategy=nan_strategy),
              dk.AUROC(task="multilabel", num_labels=3, num_bins=16, ignore_index=-1, nan_strategy=nan_strategy)):
        m.update(p, t)
        _check(m, want, nan_strategy)
    rows_ok = torch.isfinite(p).all(1)
    tc = torch.randint(-1, 5, (N,), generator=g)
    kc, tc_ok = tc != -1, (tc >= 0) & (tc < 3)
    m = dk.AUROC(task="multiclass", num_classes=3, num_bins=16, ignore_index=-1, nan_strategy=nan_strategy)
    m.update(p, tc)
    _check(m, {"target_out_of_range": int((kc & ~tc_ok).sum()), "nonfinite_preds": int((kc & tc_ok & ~rows_ok).sum())},
           nan_strategy)


@pytest.mark.parametrize("nan_strategy", STRATEGIES)
def test_group_members_fused_path(nan_strategy):
    p, t = _inputs(3)
    want = _class_rows_expected(p, t)
    g = dk.MetricGroup({
        "loss": dk.WeightedMeanMetric(),
        "acc": dk.Accuracy(task="multiclass", num_classes=C, ignore_index=-100, nan_strategy=nan_strategy),
        "f1": dk.F1Score(task="multiclass", num_classes=C, average="macro", ignore_index=-100, nan_strategy=nan_strategy),
    })
    g.update(preds=p, target=t)
    g["loss"].update(torch.tensor(1.0))
    counts = g.bad_input_counts()
    assert counts["acc"] == want and counts["f1"] == want
    with pytest.raises(ValueError, match=r"MetricGroup\['acc'\] \(Accuracy\).*target_out_of_range="):
        g.compute()
    with pytest.raises(ValueError, match=r"MetricGroup\['acc'\] \(Accuracy\).*nonfinite_preds="):
        g.compute_to_host().result()


def test_nan_rows_left_out_or_propagated_but_counted():
    """Only NaN scores (targets all good): "ignore" computes on the rest,
    "propagate" gives NaN, "error" raises; all count the same rows."""
    p, t = _inputs(4)
    t = t.clamp(0, C - 1)
    want = _class_rows_expected(p, t)
    assert want["target_out_of_range"] == 0 and want["nonfinite_preds"] > 0
    good = (p < float("inf")).all(-1) & (p > float("-inf")).any(-1)
    ref = (p[good].argmax(-1) == t[good]).double().mean()
    for s in STRATEGIES:
        m = dk.Accuracy(task="multiclass", num_classes=C, nan_strategy=s)
        m.update(p, t)
        assert m.bad_input_counts() == want
        if s == "error":
            with pytest.raises(ValueError, match="nonfinite_preds"):
                m.compute()
        elif s == "ignore":
            assert m.compute().item() == pytest.approx(ref.item())
        else:
            assert m.compute().isnan()


def test_calibration_error_counts_by_cause():
    p, t = _inputs(5)
    p = p.softmax(-1).nan_to_num(0.5)
    p[::7, 1] = float("nan")
    want = _class_rows_expected(p, t)
    m = dk.CalibrationError(task="multiclass", num_classes=C, ignore_index=-100, nan_strategy="ignore")
    m.update(p, t)
    assert m.bad_input_counts() == want
