"""torchmetrics conveniences: MeanMetric, prefix/postfix, clone, merge_state,
plot, sync_and_compute, state size errors, bad-input counts by cause, errors
naming group members, the unsynced-compute warning, DCP loads of another
group, repr."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torchmetrics as tm

import d9d_kernels as dk
from tests.dist_utils import run_distributed
from tests.metrics._catalogue_utils import _one_thread  # noqa: F401

C = 4
KW = dict(task="multiclass", num_classes=C)


def _data(seed, n=30):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, C, generator=g), torch.randint(0, C, (n,), generator=g), torch.randn(n, generator=g, dtype=torch.float64)


def _group(**kw):
    return dk.MetricGroup({"acc": dk.Accuracy(**KW), "f1": dk.F1Score(**KW, average="macro"),
                           "cm": dk.ConfusionMatrix(**KW), "loss": dk.MeanMetric(), "peak": dk.MaxMetric(),
                           "total": dk.SumMetric()}, **kw)


def _feed(g, seed):
    p, t, x = _data(seed)
    g.update(preds=p, target=t)
    g["loss"].update(x)
    g["peak"].update(x)
    g["total"].update(1e6 + x)
    return p, t, x


def _assert_same(a: dict, b: dict, rtol=1e-12):
    assert list(a) == list(b)
    for k in a:
        assert torch.allclose(a[k].double(), b[k].double(), rtol=rtol, atol=1e-12, equal_nan=True), k


# -- MeanMetric -----------------------------------------------------------------
def test_mean_metric_argument_names_and_nan_warn_like_torchmetrics():
    ours, theirs = dk.MeanMetric(), tm.MeanMetric().set_dtype(torch.float64)
    x = torch.tensor([1.0, float("nan"), 3.0], dtype=torch.float64)
    w = torch.tensor([2.0, 1.0, 1.0], dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.update(x, w)
        theirs.update(value=4.0, weight=0.5)
    ours.update(x, w)
    ours.update(value=4.0, weight=0.5)
    with pytest.warns(UserWarning, match="1 NaN/Inf value"):
        v = ours.compute()
    assert v.item() == pytest.approx(theirs.compute().item(), rel=1e-14)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once
        ours.compute()
    assert math.isnan(dk.MeanMetric(nan_strategy="disable")(x).item())
    assert dk.MeanMetric(nan_strategy=0.0)(x).item() == pytest.approx(4.0 / 3.0)  # torchmetrics' impute
    with pytest.raises(ValueError, match="MeanMetric: argument 'nan_strategy'"):
        dk.MeanMetric(nan_strategy="drop")


def test_mean_metric_weight_values_under_one_plan():
    """The weight's value never enters the plan: 1.0 given, 2.0 given, none."""
    m, ref = dk.MeanMetric(), []
    for i, w in enumerate([None, 2.0, 1.0, 3.0, None, 0.5]):
        x = torch.full((3,), float(i), dtype=torch.float64)
        (m.update(x) if w is None else m.update(x, weight=w))
        ref.append((x, 1.0 if w is None else w))
    num = sum(float(x.sum()) * w for x, w in ref)
    den = sum(3 * w for _, w in ref)
    assert m.compute().item() == pytest.approx(num / den, rel=1e-14)


def test_weighted_mean_with_zero_weight_sum_is_nan():
    m = dk.WeightedMeanMetric()
    m.update(torch.tensor([1.0, 2.0]), torch.tensor([1.0, -1.0]))  # Σw = 0, Σwx = -1
    assert math.isnan(m.compute().item())
    assert math.isnan(dk.WeightedMeanMetric().compute().item())


# -- prefix / postfix ---------------------------------------------------------------
def test_prefix_postfix_keys_like_metric_collection():
    g = dk.MetricGroup({"acc": dk.Accuracy(**KW), "f1": dk.F1Score(**KW)}, prefix="val/", postfix="_ep")
    col = tm.MetricCollection({"acc": tm.Accuracy(**KW), "f1": tm.F1Score(**KW)}, prefix="val/", postfix="_ep")
    p, t, _ = _data(0)
    g.update(preds=p, target=t)
    col.update(p, t)
    assert list(g.compute()) == list(col.compute()) == ["val/acc_ep", "val/f1_ep"]
    assert list(g.compute_to_host().result()) == ["val/acc_ep", "val/f1_ep"]
    assert list(g.keys()) == ["acc", "f1"] and g.keys(keep_base=False) == ["val/acc_ep", "val/f1_ep"]
    assert g["acc"] is not None and "prefix='val/'" in repr(g)
    with pytest.raises(TypeError, match="prefix"):
        dk.MetricGroup({"a": dk.SumMetric()}, prefix=3)


# -- clone ----------------------------------------------------------------------
def test_clone_is_an_independent_deep_copy():
    g = _group()
    _feed(g, 1)
    c = g.clone()
    _assert_same(c.compute(), g.compute())
    before = g.compute()
    _feed(c, 2)  # the copy moves on, the original does not
    _assert_same(g.compute(), before)
    assert c._storage is not g._storage and c["acc"]._group is c
    ref = _group()
    _feed(ref, 1)
    _feed(ref, 2)
    _assert_same(c.compute(), ref.compute())

    m = dk.R2Score()
    m.update(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([1.5, 2.0, 3.0]))
    m2 = m.clone()
    m2.update(torch.tensor([9.0]), torch.tensor([1.0]))
    assert m.compute().item() != m2.compute().item()
    member = g["f1"].clone()
    assert member._group is not g and torch.equal(member.compute(), g["f1"].compute())


def test_clone_of_a_custom_metric_updates_its_own_slots():
    class Count(dk.Metric):
        def __init__(self):
            super().__init__()
            self.add_state("n", kind="sum", shape=())

        def _update(self, values):
            self.n += values.numel()

        def _compute(self, state):
            return state["n"].clone()

    a = Count()
    a.update(torch.zeros(3))
    b = a.clone()
    b.update(torch.zeros(5))
    assert a.compute().item() == 3 and b.compute().item() == 8


# -- merge_state ---------------------------------------------------------------------
def test_merge_state_is_exact_and_additive():
    a, b, whole = _group(), _group(), _group()
    for s in (3, 4):
        _feed(a, s)
        _feed(whole, s)
    for s in (5, 6):
        _feed(b, s)
        _feed(whole, s)
    b_before = b.compute()
    a.merge_state(b)
    _assert_same(a.compute(), whole.compute(), rtol=1e-10)
    _assert_same(b.compute(), b_before)  # other untouched


def test_merge_state_matches_torchmetrics_merge_state():
    p, t, x = _data(7)
    ours = [dk.F1Score(**KW, average="macro") for _ in range(2)]
    theirs = [tm.F1Score(**KW, average="macro") for _ in range(2)]
    for i, sl in enumerate((slice(0, 11), slice(11, 30))):
        ours[i].update(p[sl], t[sl])
        theirs[i].update(p[sl], t[sl])
    ours[0].merge_state(ours[1])
    theirs[0].merge_state(theirs[1])
    assert ours[0].compute().item() == pytest.approx(theirs[0].compute().item(), abs=1e-6)


def test_merge_state_pivots_and_state_dict():
    g = torch.Generator().manual_seed(1)
    xs = [1e8 + torch.randn(20, generator=g, dtype=torch.float64) for _ in range(2)]
    ys = [x + 0.2 * torch.randn(20, generator=g, dtype=torch.float64) for x in xs]
    a, b = dk.PearsonCorrCoef(), dk.PearsonCorrCoef()
    b.update(xs[1], ys[1])  # a has no pivot yet, b has one
    a.merge_state(b)
    a.update(xs[0], ys[0])
    ref = np.corrcoef(torch.cat(xs).numpy() - 1e8, torch.cat(ys).numpy() - 1e8)[0, 1]
    assert a.compute().item() == pytest.approx(ref, abs=1e-9)
    c = dk.PearsonCorrCoef()
    c.update(xs[0], ys[0])
    c.merge_state(b.state_dict())
    assert c.compute().item() == pytest.approx(ref, abs=1e-9)


def test_merge_state_schema_errors():
    with pytest.raises(ValueError, match="expected a Accuracy, got F1Score"):
        dk.Accuracy(**KW).merge_state(dk.F1Score(**KW))
    with pytest.raises(ValueError, match="state 'stats' differs"):
        dk.Accuracy(**KW).merge_state(dk.Accuracy(task="multiclass", num_classes=C + 1))
    with pytest.raises(ValueError, match="members differ"):
        _group().merge_state(dk.MetricGroup({"acc": dk.Accuracy(**KW)}))
    with pytest.raises(ValueError, match="merge groups with groups"):
        _group().merge_state(dk.Accuracy(**KW))
    g = _group()
    with pytest.raises(ValueError, match="shares this metric's state"):
        g["acc"].merge_state(g["f1"])
    with pytest.raises(ValueError, match="schema"):
        dk.SumMetric().merge_state(dk.MaxMetric().state_dict())
    with pytest.raises(TypeError, match="'other'"):
        dk.SumMetric().merge_state(3)


# -- plot -------------------------------------------------------------------------------
def test_plot_lines_heat_map_and_given_axes():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = dk.Accuracy(**KW)
    vals = []
    for s in range(4):
        p, t, _ = _data(s)
        vals.append(m(p, t))
    fig, ax = m.plot(vals)
    assert len(ax.lines) == 1 and list(ax.lines[0].get_ydata()) == [v.item() for v in vals]
    cm = dk.ConfusionMatrix(**KW)
    p, t, _ = _data(9)
    cm.update(p, t)
    fig2, ax2 = plt.subplots()
    f, a = cm.plot(ax=ax2)
    assert a is ax2 and f is fig2 and len(a.images) == 1
    assert np.array_equal(a.images[0].get_array(), cm.compute().numpy())
    g = dk.MetricGroup({"a": dk.Accuracy(**KW), "f": dk.F1Score(**KW)})
    steps = [g(preds=p, target=t) for _ in range(3)]
    _, ax3 = g.plot(steps)
    assert sorted(line.get_label() for line in ax3.lines) == ["a", "f"]
    _, ax4 = g.plot()  # compute() of a group: one bar per member
    assert [round(b.get_height(), 12) for b in ax4.patches] == [round(v.item(), 12) for v in g.compute().values()]
    plt.close("all")


# -- state size ----------------------------------------------------------------------------
def test_state_that_cannot_fit_raises_value_error_naming_its_size():
    with pytest.raises(ValueError, match=r"ConfusionMatrix: needs 298 GiB of float64 state .*confmat \[200000, 200000\]"):
        dk.ConfusionMatrix(task="multiclass", num_classes=200_000)
    with pytest.raises(ValueError, match=r"needs 74.5 GiB of float64 state"):
        dk.MetricGroup({"cm": dk.ConfusionMatrix(task="multiclass", num_classes=100_000)})
    dk.ConfusionMatrix(task="multiclass", num_classes=300)  # small states are unaffected


# -- sync_and_compute ----------------------------------------------------------------------
def test_sync_and_compute_local():
    m = dk.SumMetric()
    m.update(torch.tensor([1.0, 2.0]))
    assert m.sync_and_compute(None).item() == 3.0
    assert m._storage.synced is not None and not m._storage.dirty
    assert m.sync_and_compute(dk.DistributedContext.local()).item() == 3.0


# -- bad inputs ------------------------------------------------------------------------------
def test_bad_input_counts_by_cause_never_raise():
    m = dk.Accuracy(**KW, nan_strategy="ignore")
    p = torch.randn(6, C)
    p[1, 2] = float("nan")
    t = torch.tensor([0, 1, 2, 9, -3, 1])
    m.update(p, t)
    assert m.bad_input_counts() == {"target_out_of_range": 2, "nonfinite_preds": 1}
    with pytest.raises(ValueError) as e:
        m.compute()
    msg = str(e.value)
    assert "2 invalid" in msg and "target_out_of_range=2" in msg and "ignore_index=" in msg and "reset()" in msg
    m.reset()
    assert m.bad_input_counts() == {"target_out_of_range": 0, "nonfinite_preds": 0}

    e_m = dk.Accuracy(**KW)  # nan_strategy="error": the same split, both causes raise
    e_m.update(p, t)
    assert e_m.bad_input_counts() == {"target_out_of_range": 2, "nonfinite_preds": 1}
    with pytest.raises(ValueError, match=r"3 invalid.*target_out_of_range=2, nonfinite_preds=1\. Fix: pass ignore_index="):
        e_m.compute()
    agg = dk.SumMetric(nan_strategy="error")
    agg.update(torch.tensor([1.0, float("inf"), float("nan")]))
    assert agg.bad_input_counts() == {"nonfinite_inputs": 2}
    with pytest.raises(ValueError, match=r"nonfinite_inputs=2\. Fix: nan_strategy='ignore'.*reset\(\)"):
        agg.compute()
    g = dk.MetricGroup({"acc": dk.Accuracy(**KW, nan_strategy="ignore"), "s": dk.SumMetric()})
    g.update(preds=p, target=t)
    assert g.bad_input_counts() == {"acc": {"target_out_of_range": 2, "nonfinite_preds": 1}, "s": {"nonfinite_inputs": 0}}
    with pytest.raises(ValueError, match=r"MetricGroup\['acc'\] \(Accuracy\).*target_out_of_range=2"):
        g.compute_to_host().result()


# -- repr -------------------------------------------------------------------------------------
def test_repr_shows_configuration():
    assert repr(dk.Accuracy(task="multiclass", num_classes=10, top_k=5)) == \
        "Accuracy(task='multiclass', num_classes=10, top_k=5, average='micro')"
    assert repr(dk.MeanSquaredError(squared=False)) == "MeanSquaredError(squared=False)"
    assert repr(dk.SumMetric()) == "SumMetric()" and repr(dk.MeanMetric()) == "MeanMetric()"
    r = repr(dk.MetricGroup({"loss": dk.WeightedMeanMetric(), "f1": dk.F1Score(**KW, average="macro")}))
    assert "'loss': WeightedMeanMetric()" in r and "'f1': F1Score(task='multiclass', num_classes=4, average='macro')" in r


# -- checkpoint of another group ----------------------------------------------------------------
def test_dcp_load_into_a_different_group_raises_our_value_error(tmp_path):
    import torch.distributed.checkpoint as dcp

    g = _group()
    _feed(g, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"metrics": g}, checkpoint_id=str(tmp_path))
        other = dk.MetricGroup({"acc": dk.Accuracy(**KW), "mse": dk.MeanSquaredError()})
        with pytest.raises(ValueError, match="checkpoint schema .* does not match"):
            dcp.load({"metrics": other}, checkpoint_id=str(tmp_path))
        same = _group()
        dcp.load({"metrics": same}, checkpoint_id=str(tmp_path))
    _assert_same(same.compute(), g.compute())


# -- multi-rank: unsynced compute warns once ------------------------------------------------------
def _unsynced_worker(rank, world):
    import warnings as w

    m = dk.SumMetric()
    g = dk.MetricGroup({"a": dk.SumMetric(), "b": dk.MaxMetric()})
    out = {}
    m.update(torch.tensor([float(rank + 1)]))
    g.update(values=torch.tensor([float(rank + 1)]))
    with w.catch_warnings(record=True) as rec:
        w.simplefilter("always")
        m.compute()
        m.compute()
        g.compute()
        g.compute()
        out["warnings"] = [str(r.message) for r in rec]
    with w.catch_warnings(record=True) as rec:
        w.simplefilter("always")
        m2 = dk.SumMetric()
        m2.update(torch.tensor([float(rank + 1)]))
        out["synced"] = m2.sync_and_compute().item()
        out["after_sync"] = [str(r.message) for r in rec]
    return out


def test_unsynced_compute_warns_once_per_metric_in_a_multi_rank_job():
    res = run_distributed(_unsynced_worker, 2)
    for r in res:
        assert len(r["warnings"]) == 2, r["warnings"]  # the metric once, the group once (not per member)
        assert "SumMetric.compute(): this rank's local value" in r["warnings"][0]
        assert "sync_and_compute" in r["warnings"][0] and "MetricGroup" in r["warnings"][1]
        assert r["synced"] == 3.0 and r["after_sync"] == []


def test_group_positional_inputs_as_metric_collection():
    """``g(preds, target)`` / ``g.update(preds, target)`` as torchmetrics'
    MetricCollection takes them; members with other leading parameters are refused by name."""
    g = dk.MetricGroup({"acc": dk.Accuracy(task="multiclass", num_classes=4),
                        "mse": dk.MeanSquaredError()})
    c = tm.MetricCollection({"acc": tm.Accuracy(task="multiclass", num_classes=4)})
    p, t = torch.tensor([0, 1, 2, 3, 3]), torch.tensor([0, 1, 1, 3, 2])
    with pytest.raises(TypeError, match="positional"):
        g.update(p.float(), t.float(), t.float(), t.float(), t.float())
    g2 = dk.MetricGroup({"acc": dk.Accuracy(task="multiclass", num_classes=4)})
    batch = g2(p, t)
    assert batch["acc"].item() == pytest.approx(c(p, t)["acc"].item())
    g2.update(p, target=t)
    c.update(p, t)
    assert g2.compute()["acc"].item() == pytest.approx(c.compute()["acc"].item())
    with pytest.raises(TypeError, match="both by position and by name"):
        g2.update(p, preds=p)
