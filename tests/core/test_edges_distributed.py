"""Exact at the edges, on 2 gloo ranks: results independent of the world
size and of what came before a reset, a member's reset keeps the others'
synced values, collectives decided only by what every rank shares (a
rank-local call on one rank only, then a sync), and formula-only settings
compared across ranks. References: numpy over every rank's data."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

import d9d_kernels as dk
from tests.dist_utils import run_distributed, run_distributed_expect_errors, spy_collectives


def _randn(gen, n, shift=0.0):
    return torch.randn(n, generator=gen, dtype=torch.float64) + shift


# -- 2b. a reset forgets what came before, whatever the world size ----------------------------------------------------
def _after_far_interval_worker(rank, world, far):
    gen = torch.Generator().manual_seed(100 + rank)
    calls = spy_collectives([])
    m = dk.PearsonCorrCoef()
    x0 = _randn(gen, 40, far)
    y0 = x0 + _randn(gen, 40)
    m.update(x0, y0)
    # the first sync, data far from 0: the sums about 0 cancel to a negative variance, still corrected
    out = [(m.sync_and_compute(None).item(), None, x0.tolist(), y0.tolist())]
    for shift in (0.0, 0.0, 5.0, far):
        m.reset()
        x = _randn(gen, 30 + 7 * rank, shift)
        y = 0.5 * x + _randn(gen, x.numel())
        m.update(x, y)
        n = len(calls)
        value = m.sync_and_compute(None).item()
        out.append((value, len(calls) - n, x.tolist(), y.tolist()))
    return out


@pytest.mark.parametrize("far", [1e6, 1e7, 3e9])
def test_value_after_a_far_interval_is_the_all_data_value(far):
    per_rank = run_distributed(_after_far_interval_worker, 2, far)
    for i in range(5):
        x = np.concatenate([np.array(r[i][2]) for r in per_rank])
        y = np.concatenate([np.array(r[i][3]) for r in per_rank])
        want = np.corrcoef(x, y)[0, 1]
        counts = {r[i][1] for r in per_rank}
        assert len(counts) == 1, counts  # every rank issued the same collectives
        for rank, r in enumerate(per_rank):
            assert r[i][0] == pytest.approx(want, rel=1e-12, abs=0), (i, rank, r[i][0], want)
    # interval 1 jumps from `far` to 0 (one corrective round); interval 2 is steady: one collective
    assert per_rank[0][1][1] == 2 and per_rank[0][2][1] == 1, [r[1] for r in per_rank[0]]


# -- 3b. a member's reset after a sync keeps the other members' synced values ------------------------------------------
def _member_reset_worker(rank, world):
    g = dk.MetricGroup({"a": dk.SumMetric(), "b": dk.SumMetric()})
    g["a"].update(10.0 * (rank + 1))
    g["b"].update(10.0 * (rank + 1))
    g.sync(None)
    g["a"].reset()
    return g["a"].compute().item(), g["b"].compute().item()


def test_member_reset_after_a_sync_keeps_the_others_global_values():
    assert run_distributed(_member_reset_worker, 2) == [(0.0, 30.0)] * 2


# -- 5. collectives decided only by what every rank shares --------------------------------------------------------------
def _group():
    return dk.MetricGroup({"loss": dk.WeightedMeanMetric(), "r": dk.PearsonCorrCoef(), "mx": dk.MaxMetric(),
                           "acc": dk.Accuracy(task="multiclass", num_classes=3)})


class _Held:
    """What a rank's group holds since its reset, per member, as plain lists."""

    def __init__(self):
        self.v, self.xy, self.pt = [], [], []

    def feed(self, g, gen, shift, rows=None):
        n = rows or 6
        v = _randn(gen, n, shift)
        x = _randn(gen, n, shift)
        y = x + _randn(gen, n)
        p, t = torch.randint(0, 3, (n,), generator=gen), torch.randint(0, 3, (n,), generator=gen)
        g.update(values=v)
        g["r"].update(x, y)
        g["acc"].update(p, t)
        self.v += v.tolist()
        self.xy += list(zip(x.tolist(), y.tolist()))
        self.pt += list(zip(p.tolist(), t.tolist()))


def _reference(helds):
    v = np.concatenate([h.v for h in helds]) if any(h.v for h in helds) else np.zeros(0)
    xy = np.array([p for h in helds for p in h.xy]).reshape(-1, 2)
    pt = np.array([p for h in helds for p in h.pt]).reshape(-1, 2)
    return {"loss": v.mean() if v.size else float("nan"), "mx": v.max() if v.size else float("-inf"),
            "r": np.corrcoef(xy[:, 0], xy[:, 1])[0, 1] if len(xy) > 2 else None,
            "acc": (pt[:, 0] == pt[:, 1]).mean() if len(pt) else None}


def _check(got, want, what):
    for k, w in want.items():
        if w is None:
            continue
        if np.isnan(w):
            assert np.isnan(got[k]), (what, k, got[k])
        else:
            assert got[k] == pytest.approx(w, rel=1e-12, abs=1e-300), (what, k, got[k], w)


def _local_call(g, held, call, gen):
    """Runs ``call`` on this rank's group; returns the group to use after it."""
    if call == "load":
        g.load_state_dict(g.state_dict())
    elif call == "merge_state_dict":
        other, oh = _group(), _Held()
        oh.feed(other, gen, 3e6)
        g.merge_state(other.state_dict())
        held.v += oh.v; held.xy += oh.xy; held.pt += oh.pt
    elif call == "merge":
        other, oh = _group(), _Held()
        oh.feed(other, gen, -2e6)
        g.merge_state(other)
        held.v += oh.v; held.xy += oh.xy; held.pt += oh.pt
    elif call == "reset":
        g.reset()
        held.__init__()
    elif call == "member_reset":
        g["r"].reset()
        held.xy = []
    elif call == "forward":
        x = _randn(gen, 5, 4e8)
        y = x + _randn(gen, 5)
        g["r"](x, y)
        held.xy += list(zip(x.tolist(), y.tolist()))
    elif call == "clone":
        g = g.clone()
    elif call == "deepcopy":
        g = copy.deepcopy(g)
    elif call == "compute":
        g.compute()
        g.compute_to_host().result()
    return g


LOCAL_CALLS = ["load", "merge_state_dict", "merge", "reset", "member_reset", "forward", "clone", "deepcopy", "compute"]


def _one_rank_calls_worker(rank, world, calls_to_make):
    import torch.distributed as dist

    calls = spy_collectives([])
    out = []
    for call in calls_to_make:
        gen = torch.Generator().manual_seed(7 + rank)
        g, held = _group(), _Held()
        held.feed(g, gen, 1e6)
        g.sync(None)  # the first sync: schema handshake, references set
        held.feed(g, gen, 1e6)
        if rank == 0:
            g = _local_call(g, held, call, gen)
        n = len(calls)
        got = {k: float(v) for k, v in g.sync_and_compute(None).items()}
        issued = calls[n:]
        helds = [None] * world
        dist.all_gather_object(helds, held)
        out.append((call, issued, got, _reference(helds)))
    return out


def test_a_rank_local_call_on_one_rank_then_a_sync():
    per_rank = run_distributed(_one_rank_calls_worker, 2, LOCAL_CALLS, timeout=180)
    for i, call in enumerate(LOCAL_CALLS):
        issued = [r[i][1] for r in per_rank]
        assert issued[0] == issued[1], (call, issued)
        for rank, r in enumerate(per_rank):
            _check(r[i][2], r[i][3], f"{call} on rank 0, seen from rank {rank}")


# -- the same as a random program: rank-local calls on one rank only between syncs --------------------------------------
def _program_worker(rank, world, seeds):
    import torch.distributed as dist

    calls = spy_collectives([])
    checked = 0
    for seed in seeds:
        plan = random.Random(seed)  # the same program on every rank
        gen = torch.Generator().manual_seed(1000 * seed + rank)
        g, held = _group(), _Held()
        for _ in range(10):
            step = plan.choice(["feed", "feed_far", "sync", "local", "local", "reset_in_flight"])
            if step == "feed":
                held.feed(g, gen, plan.choice([0.0, 1.0, -50.0]), rows=plan.choice([1, 4, 9]))
            elif step == "feed_far":
                held.feed(g, gen, plan.choice([1e6, -1e7, 3e9]), rows=plan.choice([1, 4, 9]))
            elif step == "local":
                who, call = plan.randrange(world), plan.choice(LOCAL_CALLS)
                if rank == who:
                    g = _local_call(g, held, call, gen)
            elif step == "reset_in_flight":
                g.trigger_sync(None)
                if plan.random() < 0.5:
                    g.reset()
                    held.__init__()
                else:
                    g["loss"].reset()
                    held.v = []  # loss and mx are fed the same values; only loss is reset
                    held.mx_kept = True
                g.wait_sync(None)
            if step == "sync" or plan.random() < 0.3:
                n = len(calls)
                got = {k: float(v) for k, v in g.sync_and_compute(None).items()}
                counts = [None] * world
                dist.all_gather_object(counts, calls[n:])
                assert counts[0] == counts[1], (seed, counts)
                helds = [None] * world
                dist.all_gather_object(helds, held)
                if not any(getattr(h, "mx_kept", False) for h in helds):
                    _check(got, _reference(helds), f"seed {seed}")
                    checked += 1
    return checked


def test_random_programs_with_rank_local_calls():
    checked = run_distributed(_program_worker, 2, list(range(12)), timeout=240)
    assert min(checked) >= 12, checked


# -- 6. formula-only settings are compared at the first sync ------------------------------------------------------------
SETTINGS = {
    "Accuracy average": (lambda r: dk.Accuracy(task="multiclass", num_classes=3, average=("micro", "macro")[r]),
                         "average", lambda m: m.update(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))),
    "ConfusionMatrix normalize": (lambda r: dk.ConfusionMatrix(task="multiclass", num_classes=3,
                                                               normalize=(None, "true")[r]),
                                  "normalize", lambda m: m.update(torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1]))),
    "MSE squared": (lambda r: dk.MeanSquaredError(squared=(True, False)[r]), "squared",
                    lambda m: m.update(torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]))),
    "CalibrationError norm": (lambda r: dk.CalibrationError(task="binary", norm=("l1", "max")[r]), "norm",
                              lambda m: m.update(torch.tensor([0.2, 0.9]), torch.tensor([0, 1]))),
    "AUROC max_fpr": (lambda r: dk.AUROC(task="binary", max_fpr=(None, 0.5)[r]), "max_fpr",
                      lambda m: m.update(torch.tensor([0.2, 0.9]), torch.tensor([0, 1]))),
    "R2Score adjusted": (lambda r: dk.R2Score(adjusted=(0, 1)[r]), "adjusted",
                         lambda m: m.update(torch.tensor([0.0, 1.0, 3.0]), torch.tensor([1.0, 1.0, 2.0]))),
}


def _settings_worker(rank, world, name):
    make, _, feed = SETTINGS[name]
    m = make(rank)
    feed(m)
    m.sync(None)
    return m.compute().tolist()


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_formula_only_settings_differing_across_ranks_raise_on_every_rank(name):
    field = SETTINGS[name][1]
    out = run_distributed_expect_errors(_settings_worker, 2, name, timeout=90)
    for rank, (status, msg) in out.items():
        assert status == "error", (rank, status, msg)
        assert "ValueError" in msg and field in msg and "ranks [0]" in msg and "ranks [1]" in msg, msg
