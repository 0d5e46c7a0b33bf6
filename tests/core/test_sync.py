"""Distributed sync on real gloo ranks: results, collective counts, async, errors."""

from __future__ import annotations

import math

import pytest
import torch

import d9d_kernels as dk
from d9d_kernels.core import sync as metric_mod
from tests.dist_utils import run_distributed, run_distributed_expect_errors, spy_collectives

N_TOTAL = 103  # uneven shards


def _shards(world):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_TOTAL, generator=g, dtype=torch.float64) * 5 + 1e6  # far from 0: pivots matter
    w = torch.rand(N_TOTAL, generator=g, dtype=torch.float64) + 0.1
    cuts = [0] + sorted(torch.randperm(N_TOTAL - 1, generator=g)[: world - 1].add(1).tolist()) + [N_TOTAL]
    return x, w, [(cuts[r], cuts[r + 1]) for r in range(world)]


_CALLS: list[str] = []


def _spy():
    """Counts every collective call (patched on torch.distributed and c10d)."""
    return spy_collectives(_CALLS)


def _group():
    return dk.MetricGroup({"sum": dk.SumMetric(), "mean": dk.WeightedMeanMetric(),
                           "max": dk.MaxMetric(), "min": dk.MinMetric()})


def _feed(g, x, w, pad):
    """Feeds a shard plus `pad` padded (masked) duplicates, in two chunks."""
    xp = torch.cat([x, x[:pad] * 0 + 1e9])
    wp = torch.cat([w, w[:pad]])
    mask = torch.arange(len(xp)) < len(x)
    h = len(xp) // 2
    for sl in (slice(0, h), slice(h, None)):
        g["sum"].update(xp[sl], weights=wp[sl], mask=mask[sl])
        g["mean"].update(values=xp[sl], weights=wp[sl], mask=mask[sl])
        g["max"].update(xp[sl], mask=mask[sl])
        g["min"].update(xp[sl], weights=wp[sl], mask=mask[sl])


def _aggregation_worker(rank, world):
    x, w, shards = _shards(world)
    a, b = shards[rank]
    g = _group()
    _feed(g, x[a:b], w[a:b], pad=2)
    calls = _spy()
    g.trigger_sync(dk.DistributedContext())
    g.wait_sync()
    first = {k: v.item() for k, v in g.compute().items()}
    n_first = len(calls)
    # async semantics: updates between trigger and wait are kept for the next sync
    g.trigger_sync()
    g["sum"].update(float(rank + 1))
    g.wait_sync()
    stale = g.compute()["sum"].item()
    g.trigger_sync()
    g.wait_sync()
    return first, n_first, len(calls), stale, g.compute()["sum"].item()


@pytest.mark.parametrize("world", [2, 4])
def test_aggregation_equals_single_process(world):
    out = run_distributed(_aggregation_worker, world)
    x, w, _ = _shards(world)
    exp_sum = math.fsum((x * w).tolist())
    exp = {"sum": exp_sum, "mean": exp_sum / math.fsum(w.tolist()), "max": x.max().item(), "min": x.min().item()}
    # single process on the concatenated data gives the same
    single = _group()
    _feed(single, x, w, pad=0)
    for r, (first, n_first, n_all, stale, final) in enumerate(out):
        for k, v in exp.items():
            assert first[k] == pytest.approx(v, rel=1e-13), (r, k)
            assert single[k].compute().item() == pytest.approx(v, rel=1e-13)
        # the first sync: one fixed-shape handshake (schema and configuration fingerprint), then
        # SUM + small MAX buffer in one collective (MAX folded into the sum); later syncs: that one
        assert n_first == 2, n_first
        assert n_all == 4
        assert stale == pytest.approx(exp_sum, rel=1e-13)
        assert final == pytest.approx(exp_sum + world * (world + 1) / 2, rel=1e-13)


def _count_worker(rank, world):
    out = {}
    for with_max in (False, True, "unfolded"):
        if with_max == "unfolded":  # a MAX buffer too large to fold: its own "max" all_reduce
            metric_mod.FOLD_MAX_ELEMS = 0
        metrics = {f"s{i}": dk.SumMetric() for i in range(10)}
        metrics.update({f"m{i}": dk.WeightedMeanMetric() for i in range(10)})
        if with_max:
            metrics["peak"] = dk.MaxMetric()
        g = dk.MetricGroup(metrics)
        for i in range(10):
            g[f"s{i}"].update(torch.full((rank + 2,), float(i)))
            g[f"m{i}"].update(float(i + rank), weights=float(rank + 1))
        if with_max:
            g["peak"].update(torch.tensor([float(rank)]))
        calls = _spy()
        counts = []
        for _ in range(2):
            before = len(calls)
            g.trigger_sync()
            g.wait_sync()
            counts.append(len(calls) - before)
        out[with_max] = (counts, {k: v.item() for k, v in g.compute().items()})
    metric_mod.FOLD_MAX_ELEMS = 8192
    # a standalone metric is a group of one
    for name, m in (("alone_mean", dk.WeightedMeanMetric()), ("alone_max", dk.MaxMetric())):
        m.update(torch.tensor([float(rank), 10.0 * rank]))
        before = len(calls)
        m.trigger_sync()
        m.wait_sync()
        out[name] = (len(calls) - before, m.compute().item())
    out["pivot"] = _pivot_part(rank, world)
    return out


@pytest.fixture(scope="module")
def count_run():
    """One 2-rank spawn shared by the collective-count and pivot tests."""
    return run_distributed(_count_worker, 2)


def test_collective_count_per_sync(count_run):
    world = 2
    out = count_run
    for per_rank in out:
        for with_max in (False, True, "unfolded"):
            counts, vals = per_rank[with_max]
            # first sync: + the handshake collective
            assert counts == ([3, 2] if with_max == "unfolded" else [2, 1]), (with_max, counts)
            for i in range(10):
                assert vals[f"s{i}"] == i * sum(r + 2 for r in range(world))
                num = sum((i + r) * (r + 1) for r in range(world))
                assert vals[f"m{i}"] == pytest.approx(num / sum(r + 1 for r in range(world)))
            if with_max:
                assert vals["peak"] == world - 1
        assert per_rank["alone_mean"] == (2, pytest.approx(sum(11.0 * r for r in range(world)) / (2 * world)))
        assert per_rank["alone_max"] == (2, 10.0 * (world - 1))


def _mismatch_worker(rank, world):
    members = {"a": dk.SumMetric(), "b": dk.WeightedMeanMetric()}
    if rank == 1:
        members = {"b": dk.WeightedMeanMetric(), "a": dk.SumMetric()}  # other order
    g = dk.MetricGroup(members)
    g["a"].update(1.0)
    g.trigger_sync(dk.DistributedContext(timeout=20))
    g.wait_sync()
    return g.compute()["a"].item()


def test_mismatched_groups_raise_on_every_rank():
    out = run_distributed_expect_errors(_mismatch_worker, 2, timeout=60)
    for r in range(2):
        status, msg = out[r]
        assert status == "error", (r, msg)
        assert msg.startswith("ValueError") and "schema" in msg, msg


def _absent_worker(rank, world, synced_once):
    import time

    g = dk.MetricGroup({"a": dk.SumMetric(), "b": dk.MaxMetric()})
    g["a"].update(1.0)
    ctx = dk.DistributedContext(timeout=3)
    if synced_once:  # handshake done: the next failure is the collective's timeout
        g.trigger_sync(ctx)
        g.wait_sync(ctx)
    if rank == 1:
        time.sleep(8)  # alive, but never syncs (again)
        return "skipped"
    g.trigger_sync(ctx)
    g.wait_sync(ctx)
    return g.compute()["a"].item()


@pytest.mark.parametrize("synced_once", [False, True])
def test_rank_that_never_syncs_raises_no_hang(synced_once):
    out = run_distributed_expect_errors(_absent_worker, 2, synced_once, timeout=60)
    assert out[1] == ("ok", "skipped")
    status, msg = out[0]
    assert status == "error" and msg.startswith("RuntimeError") and ("timeout" in msg or "did not" in msg), msg
    first = msg.splitlines()[0]
    # the first sync's handshake collective vs the data collective
    assert ("first-sync handshake" in first) != synced_once and ("all_reduce(sum)" in first) == synced_once, first


def _pivot_part(rank, world):
    # rank 0 sees nothing before the first sync; pivots differ otherwise
    m = dk.WeightedMeanMetric()
    x = torch.tensor([1e9 + rank * 7.0, 1e9 - 3.0 * rank, 1e9 + 0.5], dtype=torch.float64)
    if rank > 0:
        m.update(x + rank * 1e3)
    m.trigger_sync()
    m.wait_sync()
    first = m.compute().item()
    m.update(x)  # rank 0's first data: its own pivot
    m.trigger_sync()
    m.wait_sync()
    (ref,) = m._storage.sync.references.values()
    return first, m.compute().item(), m._storage.local["replica"].tolist(), ref.tolist()


def test_pivots_are_local_and_the_reference_shared(count_run):
    world = 2
    out = [o["pivot"] for o in count_run]
    xs = lambda r: [1e9 + r * 7.0, 1e9 - 3.0 * r, 1e9 + 0.5]  # noqa: E731
    first = [v + r * 1e3 for r in range(1, world) for v in xs(r)]
    second = first + [v for r in range(world) for v in xs(r)]
    for rank, (f, s, piv, ref) in enumerate(out):
        assert f == pytest.approx(math.fsum(first) / len(first), rel=1e-15)
        assert s == pytest.approx(math.fsum(second) / len(second), rel=1e-15)
        assert piv[0] == xs(rank)[0] + (rank * 1e3 if rank else 0.0)  # this rank's first value since its reset
        assert ref[0] == out[0][3][0] and math.isnan(ref[1])  # the synced mean, the same bits on every rank (no y)
        assert ref[0] == pytest.approx(s, rel=1e-15)


def _fold_reset_worker(rank, world):
    g = dk.MetricGroup({"peak": dk.MaxMetric(), "low": dk.MinMetric(), "n": dk.SumMetric()})
    out = []
    for step, (hi, lo) in enumerate([(10.0, -10.0), (1.0, -1.0), (2.0, -2.0)]):
        g.reset()
        g["peak"].update(torch.tensor([hi * (rank + 1)]))
        g["low"].update(torch.tensor([lo * (rank + 1)]))
        g["n"].update(1.0)
        if step == 1:  # a sync discarded by reset() must not leak into the next one
            g.trigger_sync()
            g.reset()
            g.wait_sync()
            g["peak"].update(torch.tensor([hi * (rank + 1)]))
            g["low"].update(torch.tensor([lo * (rank + 1)]))
            g["n"].update(1.0)
        g.trigger_sync()
        g.wait_sync()
        out.append({k: v.item() for k, v in g.compute().items()})
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_folded_max_after_reset_sees_only_new_values(world):
    """The folded MAX rows are reused across syncs: stale rows (an earlier
    sync, a discarded one) must never reach a later result."""
    for per_rank in run_distributed(_fold_reset_worker, world):
        for (hi, lo), got in zip([(10.0, -10.0), (1.0, -1.0), (2.0, -2.0)], per_rank):
            assert got == {"peak": hi * world, "low": lo * world, "n": float(world)}


def _members_worker(rank, world):
    nc = 6 if rank == 1 else 5
    members = {"acc": dk.Accuracy(task="multiclass", num_classes=nc), "loss": dk.WeightedMeanMetric()}
    if rank == 2:
        members["tokens"] = dk.SumMetric()
    g = dk.MetricGroup(members)
    g["loss"].update(1.0)
    g.trigger_sync(dk.DistributedContext(timeout=20))
    g.wait_sync()
    return "synced"


def test_mismatch_names_each_member_in_words_on_every_rank():
    out = run_distributed_expect_errors(_members_worker, 3, timeout=90)
    for r in range(3):
        status, msg = out[r]
        assert status == "error" and msg.startswith("ValueError"), (r, msg)
        first = msg.splitlines()[0]
        assert "2 variants" in first or "3 variants" in first, first
        assert "MetricGroup['acc']: num_classes 5 on ranks [0, 2] vs 6 on ranks [1]" in first, first
        assert "MetricGroup['tokens'] (SumMetric) on ranks [2], missing on ranks [0, 1]" in first, first


def _store_spy_worker(rank, world, n_means):
    """Store operations and collectives of a first and a second sync; rank 0
    sees no data before the first (its pivots are unset)."""
    import torch.distributed.distributed_c10d as c10d

    store_calls = []
    orig = c10d._get_default_store

    def spy():
        store_calls.append(1)
        return orig()

    c10d._get_default_store = spy
    g = dk.MetricGroup({f"m{i}": dk.WeightedMeanMetric() for i in range(n_means)})
    if rank > 0:
        for i in range(n_means):
            g[f"m{i}"].update(torch.tensor([1e9 + i + 0.25 * rank, 1e9 - i], dtype=torch.float64))
    calls = _spy()
    counts = []
    for _ in range(2):
        before = len(calls)
        g.trigger_sync(dk.DistributedContext(timeout=20))
        g.wait_sync()
        counts.append(len(calls) - before)
    return counts, len(store_calls), g.compute()["m3"].item(), g._storage.local["replica"][6].item()


@pytest.mark.parametrize("n_means", [4, 130])
def test_handshake_uses_collectives_only(n_means):
    """No store operation in the sync path; the first sync adds one
    fixed-shape handshake whatever the number of pivoted statistics (130
    means: 260 pivot doubles), and rank 0, with no data, takes part alike;
    a mean far from 0 needs no corrective round (its sums about 0 are exact
    to its size)."""
    out = run_distributed(_store_spy_worker, 3, n_means)
    vals = [1e9 + 3 + 0.25 * r for r in (1, 2)] + [1e9 - 3] * 2
    for rank, (counts, n_store, m3, pivot) in enumerate(out):
        assert counts == [2, 1], counts
        assert n_store == 0
        assert m3 == pytest.approx(math.fsum(vals) / 4, rel=1e-15)
        # each rank's local pivot is its own first value since its reset (rank 0: none)
        assert (math.isnan(pivot) if rank == 0 else pivot == 1e9 + 3 + 0.25 * rank), (rank, pivot)


def _ctx_kinds_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out = {}
    mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    for name, ctx in (("world_pg", dist.group.WORLD), ("mesh_all", mesh2), ("mesh_dp", mesh2["dp"]),
                      ("mesh_1d", init_device_mesh("cpu", (world,)))):
        m = dk.SumMetric()
        m.update(float(rank + 1))
        m.trigger_sync(ctx)
        m.wait_sync(ctx)
        out[name] = m.compute().item()
    try:
        dk.SumMetric().trigger_sync("world")
    except TypeError as e:
        out["bad"] = str(e)
    return out


def test_trigger_sync_takes_process_groups_and_meshes():
    out = run_distributed(_ctx_kinds_worker, 4)
    for rank, res in enumerate(out):
        total = sum(r + 1 for r in range(4))
        assert res["world_pg"] == res["mesh_all"] == res["mesh_1d"] == total
        # mesh ("dp", "tp") = (2, 2): rank r's dp column is {r % 2, r % 2 + 2}
        assert res["mesh_dp"] == (rank % 2 + 1) + (rank % 2 + 3)
        assert "ProcessGroup" in res["bad"] and "DeviceMesh" in res["bad"]


def test_mismatch_message_caps_listed_ranks_at_large_worlds():
    import json

    from d9d_kernels.distributed import fmt_ranks

    W = 131072
    a = json.dumps([["MetricGroup['acc']", {"class": "Accuracy", "num_classes": "5"}]])
    b = json.dumps([["MetricGroup['acc']", {"class": "Accuracy", "num_classes": "6"}]])
    msg = dk.distributed.explain_members([(list(range(0, W, 2)), a), (list(range(1, W, 2)), b)])
    assert msg == ("MetricGroup['acc']: num_classes 5 on ranks [0, 2, 4, 6, 8, 10, 12, 14, ... (65,536 ranks)] "
                   "vs 6 on ranks [1, 3, 5, 7, 9, 11, 13, 15, ... (65,536 ranks)]")
    assert fmt_ranks([3, 1]) == "[3, 1]"
