"""MetricGroup: packed buffers, input routing, merged statistics, reset."""

from __future__ import annotations

import math

import pytest
import torch

import d9d_kernels as dk
import d9d_kernels.metrics.moments as moments_mod
from d9d_kernels.metrics.moments import MomentsStatistic


class _MSE(dk.Metric):
    """Statistic-based metric in the catalogue's style (shared moments)."""

    def _statistics(self):
        return {"m": MomentsStatistic(paired=True, shared=True)}

    def update(self, preds, target, mask=None):
        self._feed({"m": dict(x=preds, y=target, mask=mask)})

    def _compute(self, states):
        m = states["m"]
        return m["sse"] / m["weight"]


class _MAE(_MSE):
    def _compute(self, states):
        m = states["m"]
        return m["sae"] / m["weight"]


def _in(buf, t):
    start = buf.data_ptr()
    return start <= t.data_ptr() < start + buf.numel() * buf.element_size()


def test_one_buffer_per_kind_and_member_views_point_into_it():
    g = dk.MetricGroup({"s": dk.SumMetric(), "m": dk.WeightedMeanMetric(), "mx": dk.MaxMetric(), "mse": _MSE()})
    st = g._storage
    assert st.local["sum"].numel() == 3 * (9 + 1) + 1  # 3 moments (+bad), extrema bad
    assert st.local["max"].numel() == 2 and st.local["replica"].numel() == 3 * 2
    for name in g:
        assert g[name]._storage is st
        j = next(iter(g[name]._stat_map.values()))
        for v in st.local_views[j].values():
            assert any(_in(b, v) for b in st.local.values())
    g["s"].update(torch.tensor([1.0, 2.0]))
    g["mx"].update(torch.tensor([5.0]))
    assert g.compute()["s"].item() == 3.0 and g.compute()["mx"].item() == 5.0
    assert len(g) == 4 and list(g) == ["s", "m", "mx", "mse"] and "s" in g
    assert list(g.compute()) == ["s", "m", "mx", "mse"]


def test_update_routes_by_signature():
    g = dk.MetricGroup({"s": dk.SumMetric(), "mx": dk.MaxMetric(), "mse": _MSE()})
    g.update(values=torch.tensor([1.0, 4.0]))  # aggregation members only
    g.update(values=torch.tensor([2.0]), weights=torch.tensor([3.0]))  # weights is a parameter of all three
    out = g.compute()
    assert out["s"].item() == 11.0 and out["mx"].item() == 4.0
    assert math.isnan(out["mse"].item())  # never fed
    with pytest.raises(ValueError, match="no member"):
        g.update(preds=torch.ones(2))  # `target` is required by _MSE; nobody else takes preds
    with pytest.raises(ValueError, match="no member"):
        g.update(values=torch.ones(2), bogus=1)


def test_shared_statistic_merged_and_run_once(monkeypatch):
    calls = []
    orig = moments_mod.ops.weighted_moments

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    monkeypatch.setattr(moments_mod.ops, "weighted_moments", counting)
    g = dk.MetricGroup({"mse": _MSE(), "mae": _MAE(), "sum": dk.SumMetric()})
    assert len(g._storage.layout.stats) == 2  # mse + mae share one statistic
    p, t = torch.randn(40), torch.randn(40)
    mask = torch.rand(40) > 0.25
    g.update(preds=p, target=t, mask=mask)
    assert len(calls) == 1
    d = (p.double() - t.double())[mask]
    out = g.compute()
    assert out["mse"].item() == pytest.approx(d.square().mean().item(), rel=1e-12)
    assert out["mae"].item() == pytest.approx(d.abs().mean().item(), rel=1e-12)
    g["mae"].update(p, t)  # a member's update writes the shared slice once
    assert len(calls) == 2
    both = torch.cat([d, p.double() - t.double()])
    assert g.compute()["mse"].item() == pytest.approx(both.square().mean().item(), rel=1e-12)


def test_metadata_error_leaves_every_member_untouched():
    g = dk.MetricGroup({"s": dk.SumMetric(), "m": dk.WeightedMeanMetric()})
    g.update(values=torch.tensor([1.0, 2.0]))
    before = {k: v.clone() for k, v in g._storage.local.items()}
    with pytest.raises(ValueError, match=r"MetricGroup\['m'\].*'mask'|MetricGroup\['s'\].*'mask'"):
        g.update(values=torch.ones(3), mask=torch.ones(4, dtype=torch.bool))
    for k, v in before.items():
        assert torch.equal(torch.nan_to_num(v), torch.nan_to_num(g._storage.local[k]))


def test_reset_group_and_member():
    g = dk.MetricGroup({"s": dk.SumMetric(), "m": dk.WeightedMeanMetric(), "mx": dk.MaxMetric()})
    g.update(values=torch.tensor([3.0, 5.0]))
    g.trigger_sync()
    g.wait_sync()
    g["s"].reset()  # only the member's slots
    out = g.compute()
    assert out["s"].item() == 0.0 and out["m"].item() == 4.0 and out["mx"].item() == 5.0
    assert not torch.isnan(g._storage.local["replica"]).all()
    g.reset()
    out = g.compute()
    assert out["s"].item() == 0.0 and math.isnan(out["m"].item()) and out["mx"].item() == -math.inf
    assert torch.isnan(g._storage.local["replica"]).all()  # no sync aligned the pivots: the next data picks them


def test_group_construction_errors():
    with pytest.raises(ValueError):
        dk.MetricGroup({})
    with pytest.raises(TypeError):
        dk.MetricGroup({"a": 1})
    s = dk.SumMetric()
    dk.MetricGroup({"a": s})
    with pytest.raises(ValueError, match="another MetricGroup"):
        dk.MetricGroup({"b": s})
