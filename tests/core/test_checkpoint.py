"""DCP checkpoints of metric groups: exact round trip, resume on 4->2 and 2->4 ranks."""

from __future__ import annotations

import math

import pytest
import torch

import d9d_kernels as dk
from tests.dist_utils import run_distributed


def _group():
    return dk.MetricGroup({"sum": dk.SumMetric(), "mean": dk.WeightedMeanMetric(),
                           "max": dk.MaxMetric(), "min": dk.MinMetric()})


def _rank_data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    n = 5 + 3 * rank  # uneven
    x = torch.randn(n, generator=g, dtype=torch.float64) + 1e7 + 1e3 * rank  # different pivots per rank
    w = torch.rand(n, generator=g, dtype=torch.float64) + 0.5
    return x, w


def _expected(ranks):
    xs = torch.cat([_rank_data(r)[0] for r in ranks])
    ws = torch.cat([_rank_data(r)[1] for r in ranks])
    s = math.fsum((xs * ws).tolist())
    return {"sum": s, "mean": s / math.fsum(ws.tolist()), "max": xs.max().item(), "min": xs.min().item()}


def _feed(g, rank):
    x, w = _rank_data(rank)
    g["sum"].update(x, weights=w)
    g["mean"].update(x, weights=w)
    g["max"].update(x)
    g["min"].update(x)


def _synced(g):
    g.trigger_sync()
    g.wait_sync()
    return {k: v.item() for k, v in g.compute().items()}


def _worker(rank, world, load_path, save_path, feed_base):
    """Optionally resumes from ``load_path`` (any saved world size), feeds
    ``feed_base + rank``'s data, syncs, and optionally saves to ``save_path``
    and checks the exact same-world round trip into a fresh group."""
    import torch.distributed.checkpoint as dcp

    g = _group()
    out = {}
    if load_path is not None:
        n = dk.checkpoint.saved_world_size(load_path, key="metrics")
        dcp.load({"metrics": dk.checkpoint.for_resume(g, n)}, checkpoint_id=load_path)
        out["saved_world"] = n
        out["loaded_ranks"] = dk.checkpoint.ranks_for(rank, world, n)
        out["local_sum"] = g["sum"].compute().item()
        out["resumed"] = _synced(g)
    _feed(g, feed_base + rank)
    out["synced"] = _synced(g)  # the sync also aligns pivots; local state stays local
    if save_path is not None:
        local = {k: v.clone() for k, v in g.state_dict()[f"rank_{rank}"].items()}
        dcp.save({"metrics": g}, checkpoint_id=save_path)
        h = _group()
        dcp.load({"metrics": h}, checkpoint_id=save_path)
        back = h.state_dict()[f"rank_{rank}"]
        out["exact"] = all(
            torch.equal(torch.nan_to_num(back[k], nan=7.0), torch.nan_to_num(local[k], nan=7.0)) for k in local
        )
        out["roundtrip"] = _synced(h)
    return out


def _check(out, world, data_ranks, saved=None, saved_ranks=()):
    exp_resumed = _expected(saved_ranks) if saved is not None else None
    exp = _expected(list(saved_ranks) + list(data_ranks))
    for r, o in enumerate(out):
        if saved is not None:
            assert o["saved_world"] == saved
            assert o["loaded_ranks"] == [s for s in range(saved) if s % world == r]
            loaded = [saved_ranks[s] for s in o["loaded_ranks"]]
            assert o["local_sum"] == pytest.approx(_expected(loaded)["sum"] if loaded else 0.0, rel=1e-14)
            for k, v in exp_resumed.items():
                assert o["resumed"][k] == pytest.approx(v, rel=1e-14), k  # nothing lost, nothing doubled
        for k, v in exp.items():
            assert o["synced"][k] == pytest.approx(v, rel=1e-14), k
            if "roundtrip" in o:
                assert o["roundtrip"][k] == pytest.approx(v, rel=1e-14), k
        if "exact" in o:
            assert o["exact"], "DCP round trip must restore this rank's local state exactly"


def test_round_trip_and_resume_4_to_2_to_4(tmp_path):
    p4, p2 = str(tmp_path / "on4"), str(tmp_path / "on2")
    data4 = [0, 1, 2, 3]
    _check(run_distributed(_worker, 4, None, p4, 0), 4, data4)
    data2 = [10, 11]
    _check(run_distributed(_worker, 2, p4, p2, 10), 2, data2, saved=4, saved_ranks=data4)
    # saved "ranks" of p2 hold the merged data of ranks {0,2}+10 and {1,3}+11
    out = run_distributed(_worker, 4, p2, None, 20)
    exp = _expected(data4 + data2 + [20, 21, 22, 23])
    exp_resumed = _expected(data4 + data2)
    for r, o in enumerate(out):
        assert o["saved_world"] == 2 and o["loaded_ranks"] == ([r] if r < 2 else [])
        if r >= 2:
            assert o["local_sum"] == 0.0  # loads nothing, starts empty
        for k in exp:
            assert o["resumed"][k] == pytest.approx(exp_resumed[k], rel=1e-14), k
            assert o["synced"][k] == pytest.approx(exp[k], rel=1e-14), k


def test_load_state_dict_merges_and_checks_schema():
    a, b = _group(), _group()
    _feed(a, 0)
    _feed(b, 1)
    merged = _group()
    merged.load_state_dict({"rank_0": a.state_dict()["rank_0"], "rank_1": b.state_dict()["rank_0"],
                            "schema": a.state_dict()["schema"]})
    exp = _expected([0, 1])
    for k, v in merged.compute().items():
        assert v.item() == pytest.approx(exp[k], rel=1e-14), k
    other = dk.MetricGroup({"sum": dk.SumMetric()})
    with pytest.raises(ValueError, match="schema"):
        other.load_state_dict(a.state_dict())
    from torch.distributed.checkpoint.stateful import Stateful

    assert isinstance(a, Stateful) and isinstance(dk.SumMetric(), Stateful)
    empty = _group()
    _feed(empty, 3)
    dk.checkpoint.for_resume(empty, 2).load_state_dict({"world_size": 2})  # loads nothing: starts empty
    assert empty.compute()["sum"].item() == 0.0
    with pytest.raises(ValueError, match="for_resume"):  # other world size without for_resume
        empty.load_state_dict({**a.state_dict(), "world_size": 4})
    assert empty.compute()["sum"].item() == 0.0
    tmpl = dk.checkpoint.metric_state_template(a, saved_world_size=5, rank=1, world_size=2)
    assert sorted(k for k in tmpl if k.startswith("rank_")) == ["rank_1", "rank_3"]
    assert empty.compute()["sum"].item() == 0.0


# ---- replicas: tensor-parallel ranks hold copies of the same data ---------------------------------

def _tp_worker(rank, world, shape, load, save, feed, save_first):
    """On a ("dp", "tp") mesh of ``shape`` syncing over "dp" (``shape`` None:
    the world): resumes from ``load`` through ``for_resume`` with that context,
    feeds the data of ``feed`` + the rank's dp position (tp replicas feed the
    same), saves to ``save`` (before the sync when ``save_first``, else after
    it) and returns the synced values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    ctx, d = None, rank
    if shape is not None:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        ctx, d = dk.DistributedContext.from_mesh(mesh, "dp"), mesh.get_coordinate()[0]
    g = _group()
    if load is not None:
        n = dk.checkpoint.saved_world_size(load, key="metrics")
        dcp.load({"metrics": dk.checkpoint.for_resume(g, n, ctx=ctx)}, checkpoint_id=load)
    if feed is not None:
        _feed(g, feed + d)
    if save is not None and save_first:
        dcp.save({"metrics": g}, checkpoint_id=save)
    g.trigger_sync(ctx)
    g.wait_sync(ctx)
    out = {k: v.item() for k, v in g.compute().items()}
    if save is not None and not save_first:
        g.trigger_sync()  # a sync over the world (which does not know the replicas) keeps what ctx recorded
        g.wait_sync()
        dcp.save({"metrics": g}, checkpoint_id=save)
    return out


def _all_equal(out, exp):
    for o in out:
        for k, v in exp.items():
            assert o[k] == pytest.approx(v, rel=1e-14), k


def test_resume_on_another_world_size_counts_tp_replicas_once(tmp_path):
    """Saved on dp 2 x tp 2 (each tp pair holds one copy of its dp shard's
    data); resumed on 2 plain ranks, on 1, on dp 2 x tp 2 (whose replicas load
    the same entries), and on dp 1 x tp 4 (every rank holds all the data):
    every rank's synced value is the saved data's, counted once. Then saved
    again on dp 2 x tp 2 before any sync (the flag comes from for_resume's
    ctx) and resumed on 2 ranks: still counted once."""
    saved = str(tmp_path / "dp2tp2")
    exp = _expected([0, 1])
    _all_equal(run_distributed(_tp_worker, 4, (2, 2), None, saved, 0, False), exp)
    _all_equal(run_distributed(_tp_worker, 2, None, saved, None, None, False), exp)
    _all_equal(run_distributed(_tp_worker, 1, None, saved, None, None, False), exp)
    _all_equal(run_distributed(_tp_worker, 4, (1, 4), saved, None, None, False), exp)
    again = str(tmp_path / "again")
    _all_equal(run_distributed(_tp_worker, 4, (2, 2), saved, again, None, True), exp)
    _all_equal(run_distributed(_tp_worker, 2, None, again, None, 10, False), _expected([0, 1, 10, 11]))


# ---- d9d's checkpointer: a plain dcp.load of the job state at another world size -----------------

class _JobState:
    """What d9d's ``JobState`` does with its metrics: ``dcp.save/load({"state": job})``."""

    def __init__(self, g):
        self.g = g

    def state_dict(self):
        return {"metrics": self.g.state_dict()}

    def load_state_dict(self, sd):
        self.g.load_state_dict(sd["metrics"])


def _job_worker(rank, world, path, save):
    import torch.distributed.checkpoint as dcp

    g = _group()
    if save:
        _feed(g, rank)
        dcp.save({"state": _JobState(g)}, checkpoint_id=path)
    else:
        dcp.load({"state": _JobState(g)}, checkpoint_id=path)
    return _synced(g)


@pytest.mark.xfail(strict=True, raises=AssertionError, reason=(
    "known limitation: the checkpoint holds one rank_<r> entry per saved rank, so a plain dcp.load at another "
    "world size (d9d's checkpointer) raises in load_state_dict (fewer ranks) or in DCP (more ranks); d9d's own "
    "data stream state (DataParallelMicrobatchPackStream, keyed dp_<rank>) has the same limit"))
@pytest.mark.parametrize("load_world", [1, 4])
def test_a_plain_load_on_another_world_size_resumes_the_global_value(tmp_path, load_world):
    path = str(tmp_path / "on2")
    saved = run_distributed(_job_worker, 2, path, True)
    for o in run_distributed(_job_worker, load_world, path, False):
        for k, v in saved[0].items():
            assert o[k] == pytest.approx(v, rel=1e-14), k
