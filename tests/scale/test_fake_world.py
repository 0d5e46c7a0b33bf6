"""The real library code on torch's fake process group at W = 1,024, 16,384
and 131,072 (one rank in the middle of the world, in this process): meshes,
contexts, a MetricGroup of every catalogue class, first and steady syncs,
dk.functional reductions and checkpoint templates. Store operations must not
grow with W (a counting store), nor host work (Python and C calls counted
by a profile hook; the host times are recorded by bench/bench_scale.py)."""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
import torch.distributed as dist

import d9d_kernels as dk
from tests.scale.fake_world import catalogue_group, fake_world, feed, host_calls

WORLDS = (1024, 16384, 131072)
STEADY = 20


def _values(g) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in g.compute().items()}


def _same(a: dict, b: dict) -> bool:
    """Equal values: a sync re-expresses moment sums about a reference every rank shares (rounding only)."""
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-12, atol=0, equal_nan=True) for k in a)


def _one_world(W: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    out: dict = {"ops": {}, "calls": {}}
    with fake_world(W) as store:
        rank = dist.get_rank()

        def count(phase, fn):
            n = len(store.ops)
            res = fn()
            out["ops"][phase] = len(store.ops) - n
            return res

        mesh2 = init_device_mesh("cpu", (W // 8, 8), mesh_dim_names=("dp", "tp"))
        mesh3 = init_device_mesh("cpu", (W // 64, 8, 8), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        dp = count("from_mesh dp", lambda: dk.DistributedContext.from_mesh(mesh2, dims="dp"))
        dp3 = count("from_mesh 3-D", lambda: dk.DistributedContext.from_mesh(mesh3))
        out["dp"] = (dp.world_size, dp.rank, dp.ranks[:3])
        out["dp3"] = (dp3.world_size, dp3.rank)
        out["rank"] = rank

        ctxs = {"world": dk.DistributedContext(), "dp": dp, "dp3": dp3, "tp group": mesh2.get_group("tp"),
                "mesh": mesh3}
        groups = {}
        for name, ctx in ctxs.items():
            g, twin = catalogue_group(), catalogue_group()
            feed(g), feed(twin)
            first = count(f"first sync {name}", lambda: host_calls(lambda: (g.trigger_sync(ctx), g.wait_sync())))
            out["calls"][f"first sync {name}"] = first
            out[f"synced equals unsynced {name}"] = _same(_values(g), _values(twin))
            groups[name] = (g, ctx)
        g, ctx = groups["world"]
        out["sum"] = g.compute()["sum"].item()
        steady = lambda: (g.trigger_sync(ctx), g.wait_sync())  # noqa: E731
        count("steady syncs", lambda: [steady() for _ in range(STEADY)])
        out["calls"]["steady"] = host_calls(steady)

        x = {"loss": torch.tensor(2.5), "tokens": torch.tensor(7), "gnorm": torch.tensor([0.5, 3.0]),
             "low": torch.tensor(-1.0)}
        how = {"loss": "mean", "tokens": "sum", "gnorm": "max", "low": "min"}
        out["functional"] = count("functional", lambda: {
            k: v.tolist() for k, v in dk.functional.reduce_custom(x, how, ctx=dp).items()})
        count("functional", lambda: dk.functional.reduce_sum(x, ctx=mesh2))

        def checkpoint():
            import torch.distributed.checkpoint as dcp

            sd = g.state_dict()
            tmpl = dk.checkpoint.for_resume(g, 2 * W).state_dict()
            path = tempfile.mkdtemp()
            dcp.save({"metrics": g}, checkpoint_id=path, no_dist=True)
            fresh = catalogue_group()
            dcp.load({"metrics": dk.checkpoint.for_resume(fresh, W)}, checkpoint_id=path, no_dist=True)
            return sorted(sd), sorted(tmpl), all(
                torch.allclose(fresh._storage.local[k], g._storage.local[k], rtol=0, atol=0, equal_nan=True)
                for k in g._storage.local)

        out["checkpoint"] = count("checkpoint", checkpoint)
    return out


@pytest.fixture(scope="module")
def worlds():
    return {W: _one_world(W) for W in WORLDS}


@pytest.mark.parametrize("W", WORLDS)
def test_mesh_contexts_at_scale(worlds, W):
    res = worlds[W]
    r = res["rank"]
    assert r == W // 2 + 3
    # (dp, tp) = (W/8, 8): rank r = 8 dp + tp; the dp group holds ranks tp, tp + 8, ...
    assert res["dp"] == (W // 8, r // 8, [r % 8, r % 8 + 8, r % 8 + 16])
    # 3-D: (dp_replicate, dp_shard) flattened: W/8 ranks, index (8 dr + ds) = r // 8
    assert res["dp3"] == (W // 8, r // 8)


@pytest.mark.parametrize("W", WORLDS)
def test_every_family_syncs_at_scale(worlds, W):
    res = worlds[W]
    for name in ("world", "dp", "dp3", "tp group", "mesh"):
        # the fake group hands back this rank's own data: the synced values are the local ones
        assert res[f"synced equals unsynced {name}"], name
    gen = torch.Generator().manual_seed(0)
    assert res["sum"] == pytest.approx(math.fsum((torch.rand(16, generator=gen, dtype=torch.float64) + 1).tolist()))


@pytest.mark.parametrize("W", WORLDS)
def test_functional_and_checkpoint_at_scale(worlds, W):
    res = worlds[W]
    f = res["functional"]
    assert f["loss"] == pytest.approx(2.5 / (W // 8)) and f["tokens"] == 7 and f["gnorm"] == [0.5, 3.0]
    assert f["low"] == -1.0
    keys, template, restored = res["checkpoint"]
    r = res["rank"]
    assert keys == sorted(["world_size", "schema", f"rank_{r}"])
    assert template == sorted(["world_size", "schema", f"rank_{r}", f"rank_{r + W}"])  # s % W == r
    assert restored


def test_store_operations_do_not_grow_with_world(worlds):
    ops = [worlds[W]["ops"] for W in WORLDS]
    assert ops[0] == ops[1] == ops[2], ops
    # none at all in the library's paths: handshakes are collectives
    assert all(n == 0 for n in ops[0].values()), ops[0]


def test_first_sync_host_work_does_not_grow_with_world(worlds):
    # the handshake is collectives over fixed-size tensors: no per-rank Python
    lo, hi = worlds[WORLDS[0]]["calls"], worlds[WORLDS[-1]]["calls"]
    for name in ("world", "dp", "dp3", "tp group", "mesh"):
        key = f"first sync {name}"
        assert hi[key] <= 1.3 * lo[key], (key, lo[key], hi[key])


def test_steady_sync_host_work_does_not_grow_with_world(worlds):
    # trigger_sync + wait_sync of the catalogue group on the world context;
    # from W = 16,384 on, MAX no longer folds into the sum and takes a second
    # collective: one more call chain, then no growth at all
    calls = [worlds[W]["calls"]["steady"] for W in WORLDS]
    assert calls[1] == calls[2], calls
    assert calls[0] <= calls[1] <= 1.5 * calls[0], calls
