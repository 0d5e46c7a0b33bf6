"""On a GPU: a dk MetricGroup inside d9d's own AsyncMetricCollector, with a real
(CUDA-built) d9d DistributedContext. bind() moves the group to CUDA; updates,
schedule_collection (sync + compute on the side stream) and collect_results
(reset) make no host sync (``torch.cuda.set_sync_debug_mode("error")`` raises
at any), and the values equal plain torch on the same batches."""

from __future__ import annotations

import pytest
import torch

import d9d_kernels as dk

pytest.importorskip("d9d")
pytestmark = pytest.mark.gpu

C = 50


def _group():
    kw = dict(task="multiclass", num_classes=C)
    return dk.MetricGroup({
        "loss": dk.WeightedMeanMetric(),
        "acc": dk.Accuracy(**kw),
        "top5": dk.Accuracy(**kw, top_k=5),
        "f1": dk.F1Score(**kw, average="macro"),
        "prec": dk.Precision(**kw, average="macro"),
    })


def _batches(n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(64, C, generator=g).cuda(), torch.randint(0, C, (64,), generator=g).cuda(),
             torch.rand((), generator=g).cuda(), torch.tensor(64, device="cuda")) for _ in range(n)]


def test_async_metric_collector_makes_no_host_sync(monkeypatch):
    from d9d.core.dist_context import DeviceMeshParameters
    from d9d.internals.metric_collector.collector import AsyncMetricCollector
    from sklearn.metrics import f1_score, precision_score

    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(k, v)
    ctx = DeviceMeshParameters().build()
    g = _group()
    collector = AsyncMetricCollector(g)
    collector.bind()
    batches = _batches()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for logits, target, loss, n in batches:
            g["loss"].update(values=loss, weights=n)
            g.update(preds=logits, target=target)
        collector.schedule_collection(ctx)
        out = collector.collect_results()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    logits = torch.cat([b[0] for b in batches]).cpu()
    target = torch.cat([b[1] for b in batches]).cpu()
    pred = logits.argmax(-1)
    want = {
        "loss": torch.stack([b[2] for b in batches]).double().mean().cpu(),
        "acc": (pred == target).double().mean(),
        "top5": (logits.topk(5, -1).indices == target[:, None]).any(-1).double().mean(),
        "f1": torch.tensor(f1_score(target, pred, average="macro", labels=range(C), zero_division=0)),
        "prec": torch.tensor(precision_score(target, pred, average="macro", labels=range(C), zero_division=0)),
    }
    for k, v in want.items():
        torch.testing.assert_close(out[k].double().cpu(), v.double(), rtol=1e-6, atol=1e-9, msg=lambda m: f"{k}: {m}")
    assert torch.isnan(g["loss"].compute().cpu())  # collect_results reset the group: no data, 0 / 0


def test_sync_and_compute_make_no_host_sync():
    """sync() and every member's compute() on CUDA state under sync-debug "error"
    (one GPU: the sync is local, a group of one needs no collective); bad inputs
    give NaN there, and the host read compute_to_host().result() raises."""
    g = _group().to("cuda")
    for logits, target, loss, n in _batches(2, seed=1):
        g["loss"].update(values=loss, weights=n)
        g.update(preds=logits, target=target)
    bad_logits = _batches(1, seed=2)[0][0]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        g.update(preds=bad_logits, target=torch.full((64,), C + 3, device="cuda"))  # out-of-range targets
        g.sync(None)
        vals = g.compute()
        members = {k: g[k].compute() for k in g}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(v.is_cuda for v in vals.values())
    assert torch.isnan(vals["acc"].cpu()) and torch.isnan(members["f1"].cpu())
    assert not torch.isnan(vals["loss"].cpu())
    with pytest.raises(ValueError, match="target_out_of_range=64"):
        g.compute_to_host().result()
