"""The calibration, segmentation, similarity, percentage-error and running
metrics synced over 2 real gloo ranks (uneven shards, padding rows masked
out where the metric takes a mask) equal the single-process result on the
concatenated data; RunningMean equals the mean over every rank's last
``window`` updates (torchmetrics' per-slot sum of its window states)."""

from __future__ import annotations

import numpy as np
import torch

import d9d_kernels as dk
from tests.dist_utils import run_distributed

N, C, WINDOW = 23, 4, 3
CUTS = [0, 7, N]  # uneven shards
PAD = 2  # padding rows duplicated on rank 1, masked out


def _data():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(N, C, generator=g, dtype=torch.float64) * 2
    labels = torch.randint(0, C, (N,), generator=g)
    seg_p = torch.randint(0, C, (N, 6, 5), generator=g)
    seg_t = torch.randint(0, C, (N, 6, 5), generator=g)
    seg_t[seg_t == C - 1] = 255  # void
    x = 1e6 + torch.randn(N, generator=g, dtype=torch.float64)
    y = x + torch.randn(N, generator=g, dtype=torch.float64)
    rows_p = torch.rand(N, 5, generator=g, dtype=torch.float64)
    rows_q = torch.rand(N, 5, generator=g, dtype=torch.float64)
    return logits, labels, seg_p, seg_t, x, y, rows_p, rows_q


def _metrics():
    cls = dk.MetricGroup({
        "ece": dk.CalibrationError(task="multiclass", num_classes=C, n_bins=7),
        "rms": dk.CalibrationError(task="multiclass", num_classes=C, norm="l2"),
        "acc": dk.Accuracy(task="multiclass", num_classes=C),
    })
    seg = dk.MetricGroup({
        "dice": dk.Dice(num_classes=C, input_format="index", average="none"),
        "dice_g": dk.Dice(num_classes=C, input_format="index", aggregation_level="global"),
        "miou": dk.MeanIoU(num_classes=C, input_format="index"),
        "gds": dk.GeneralizedDiceScore(num_classes=C, input_format="index"),
    })
    void_iou = dk.MeanIoU(num_classes=C, input_format="index", per_class=True, ignore_index=255)
    reg = dk.MetricGroup({"mape": dk.MeanAbsolutePercentageError(), "smape": dk.SymmetricMeanAbsolutePercentageError()})
    rows = dk.MetricGroup({"kl": dk.KLDivergence(), "cos": dk.CosineSimilarity(reduction="mean")})
    return cls, seg, void_iou, reg, rows


def _feed(ms, lo, hi, pad):
    cls, seg, void_iou, reg, rows = ms
    logits, labels, seg_p, seg_t, x, y, rows_p, rows_q = _data()
    idx = torch.cat([torch.arange(lo, hi), torch.arange(pad)])
    keep = torch.arange(len(idx)) < hi - lo
    for part in torch.tensor_split(torch.arange(len(idx)), 2):
        i, m = idx[part], keep[part]
        cls.update(preds=logits[i], target=labels[i], mask=m)
        reg.update(preds=x[i], target=y[i], mask=m)
        rows["kl"].update(rows_p[i], rows_q[i], mask=m)
        rows["cos"].update(rows_p[i], rows_q[i], mask=m)
        seg.update(preds=seg_p[i], target=seg_t[i].clamp(max=C - 1), mask=m[:, None, None])  # per-sample mask
        void_iou.update(seg_p[i], seg_t[i], mask=m[:, None, None])


def _results(ms):
    out = {}
    for name, m in zip(("cls", "seg", "void_iou", "reg", "rows"), ms):
        v = m.compute()
        if isinstance(v, dict):
            out.update({f"{name}.{k}": t.tolist() for k, t in v.items()})
        else:
            out[name] = v.tolist()
    return out


def _running_updates(rank):
    # rank 0: 5 updates, rank 1: 2 (fewer than the window)
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(int(torch.randint(1, 4, (1,), generator=g)), generator=g, dtype=torch.float64)
            for _ in range((5, 2)[rank])]


def _worker(rank, world):
    ms = _metrics()
    _feed(ms, CUTS[rank], CUTS[rank + 1], PAD if rank == 1 else 0)
    run = dk.RunningMean(window=WINDOW)
    for v in _running_updates(rank):
        run.update(v)
    local = {**_results(ms), "running": run.compute().item()}
    for m in (*ms, run):
        m.trigger_sync(dk.DistributedContext())
    for m in (*ms, run):
        m.wait_sync()
    out = _results(ms)
    out["running"] = run.compute().item()
    return out, local


def test_synced_equals_single_process_on_concatenated_data():
    out = run_distributed(_worker, 2, timeout=180.0)
    ms = _metrics()
    _feed(ms, 0, N, 0)
    ref = _results(ms)
    last = [v for r in range(2) for v in _running_updates(r)[-WINDOW:]]
    ref["running"] = (sum(v.sum().item() for v in last) / sum(v.numel() for v in last))
    for rank in range(2):
        synced, local = out[rank]
        assert synced.keys() == ref.keys()
        for k in ref:
            np.testing.assert_allclose(synced[k], ref[k], rtol=1e-10, atol=1e-12, err_msg=f"rank {rank} {k}")
        # the shards' own values differ from the global ones: the sync is what makes them equal
        differ = [k for k in ref if not np.allclose(local[k], ref[k], rtol=1e-6)]
        assert len(differ) >= len(ref) - 2, (rank, sorted(set(ref) - set(differ)))
