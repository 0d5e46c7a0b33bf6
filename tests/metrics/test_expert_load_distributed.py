"""ExpertLoad on 4 gloo ranks: pp 2 x dp 2 through a real d9d context (CPU meshes).

Stage s owns layers 2s, 2s + 1 of 4 and feeds only those (``layers=``); the
two dp ranks of a stage route different tokens. After one sync of a group
(ExpertLoad + a loss mean + an accuracy) every rank holds every layer's
global load: the sum of the four ranks' batches, which each rank rebuilds
here from the same seeds. Steady syncs are one collective.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("d9d.metric")

import d9d_kernels as dk  # noqa: E402
from tests.dist_utils import run_distributed, spy_collectives  # noqa: E402

L, E, K, T = 4, 6, 2, 25


def _batch(pp: int, dp: int, step: int) -> torch.Tensor:
    """Routing [2, T, K] of stage ``pp``'s layers on data shard ``dp``; skewed, some slots dropped."""
    g = torch.Generator().manual_seed(1000 * pp + 100 * dp + step)
    w = torch.rand(2, T, E, generator=g) + torch.tensor([0.8] + [0.0] * (E - 1)) * pp
    idx = w.topk(K, -1).indices
    idx[torch.rand(idx.shape, generator=g) < 0.1] = -1
    if pp == 0 and dp == 1:
        idx[1] = 3  # one expert takes every slot of layer 1 on this shard
    return idx


def _global_load() -> torch.Tensor:
    load = torch.zeros(L, E, dtype=torch.float64)
    for pp in range(2):
        for dp in range(2):
            for step in range(2):
                idx = _batch(pp, dp, step)
                for i in range(2):
                    v = idx[i].reshape(-1)
                    load[2 * pp + i] += torch.bincount(v[v >= 0], minlength=E).double()
    return load


def _d9d_context():
    from d9d.core.dist_context import DeviceMeshParameters, DistributedContext, configured, device_mesh_domains
    from torch.distributed.device_mesh import init_device_mesh

    ctx = object.__new__(DistributedContext)
    ctx._params = DeviceMeshParameters(pipeline_parallel=2, data_parallel_shard=2)
    build = device_mesh_domains.init_device_mesh
    device_mesh_domains.init_device_mesh = lambda device_type, **kw: init_device_mesh("cpu", **kw)
    try:
        ctx._meshes = configured._build_mesh_domains(ctx._params)
    finally:
        device_mesh_domains.init_device_mesh = build
    return ctx


def _worker(rank: int, world: int) -> dict:
    from d9d.metric.impl.container import ComposeMetric

    calls: list = []
    spy_collectives(calls)
    ctx = _d9d_context()
    mesh = ctx.mesh_for("regular")
    pp, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp_shard")
    resolved = dk.distributed.as_context(ctx)
    g = dk.MetricGroup({
        "moe": dk.ExpertLoad(E, num_layers=L, top_k=K),
        "loss": dk.WeightedMeanMetric(),
        "acc": dk.Accuracy(task="multiclass", num_classes=3),
    })
    metrics = ComposeMetric({"train": g})
    counts = []
    for step in range(2):
        g["moe"].update(_batch(pp, dp, step), layers=[2 * pp, 2 * pp + 1])
        if pp == 1:  # the last stage computes the loss and the accuracy
            g["loss"].update(values=torch.tensor(float(dp + step)))
            g.update(preds=torch.tensor([0, 1, 2]), target=torch.tensor([0, 1, dp]))
        before = len(calls)
        metrics.sync(ctx)
        counts.append(len(calls) - before)
    out = metrics.compute()["train"]
    return dict(ranks=resolved.ranks, duplicate=resolved.duplicate, counts=counts,
                load=g["moe"].per_layer()["load"].tolist(), moe={k: v.item() for k, v in out["moe"].items()},
                loss=out["loss"].item(), acc=out["acc"].item())


def _summary(load: torch.Tensor) -> dict:
    tot = load.sum(1)
    mean = tot / E
    p = load / tot[:, None]
    ent = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(1) / math.log(E)
    return dict(max_violation=(load.amax(1) / mean - 1).max().item(), dead_experts=(load == 0).sum().item(),
                cv=(load.std(1, unbiased=False) / mean).mean().item(), entropy=ent.mean().item())


@pytest.mark.timeout(300)
def test_pp2_dp2_every_rank_has_every_layer():
    out = run_distributed(_worker, 4, timeout=150, pg_timeout=30)
    want = _global_load()
    ref = _summary(want)
    for rank, o in enumerate(out):
        assert sorted(o["ranks"]) == [0, 1, 2, 3], o["ranks"]  # the default d9d dims include pp
        assert o["duplicate"] is False  # every rank's entry counts once in a resharded checkpoint
        assert o["counts"][1] == 1, o["counts"]  # a steady sync: one collective for the whole group
        assert torch.equal(torch.tensor(o["load"], dtype=torch.float64), want), rank
        for k, v in ref.items():
            assert o["moe"][k] == pytest.approx(v, rel=1e-12), (rank, k)
        assert o["loss"] == pytest.approx(1.0) and o["acc"] == pytest.approx(2 / 3)
