"""Exact at the edges (single process): results handed out are fresh
tensors, forward's batch value is a fresh metric's, a member's operations
touch that member only, malformed checkpoints raise before anything
changes, statistics are shared only by members that feed them alike, and a
Running's base cannot join a group beside it. References: numpy,
scikit-learn, plain torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import mean_squared_error, mean_squared_log_error, r2_score

import d9d_kernels as dk
from d9d_kernels.metrics import MomentsStatistic
from tests.core.test_pickle import CASES, _batches, _case
from tests.metrics._catalogue_utils import _one_thread  # noqa: F401  (autouse: one intra-op thread)


def _snapshot(v):
    if isinstance(v, dict):
        return {k: _snapshot(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return type(v)(_snapshot(x) for x in v)
    return v.clone() if isinstance(v, torch.Tensor) else v


def _same(a, b):
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    elif isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    else:
        assert a == b or (a != a and b != b)


# -- 1. every compute() / forward result is a fresh tensor ------------------------------------------------------------
def test_confusion_matrix_kept_across_reset_and_syncs():
    cm = dk.ConfusionMatrix(task="multiclass", num_classes=2)
    cm.update(torch.tensor([0, 1]), torch.tensor([0, 1]))
    e1 = cm.compute()
    cm.reset()
    cm.update(torch.tensor([1, 1, 1]), torch.tensor([0, 0, 0]))
    assert e1.tolist() == [[1, 0], [0, 1]]
    cm.sync(None)
    e2 = cm.compute()
    for _ in range(2):
        cm.update(torch.tensor([0]), torch.tensor([1]))
        cm.sync(None)
    assert e2.tolist() == [[0, 3], [0, 0]]
    assert cm.compute().tolist() == [[0, 3], [2, 0]]


@pytest.mark.parametrize("case", sorted(CASES))
def test_results_stay_what_they_were(case):
    """Every catalogue class: values from compute() (local and synced) and
    forward keep their numbers through later updates, forwards, syncs and resets."""
    factory, inputs = _case(case)
    b1, b2, b3 = _batches(inputs)
    m = factory()
    m.update(*b1)
    kept = [m.compute()]
    kept.append(m(*b2))
    m.sync(None)
    kept.append(m.compute())
    want = [_snapshot(v) for v in kept]
    for b in (b3, b1, b2):
        m.update(*b)
        m(*b)
        m.sync(None)
        m.compute()
        m.reset()
    for got, w in zip(kept, want):
        _same(got, w)


def test_group_results_stay_what_they_were():
    g = dk.MetricGroup({"cm": dk.ConfusionMatrix(task="multiclass", num_classes=3),
                        "acc": dk.Accuracy(task="multiclass", num_classes=3, average="none")})
    p, t = torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 2])
    g.update(p, t)
    kept = [g.compute(), g(p, t)]
    g.sync(None)
    kept.append(g.compute())
    want = [_snapshot(v) for v in kept]
    for _ in range(2):
        g.update(t, p)
        g.sync(None)
        g.reset()
    for got, w in zip(kept, want):
        _same(got, w)


# -- 2a. forward's batch value is what a fresh metric gives -----------------------------------------------------------
@pytest.mark.parametrize("far", [1e6, 1e7, -3e9])
def test_forward_batch_value_ignores_the_states_pivot(far):
    g = torch.Generator().manual_seed(1)
    x0, y0 = (torch.randn(100, generator=g, dtype=torch.float64) + far for _ in range(2))
    x = torch.randn(50, generator=g, dtype=torch.float64)
    y = 0.7 * x + torch.randn(50, generator=g, dtype=torch.float64)
    for cls, ref in ((dk.PearsonCorrCoef, lambda a, b: np.corrcoef(a, b)[0, 1]),
                     (dk.R2Score, lambda a, b: r2_score(b, a))):
        m = cls()
        m.update(x0, y0)
        batch = m(x, y).item()
        want = ref(x.numpy(), y.numpy())
        assert batch == pytest.approx(want, rel=1e-12, abs=0), (cls.__name__, batch, want)
        # the state still holds both batches
        allx, ally = torch.cat([x0, x]), torch.cat([y0, y])
        assert m.compute().item() == pytest.approx(ref(allx.numpy(), ally.numpy()), rel=1e-9)


def test_forward_in_a_group_ignores_the_states_pivot():
    g = dk.MetricGroup({"r": dk.PearsonCorrCoef(), "mse": dk.MeanSquaredError()})
    gen = torch.Generator().manual_seed(2)
    g.update(preds=torch.randn(64, generator=gen, dtype=torch.float64) + 1e7,
             target=torch.randn(64, generator=gen, dtype=torch.float64) + 1e7)
    x, y = torch.randn(40, generator=gen, dtype=torch.float64), torch.randn(40, generator=gen, dtype=torch.float64)
    out = g(preds=x, target=y)
    assert out["r"].item() == pytest.approx(np.corrcoef(x.numpy(), y.numpy())[0, 1], rel=1e-12)
    assert out["mse"].item() == pytest.approx(mean_squared_error(y.numpy(), x.numpy()), rel=1e-12)


# -- 2b (one process). reset forgets the pivot ----------------------------------------------------------------------
def test_after_reset_the_value_is_a_fresh_metrics():
    gen = torch.Generator().manual_seed(3)
    m = dk.PearsonCorrCoef()
    m.update(torch.randn(30, generator=gen, dtype=torch.float64) + 1e6,
             torch.randn(30, generator=gen, dtype=torch.float64) + 1e6)
    m.sync(None)
    m.reset()
    x, y = torch.randn(30, generator=gen, dtype=torch.float64), torch.randn(30, generator=gen, dtype=torch.float64)
    m.update(x, y)
    assert m.compute().item() == pytest.approx(np.corrcoef(x.numpy(), y.numpy())[0, 1], rel=1e-12)


# -- 3. a member's operations touch that member only ------------------------------------------------------------------
def _ab():
    g = dk.MetricGroup({"a": dk.SumMetric(), "b": dk.SumMetric()})
    g["a"].update(5.0)
    g["b"].update(5.0)
    return g


def test_member_reset_between_trigger_and_wait():
    g = _ab()
    g.trigger_sync()
    g["a"].reset()
    g.wait_sync()
    assert g["a"].compute().item() == 0.0 and g["b"].compute().item() == 5.0
    g["a"].update(2.0)
    g.sync()
    assert g.compute() == {"a": 2.0, "b": 5.0}


def test_member_reset_after_sync_keeps_the_others_synced_values():
    g = _ab()
    g.sync()
    g["a"].reset()
    assert not g._storage.dirty  # b still reads the synced snapshot
    assert g["a"].compute().item() == 0.0 and g["b"].compute().item() == 5.0


@pytest.mark.parametrize("op", ["state_dict", "load_state_dict", "trigger_sync", "wait_sync", "sync",
                                "sync_and_compute"])
def test_member_operations_on_the_whole_storage_are_refused(op):
    g = _ab()
    sd = g.state_dict()
    args = (sd,) if op == "load_state_dict" else ()
    with pytest.raises(RuntimeError, match=rf"MetricGroup\['a'\] \(SumMetric\)\.{op}\(\).*call it on the MetricGroup"):
        getattr(g["a"], op)(*args)
    assert g.compute() == {"a": 5.0, "b": 5.0}


# -- 4. malformed state dicts raise, naming the metric and the key, and change nothing ---------------------------------
def _entry_without(kind):
    m = dk.WeightedMeanMetric()
    e = m.state_dict()["rank_0"]
    e.bufs.pop(kind)
    return e


def _bad_state_dicts():
    m = dk.WeightedMeanMetric()
    sd = m.state_dict()
    good = sd["rank_0"]
    yield "none", None, "expected a state_dict"
    yield "list", [good], "expected a state_dict"
    yield "entry None", {**sd, "rank_0": None}, r"state_dict\['rank_0'\] must be a StateEntry"
    yield "entry tensor", {**sd, "rank_0": torch.zeros(3)}, r"state_dict\['rank_0'\] must be a StateEntry"
    yield "entry empty", {**sd, "rank_0": {}}, r"state_dict\['rank_0'\] .*missing \['replica', 'sum'\]"
    yield "missing sum", {**sd, "rank_0": _entry_without("sum")}, r"state_dict\['rank_0'\] .*missing \['sum'\]"
    yield "missing replica", {**sd, "rank_0": _entry_without("replica")}, r"missing \['replica'\]"
    yield "extra kind", {**sd, "rank_0": {**dict(good.items()), "max": torch.zeros(1)}}, r"unexpected \['max'\]"
    yield "wrong shape", {**sd, "rank_0": {**dict(good.items()), "sum": torch.zeros(3)}}, \
        r"state_dict\['rank_0'\]\['sum'\] must be a float64 tensor of shape \[10\]"
    yield "not a tensor", {**sd, "rank_0": {**dict(good.items()), "sum": [0.0] * 10}}, r"\['sum'\] must be a float64"
    yield "rank_x", {**sd, "rank_x": good}, r"unexpected state_dict key 'rank_x'"
    yield "other key", {**sd, "foo": 1}, r"unexpected state_dict key 'foo'"
    yield "world_size", {**sd, "world_size": "2"}, r"state_dict\['world_size'\] must be a positive int"
    yield "schema", {**sd, "schema": "0123"}, "checkpoint schema '0123' does not match"


_BAD = {name: (sd, msg) for name, sd, msg in _bad_state_dicts()}


@pytest.mark.parametrize("name", sorted(_BAD))
@pytest.mark.parametrize("how", ["load_state_dict", "merge_state"])
def test_malformed_state_dict_raises_and_changes_nothing(name, how):
    sd, msg = _BAD[name]
    m = dk.WeightedMeanMetric()
    m.update(torch.tensor([1e6, 1e6 + 2.0], dtype=torch.float64))
    before = m._storage.local["sum"].clone(), m._storage.local["replica"].clone()
    if how == "merge_state" and not isinstance(sd, dict):  # neither a metric nor a state dict
        err, msg = TypeError, "WeightedMeanMetric.merge_state: argument 'other' must be a Metric or a state_dict"
    else:
        err, msg = ValueError, f"WeightedMeanMetric.{how}: {'' if msg.startswith('expected') else '.*'}{msg}"
    with pytest.raises(err, match=msg):
        getattr(m, how)(sd)
    torch.testing.assert_close(m._storage.local["sum"], before[0], rtol=0, atol=0)
    torch.testing.assert_close(m._storage.local["replica"], before[1], rtol=0, atol=0, equal_nan=True)
    assert m.compute().item() == 1e6 + 1.0


# -- 7. sharing a statistic requires feeding it alike ------------------------------------------------------------------
class MeanSquaredLogError(dk.Metric):
    """docs/metrics_core.md's custom statistic example: moments of log1p inputs, shared=True."""

    def __init__(self, nan_strategy="propagate"):
        super().__init__(nan_strategy=nan_strategy)

    def _statistics(self):
        return {"m": MomentsStatistic(paired=True, skip_bad=self.nan_strategy == "ignore", shared=True)}

    def update(self, preds, target, mask=None):
        self._feed({"m": dict(x=torch.log1p(preds), y=torch.log1p(target), mask=mask)})

    def _compute(self, states):
        m = states["m"]
        return m["sse"] / m["weight"]


def test_members_feeding_a_statistic_differently_do_not_share_it():
    p = torch.tensor([0.0, 1.0, 2.0, 5.0], dtype=torch.float64)
    t = torch.tensor([1.0, 3.0, 4.0, 4.5], dtype=torch.float64)
    g = dk.MetricGroup({"msle": MeanSquaredLogError(), "mse": dk.MeanSquaredError(), "mae": dk.MeanAbsoluteError()})
    g.update(preds=p, target=t)
    g["msle"].update(p, t)
    out = g.compute()
    assert out["mse"].item() == pytest.approx(mean_squared_error(t.numpy(), p.numpy()), rel=1e-14)
    assert out["msle"].item() == pytest.approx(mean_squared_log_error(t.numpy(), p.numpy()), rel=1e-14)
    st = g._storage.layout
    assert len(st.stats) == 2  # mse + mae share one statistic, msle has its own


def test_a_subclass_that_keeps_the_librarys_update_still_shares():
    class MyMSE(dk.MeanSquaredError):
        pass

    g = dk.MetricGroup({"a": MyMSE(), "b": dk.MeanSquaredError()})
    assert len(g._storage.layout.stats) == 1


# -- 8. a Running's base cannot be a member beside it ----------------------------------------------------------------
def test_running_and_its_base_in_one_group_are_refused():
    base = dk.SumMetric()
    r = dk.Running(base, window=2)
    with pytest.raises(ValueError, match="member 'b' is the base metric of a Running"):
        dk.MetricGroup({"r": r, "b": base})
    with pytest.raises(ValueError, match="already belongs to another Running"):
        dk.Running(base, window=3)
    g = dk.MetricGroup({"r": r, "s": dk.SumMetric()})  # the wrapper itself joins a group
    for v in (1.0, 2.0, 4.0):
        g.update(values=torch.tensor([v]))
    assert g.compute() == {"r": 6.0, "s": 7.0}


def test_member_reset_of_a_shared_statistic_is_refused():
    g = dk.MetricGroup({"acc": dk.Accuracy(task="multiclass", num_classes=3),
                        "f1": dk.F1Score(task="multiclass", num_classes=3, average="macro"),
                        "loss": dk.SumMetric()})
    g.update(preds=torch.tensor([0, 1, 2, 2]), target=torch.tensor([0, 1, 1, 2]))
    g["loss"].update(3.0)
    before = g.compute()
    with pytest.raises(RuntimeError, match=r"MetricGroup\['acc'\] \(Accuracy\)\.reset\(\): its state is shared with "
                                           r"\['f1'\].*reset the MetricGroup"):
        g["acc"].reset()
    _same(g.compute(), before)  # nothing changed
    g["loss"].reset()  # a statistic of its own: only it
    assert g.compute()["loss"].item() == 0.0 and g.compute()["f1"].item() == before["f1"].item()
