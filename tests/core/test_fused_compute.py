"""Fused group compute (d9d_kernels/metrics/formulas/fused.py): one pass per
formula family must give exactly the per-member ``compute()`` values, local
and synced, on ``compute()`` and ``compute_to_host()``, raise the same
bad-input errors, and match independent references (scikit-learn, numpy)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, f1_score, precision_score, recall_score

import d9d_kernels as dk
from tests.dist_utils import run_distributed
from tests.metrics._catalogue_utils import _one_thread  # noqa: F401

C = 6


def _members():
    mc = dict(task="multiclass", num_classes=C)
    return {
        "mean": dk.WeightedMeanMetric(), "mean_ignore": dk.WeightedMeanMetric(nan_strategy="ignore"),
        "sum": dk.SumMetric(), "sum2": dk.SumMetric(), "max": dk.MaxMetric(), "min": dk.MinMetric(),
        "acc": dk.Accuracy(**mc), "acc_macro": dk.Accuracy(**mc, average="macro"),
        "top3": dk.Accuracy(**mc, top_k=3), "f1": dk.F1Score(**mc, average="macro"),
        "f1_none": dk.F1Score(**mc, average="none"), "f1_weighted": dk.F1Score(**mc, average="weighted"),
        "p": dk.Precision(**mc, average="macro"), "r": dk.Recall(**mc, average="macro"),
        "f1_prop": dk.F1Score(**mc, average="macro", nan_strategy="propagate"),
        "fbeta": dk.FBetaScore(**mc, beta=2.0, average="macro"),
        "spec": dk.Specificity(**mc, average="macro"), "jac": dk.JaccardIndex(**mc),
        "f1_ign": dk.F1Score(**mc, average="macro", ignore_index=0),
        "cm": dk.ConfusionMatrix(**mc), "cm_prop": dk.ConfusionMatrix(**mc, nan_strategy="propagate"),
        "cm_true": dk.ConfusionMatrix(**mc, normalize="true"), "kappa": dk.CohenKappa(**mc),  # no family: their own compute()
        "ppl": dk.Perplexity(), "auroc": dk.AUROC(**mc, num_bins=32),
    }


def _feed(g, seed, steps=3):
    gen = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(steps):
        n = 40
        logits = torch.randn(n, C, generator=gen)
        target = torch.randint(0, C, (n,), generator=gen)
        target[target == 5] = 4  # class 5 never a target: absent-class rules
        x, w = torch.randn(n, generator=gen), torch.rand(n, generator=gen)
        for k in ("mean", "mean_ignore", "sum"):
            g[k].update(x, weights=w)
        g["sum2"].update(x)
        g["max"].update(x)
        g["min"].update(x)
        g.update(preds=logits, target=target)
        data.append((logits, target, x, w))
    return data


def _per_member(g):
    return {n: m.compute() for n, m in g.items()}


@pytest.mark.parametrize("seed", [0, 1])
def test_fused_compute_equals_per_member_and_references(seed):
    g = dk.MetricGroup(_members())
    data = _feed(g, seed)
    got, want = g.compute(), _per_member(g)
    assert list(got) == list(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, equal_nan=True, msg=n)
    host = g.compute_to_host().result()
    for n in want:
        np.testing.assert_array_equal(np.asarray(host[n]), want[n].numpy(), err_msg=n)
    plan = g.__dict__["_fused_plan"]
    assert {"cm_true", "kappa", "ppl", "auroc"} == set(plan.single), "the op and the families cover the rest"

    # independent references
    p = torch.cat([lg.argmax(1) for lg, *_ in data]).numpy()
    t = torch.cat([tg for _, tg, *_ in data]).numpy()
    x = torch.cat([d[2] for d in data]).numpy().astype(np.float64)
    w = torch.cat([d[3] for d in data]).numpy().astype(np.float64)
    assert got["acc"].item() == pytest.approx(accuracy_score(t, p), abs=1e-12)
    assert got["f1"].item() == pytest.approx(f1_score(t, p, average="macro", zero_division=0), abs=1e-12)
    assert got["p"].item() == pytest.approx(precision_score(t, p, average="macro", zero_division=0), abs=1e-12)
    assert got["r"].item() == pytest.approx(recall_score(t, p, average="macro", zero_division=0), abs=1e-12)
    np.testing.assert_allclose(got["f1_none"].numpy(), f1_score(t, p, average=None, labels=range(C), zero_division=0),
                               atol=1e-12)
    assert got["mean"].item() == pytest.approx(np.average(x, weights=w), rel=1e-9)
    assert got["sum"].item() == pytest.approx(np.sum(x * w), rel=1e-9, abs=1e-9)
    assert got["max"].item() == pytest.approx(x.max()) and got["min"].item() == pytest.approx(x.min())


def test_fused_compute_empty_and_reset():
    g = dk.MetricGroup(_members())
    got, want = g.compute(), _per_member(g)  # nothing seen: NaN means, zero scores, -inf max
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, equal_nan=True, msg=n)
    _feed(g, 3)
    g.reset()
    got, want = g.compute(), _per_member(g)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, equal_nan=True, msg=n)


def test_bad_input_raises_the_members_error():
    g = dk.MetricGroup({"mean": dk.WeightedMeanMetric(), "acc": dk.Accuracy(task="multiclass", num_classes=C),
                        "sum": dk.SumMetric(nan_strategy="error")})
    g["mean"].update(torch.tensor([1.0]))
    g["sum"].update(torch.tensor([float("nan")]))
    with pytest.raises(ValueError) as fused_err:
        g.compute()
    with pytest.raises(ValueError) as own_err:
        g["sum"].compute()
    assert str(fused_err.value) == str(own_err.value)
    with pytest.raises(ValueError, match="sum"):
        g.compute_to_host().result()
    g.reset()
    g.update(preds=torch.tensor([0, 1]), target=torch.tensor([0, C + 3]))  # out-of-range target
    with pytest.raises(ValueError, match="acc"):
        g.compute()


def _synced_world(rank, world):
    g = dk.MetricGroup(_members())
    _feed(g, 10 + rank)
    g.trigger_sync()
    g.wait_sync()
    got, want = g.compute(), _per_member(g)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=0, equal_nan=True, msg=n)
    return {n: v.tolist() for n, v in got.items()}


def test_fused_compute_reads_the_synced_snapshot():
    outs = run_distributed(_synced_world, 2)
    assert json.dumps(outs[0]) == json.dumps(outs[1])  # NaN-tolerant equality of the synced values


@pytest.mark.parametrize("nan_strategy", ["error", "ignore", "propagate"])
def test_host_errors_and_keys_equal_the_per_member_path(nan_strategy):
    """compute_to_host() of a group with a bad count raises the member's own
    error (count and causes); keys carry prefix/postfix."""
    mc = dict(task="multiclass", num_classes=C, nan_strategy=nan_strategy)
    g = dk.MetricGroup({"acc": dk.Accuracy(**mc), "f1": dk.F1Score(**mc, average="macro"),
                        "mean": dk.WeightedMeanMetric(nan_strategy=nan_strategy)}, prefix="val/")
    odd = float("nan") if nan_strategy != "error" else 0.5  # a NaN score row raises only under "error"
    g.update(preds=torch.tensor([[0.1, odd, 0, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]]), target=torch.tensor([0, 0]))
    ok = g.compute_to_host().result()
    assert set(ok) == {"val/acc", "val/f1", "val/mean"}
    want = {f"val/{n}": m.compute() for n, m in g.items()}
    for k, v in ok.items():
        np.testing.assert_array_equal(np.asarray(v), want[k].numpy(), err_msg=k)
    g.update(preds=torch.tensor([0, 1]), target=torch.tensor([0, C + 3]))  # out-of-range target
    with pytest.raises(ValueError) as own:
        g["acc"].compute()
    with pytest.raises(ValueError) as host:
        g.compute_to_host().result()
    with pytest.raises(ValueError) as fused:
        g.compute()
    assert str(host.value) == str(own.value) == str(fused.value)


def test_group_values_op_equals_the_torch_families(monkeypatch):
    """The compiled group_values path against the torch families (the
    fallback where the op can't run), which equal each member's own formula exactly."""
    from d9d_kernels.metrics.formulas import fused

    g = dk.MetricGroup(_members())
    _feed(g, 4)
    g["mean"].update(torch.tensor([1.0, 2.0]), weights=torch.tensor([1.0, -1.0]))  # Σw stays > 0
    native = g.compute()
    assert {"acc", "f1_none", "f1_prop", "fbeta", "mean", "min", "cm", "cm_prop"} <= set(g.__dict__["_fused_plan"].native)
    monkeypatch.setattr(fused.GV, "group_values_ok", lambda device: False)
    families = g.compute()
    assert g.__dict__["_fused_plan"].native == []
    own = {n: m._compute_unchecked(m._states()) for n, m in g.items()}
    for n in own:
        torch.testing.assert_close(families[n], own[n], rtol=0, atol=0, equal_nan=True, msg=n)
        torch.testing.assert_close(native[n], own[n], rtol=1e-13, atol=1e-15, equal_nan=True, msg=n)


def test_weighted_mean_zero_weight_sum_is_nan_on_every_path(monkeypatch):
    from d9d_kernels.metrics.formulas import fused

    g = dk.MetricGroup({"mean": dk.WeightedMeanMetric(), "sum": dk.SumMetric()})
    g["mean"].update(torch.tensor([1.0, 2.0]), weights=torch.tensor([1.0, -1.0]))  # Σw = 0, Σwx = -1
    for ok in (True, False):
        monkeypatch.setattr(fused.GV, "group_values_ok", lambda device, ok=ok: ok and device.type == "cpu")
        assert math.isnan(g.compute()["mean"].item()) and math.isnan(g["mean"].compute().item())
        assert math.isnan(g.compute_to_host().result()["mean"])


@pytest.mark.parametrize("nan_strategy", ["error", "propagate"])
def test_group_values_binary_and_multilabel_equal_their_own_formulas(monkeypatch, nan_strategy):
    """Label-layout rows of the op (binary: micro over one label; multilabel:
    every average) against the torch formulas, NaN propagation included."""
    from d9d_kernels.metrics.formulas import fused

    L = 4
    ml = dict(task="multilabel", num_labels=L, nan_strategy=nan_strategy)
    g = dk.MetricGroup({
        "acc": dk.Accuracy(**ml, average="macro"), "f1": dk.F1Score(**ml, average="micro"),
        "p_none": dk.Precision(**ml, average="none"), "r_w": dk.Recall(**ml, average="weighted"),
        "spec": dk.Specificity(**ml, average="macro"), "jac": dk.JaccardIndex(**ml, average="macro"),
        "fb": dk.FBetaScore(**ml, beta=0.5, average="macro"),
    })
    b = dk.MetricGroup({"bacc": dk.Accuracy(task="binary", nan_strategy=nan_strategy),
                        "bf1": dk.F1Score(task="binary", nan_strategy=nan_strategy)})
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        g.update(preds=torch.rand(30, L, generator=gen), target=torch.randint(0, 2, (30, L), generator=gen))
        b.update(preds=torch.rand(30, generator=gen), target=torch.randint(0, 2, (30,), generator=gen))
    if nan_strategy == "propagate":
        p = torch.rand(2, L, generator=gen)
        p[0, 1] = float("nan")
        g.update(preds=p, target=torch.zeros(2, L, dtype=torch.int64))
    for grp in (g, b):
        native = grp.compute()
        assert set(grp.__dict__["_fused_plan"].native) == set(grp.keys())
        own = {n: m._compute_unchecked(m._states()) for n, m in grp.items()}
        for n in own:
            torch.testing.assert_close(native[n], own[n], rtol=1e-13, atol=1e-15, equal_nan=True, msg=n)
        if nan_strategy == "propagate" and grp is g:
            assert all(torch.isnan(v).all() for v in native.values())


def test_group_compute_results_are_fresh_tensors():
    """Each compute() returns new tensors: a result kept from an earlier call
    keeps its value after more updates and another compute()."""
    import d9d_kernels as dk

    g = dk.MetricGroup({f"m{i}": dk.SumMetric() for i in range(8)} | {"acc": dk.Accuracy(task="multiclass", num_classes=3)})
    for i in range(8):
        g[f"m{i}"].update(values=torch.tensor([float(i)]))
    g.update(preds=torch.tensor([0, 1, 2, 2]), target=torch.tensor([0, 1, 1, 2]))
    first = g.compute()
    kept = {k: v.item() for k, v in first.items()}
    for i in range(8):
        g[f"m{i}"].update(values=torch.tensor([100.0]))
    g.update(preds=torch.tensor([0, 0]), target=torch.tensor([1, 1]))
    second = g.compute()
    assert {k: v.item() for k, v in first.items()} == kept
    assert kept == {**{f"m{i}": float(i) for i in range(8)}, "acc": 0.75}
    assert all(second[f"m{i}"].item() == i + 100.0 for i in range(8)) and second["acc"].item() == 0.5
