"""Statistic configurations (d9d_kernels/core/statistic.py): merge keys, merges,
views and the cross-rank schema, all derived from the dataclass fields.

The expected merge rules are written out here per statistic, independently of
the field metadata in the code, and every field must be listed: a new field
fails these tests until someone decides whether it must match or merges.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score

import d9d_kernels as dk
from d9d_kernels.core.statistic import REPLICA, SUM, Slot, Statistic, param, statistic
from d9d_kernels.metrics.binary_stats import BinaryStatistic
from d9d_kernels.metrics.class_stats import ClassStatistic
from d9d_kernels.metrics.moments import ExtremaStatistic, MomentsStatistic
from d9d_kernels.metrics.score_histogram import HistogramStatistic
from d9d_kernels.metrics.text import NLLStatistic
from tests.dist_utils import run_distributed, run_distributed_expect_errors

INPUTS2 = ("p", "t", "m")

# per class: a base instance, {field: another value} that must prevent a merge,
# {field: another value} that merges (and the merged value)
CASES = {
    "class": (
        ClassStatistic(10, None, (1,)),
        {"num_classes": 12, "ignore_index": -100, "inputs": INPUTS2},
        {"top_ks": ((3, 5), (1, 3, 5)), "confmat": (True, True), "nll": (True, True)},
    ),
    "binary": (
        BinaryStatistic(None, 0.5),
        {"num_labels": 3, "threshold": 0.25, "ignore_index": 7, "inputs": INPUTS2},
        {},
    ),
    "histogram": (
        HistogramStatistic(4, 100, multiclass=True),
        {"num_labels": 5, "num_bins": 50, "multiclass": False, "ignore_index": -1, "inputs": INPUTS2},
        {},
    ),
    "nll": (
        NLLStatistic(None),
        {"ignore_index": -100, "inputs": INPUTS2},
        {},
    ),
    "moments": (
        MomentsStatistic(paired=True, shared=True),
        {"paired": False, "skip_bad": True, "shared": False},
        {},
    ),
    "extrema": (
        ExtremaStatistic(shared=True),
        {"skip_bad": True, "shared": False},
        {},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_field_is_listed(case):
    base, must_match, merges = CASES[case]
    names = {f.name for f in dataclasses.fields(base)}
    assert names == set(must_match) | set(merges), "classify the new field in CASES"


@pytest.mark.parametrize("case", list(CASES))
def test_fields_that_must_match_split_merge_key_and_schema(case):
    base, must_match, _ = CASES[case]
    for name, value in must_match.items():
        other = dataclasses.replace(base, **{name: value})
        assert other.merge_key() != base.merge_key(), name
        assert other.schema() != base.schema(), name
        assert f"{name}={getattr(other, name)!r}" in repr(other)
        with pytest.raises(ValueError, match="merge keys differ"):
            base.merge(other)


@pytest.mark.parametrize("case", list(CASES))
def test_fields_with_a_merge_rule_merge_and_still_show_in_schema(case):
    base, _, merges = CASES[case]
    for name, (value, merged) in merges.items():
        other = dataclasses.replace(base, **{name: value})
        assert other.merge_key() == base.merge_key(), name
        assert other.schema() != base.schema(), name  # ranks must still agree on it
        m = base.merge(other)
        assert getattr(m, name) == merged and getattr(other.merge(base), name) == merged
        for f in dataclasses.fields(base):  # the other fields are kept
            if f.name != name:
                assert getattr(m, f.name) == getattr(base, f.name)


def test_unshared_statistics_merge_only_with_themselves():
    a, b = MomentsStatistic(paired=True), MomentsStatistic(paired=True)
    assert a.merge_key() != b.merge_key() and a.merge_key() == a.merge_key()
    assert a.schema() == b.schema()  # rank-independent: no id in the schema
    c, d = MomentsStatistic(paired=True, shared=True), MomentsStatistic(paired=True, shared=True)
    assert c.merge_key() == d.merge_key() and c.merge(d) is c


def test_fields_are_normalised_and_frozen():
    s = ClassStatistic(5.0, None, [3, 1, 3], confmat=1, inputs=["a", "b", "c"])
    assert (s.num_classes, s.top_ks, s.confmat, s.inputs) == (5, (1, 3), True, ("a", "b", "c"))
    assert s.merge_key() == ClassStatistic(5, None, (1, 3), inputs=("a", "b", "c")).merge_key()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.top_ks = (1,)
    assert BinaryStatistic(2, 1).threshold == 1.0 and isinstance(BinaryStatistic(2, 1).threshold, float)


def test_class_view_gives_each_member_its_own_top_ks():
    a = ClassStatistic(4, None, (1, 3))
    b = ClassStatistic(4, None, (2,), confmat=True)
    c = ClassStatistic(4, None, (3, 1), nll=True)
    m = a.merge(b).merge(c)
    assert m.top_ks == (1, 2, 3) and m.confmat and m.nll
    state = {s.name: torch.arange(float(np.prod(s.shape))).reshape(s.shape) for s in m.slots()}
    for need, rows in ((a, [0, 2]), (b, [1]), (c, [0, 2])):
        v = m.view(state, need)
        assert set(v) == {s.name for s in need.slots()}
        assert torch.equal(v["stats"], state["stats"][rows])
        for s in need.slots():
            assert tuple(v[s.name].shape) == s.shape


def test_undeclared_subclass_cannot_merge_silently():
    class Loose(Statistic):  # configuration invisible to the base class
        def __init__(self, k):
            self.k = k

        def slots(self):
            return [Slot("x", SUM, (1,))]

    with pytest.raises(TypeError, match="@statistic"):
        Loose(1).merge_key()

    @statistic
    class Declared(Statistic):
        k: int = param(convert=int)

        def slots(self):
            return [Slot("x", SUM, (self.k,))]

    assert Declared(1).merge_key() != Declared(2).merge_key()
    assert Declared(2).schema().endswith("Declared(k=2)[x:sum:(2,)]")


def test_a_replica_slot_must_be_a_pivot_the_statistic_names():
    """A sync moves REPLICA slots as pivots of moment sums: one that pivots() does not name is refused."""

    @statistic
    class Anchored(Statistic):
        def slots(self):
            return [Slot("moments", SUM, (9,)), Slot("anchor", REPLICA, (2,), 0.0)]

        def update(self, state, x):
            state["moments"][0].add_(x.sum())

    class UsesIt(dk.Metric):
        def _statistics(self):
            return {"a": Anchored()}

        def update(self, x):
            self._feed({"a": dict(x=x)})

        def _compute(self, states):
            return states["a"]["moments"][0]

    with pytest.raises(ValueError, match="Anchored: every REPLICA slot must be a pivot named by pivots"):
        UsesIt().update(torch.tensor([1.0]))
    Anchored.pivots = lambda self: [("moments", "anchor", False)]
    m = UsesIt()
    m.update(torch.tensor([1.0, 2.0]))
    assert m.compute().item() == 3.0


# ---- across ranks ----------------------------------------------------------------------------


def _metrics(rank: int, differ: str) -> dict:
    """Standalone metrics whose statistic config differs on rank 1 by ``differ``
    (nothing else differs: same members, slots and shapes on both ranks)."""
    one = rank == 1
    return {
        "threshold": dk.Accuracy(task="binary", threshold=0.7 if one and differ == "threshold" else 0.5),
        "top_k": dk.Accuracy(task="multiclass", num_classes=4, top_k=2 if one and differ == "top_k" else 1,
                             average="micro"),
        "ignore_index": dk.Accuracy(task="multiclass", num_classes=4, average="micro",
                                    ignore_index=3 if one and differ == "ignore_index" else None),
    }


def _data(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    p, t = torch.rand(32, generator=g), torch.randint(0, 2, (32,), generator=g)
    return p, t, torch.randn(32, 4, generator=g), torch.randint(0, 4, (32,), generator=g)


def _mismatch_worker(rank, world, differ):
    ms = _metrics(rank, differ)
    p, t, s, c = _data(rank)
    ms["threshold"].update(p, t)
    ms["top_k"].update(s, c)
    ms["ignore_index"].update(s, c)
    out = {}
    for name in ([differ] if differ in ms else ms):
        m = ms[name]
        m.trigger_sync(dk.DistributedContext(timeout=20))
        m.wait_sync()
        out[name] = m.compute().item()
    return out


@pytest.mark.parametrize("differ", ["threshold", "top_k", "ignore_index"])
def test_config_mismatch_raises_on_every_rank(differ):
    out = run_distributed_expect_errors(_mismatch_worker, 2, differ, timeout=90)
    # the message names the member's differing argument and each rank's value
    words = {"threshold": ("threshold 0.5", "0.7"), "top_k": ("top_k 1", "2"),
             "ignore_index": ("ignore_index None", "3")}[differ]
    for r in range(2):
        status, msg = out[r]
        assert status == "error", (r, msg)
        assert msg.startswith("ValueError") and "schema" in msg, msg
        assert all(w in msg for w in words) and "ranks [0]" in msg and "ranks [1]" in msg, msg


def test_same_config_syncs_and_matches_sklearn():
    vals = run_distributed(_mismatch_worker, 2, "none", timeout=90)
    assert vals[0] == vals[1]
    p, t, s, c = (torch.cat(parts) for parts in zip(*(_data(r) for r in range(2))))
    assert vals[0]["threshold"] == pytest.approx(accuracy_score(t.numpy(), (p > 0.5).numpy()))
    top1 = accuracy_score(c.numpy(), s.argmax(-1).numpy())
    assert vals[0]["top_k"] == pytest.approx(top1) and vals[0]["ignore_index"] == pytest.approx(top1)
