"""Catalogue metrics synced over real gloo ranks (2 and 4, uneven shards,
DistributedSampler-style padding masked out) equal the single-process result
on the concatenated data: states are sufficient statistics that add up, so
averaging per-rank accuracies cannot happen."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import d9d_kernels as dk
from tests.dist_utils import run_distributed

N, C, PAD = 157, 6, 3


def _data():
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(N, C, generator=g, dtype=torch.float64) * 2
    target = torch.randint(0, C, (N,), generator=g)
    target[torch.rand(N, generator=g) < 0.1] = -100  # ignore_index
    x = 1e6 + torch.randn(N, generator=g, dtype=torch.float64)  # far from 0: pivots differ per rank
    y = x + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)
    w = torch.rand(N, generator=g, dtype=torch.float64) + 0.1
    pb = torch.rand(N, generator=g, dtype=torch.float64)
    tb = (torch.rand(N, generator=g) < pb).long()
    return logits, target, x, y, w, pb, tb


def _groups():
    ig = dict(ignore_index=-100)
    cls = dk.MetricGroup({
        "acc": dk.Accuracy(task="multiclass", num_classes=C, **ig),
        "top3": dk.Accuracy(task="multiclass", num_classes=C, top_k=3, **ig),
        "f1": dk.F1Score(task="multiclass", num_classes=C, average="macro", **ig),
        "prec": dk.Precision(task="multiclass", num_classes=C, average="weighted", **ig),
        "rec": dk.Recall(task="multiclass", num_classes=C, average="none", **ig),
        "jac": dk.JaccardIndex(task="multiclass", num_classes=C, **ig),
        "spec": dk.Specificity(task="multiclass", num_classes=C, average="macro", **ig),
        "mcc": dk.MatthewsCorrCoef(task="multiclass", num_classes=C, **ig),
        "kappa": dk.CohenKappa(task="multiclass", num_classes=C, **ig),
        "cm": dk.ConfusionMatrix(task="multiclass", num_classes=C, **ig),
        "auroc": dk.AUROC(task="multiclass", num_classes=C, num_bins=500, **ig),
        "ap": dk.AveragePrecision(task="multiclass", num_classes=C, num_bins=500, **ig),
        "ppl": dk.Perplexity(num_classes=C, **ig),
    })
    reg = dk.MetricGroup({
        "mse": dk.MeanSquaredError(), "rmse": dk.MeanSquaredError(squared=False), "mae": dk.MeanAbsoluteError(),
        "r2": dk.R2Score(), "pearson": dk.PearsonCorrCoef(), "ev": dk.ExplainedVariance(),
    })
    binary = dk.F1Score(task="binary", threshold=0.4)  # standalone: a group of one
    bauroc = dk.AUROC(task="binary")
    return cls, reg, binary, bauroc


def _feed(groups, sl, pad_rows):
    """One shard ``sl`` plus padded duplicate rows (masked out), in two chunks."""
    cls, reg, binary, bauroc = groups
    logits, target, x, y, w, pb, tb = _data()
    idx = torch.cat([torch.arange(N)[sl], torch.arange(pad_rows)])
    mask = torch.arange(len(idx)) < len(idx) - pad_rows
    for part in torch.tensor_split(torch.arange(len(idx)), 2):
        i, m = idx[part], mask[part]
        cls.update(preds=logits[i], target=target[i], mask=m)
        reg.update(preds=x[i], target=y[i], weights=w[i], mask=m)
        binary.update(pb[i], tb[i], mask=m)
        bauroc.update(pb[i], tb[i], mask=m)


def _results(groups):
    cls, reg, binary, bauroc = groups
    out = {f"cls.{k}": v.tolist() for k, v in cls.compute().items()}
    out.update({f"reg.{k}": v.tolist() for k, v in reg.compute().items()})
    out["binary.f1"] = binary.compute().tolist()
    out["binary.auroc"] = bauroc.compute().tolist()
    return out


def _worker(rank, world):
    cuts = {2: [0, 40, N], 4: [0, 13, 13, 14, N]}[world]  # uneven: an empty shard (padding only), one of 1 row
    groups = _groups()
    _feed(groups, slice(cuts[rank], cuts[rank + 1]), PAD if rank % 2 else 0)
    local = _results(groups)
    for g in groups:
        g.trigger_sync(dk.DistributedContext())
    for g in groups:
        g.wait_sync()
    return {"synced": _results(groups), "local": local}


def _single_process():
    groups = _groups()
    _feed(groups, slice(0, N), 0)
    return _results(groups)


@pytest.mark.parametrize("world", [2, 4])
def test_synced_equals_single_process_on_concatenated_data(world):
    out = run_distributed(_worker, world, timeout=180.0)
    ref = _single_process()
    for rank in range(world):
        got = out[rank]["synced"]
        assert got.keys() == ref.keys()
        for k in ref:
            if k == "cls.cm":
                assert got[k] == ref[k], (rank, k)  # counts: exact
            elif k.startswith("reg."):  # moments re-centred to one pivot: float64 rounding only
                np.testing.assert_allclose(got[k], ref[k], rtol=1e-9, err_msg=f"rank {rank} {k}")
            else:
                np.testing.assert_allclose(got[k], ref[k], rtol=1e-12, atol=1e-12, err_msg=f"rank {rank} {k}")
    # the seed-tutorial mistake (mean of per-rank accuracies) would give a different number here
    per_rank_mean = np.mean([out[r]["local"]["cls.acc"] for r in range(world)])
    assert abs(per_rank_mean - ref["cls.acc"]) > 1e-6
