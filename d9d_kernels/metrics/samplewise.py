"""SamplewiseStatistic: ``multidim_average="samplewise"`` classification.

torchmetrics scores each sample of ``[N, ...]`` inputs on its own (its extra
dims ``d1, ...``, e.g. the pixels of an image) and returns the ``[N_total]``
per-sample values of everything seen. A packed fixed-size state cannot grow
with the number of samples, so the state here is the SUM of the per-sample
values and the sample count (additive, synced with the group's one
all_reduce): ``compute()`` is their mean, the mean of torchmetrics' vector
(docs/metrics.md).

Per-sample counts come from the same kernels as the global statistics (same
tie, NaN and range rules): ``binary_stats`` in one call on ``[S, N * L]``
column views, ``class_stats`` once per sample (a view of the sample's
scores each).
"""

from __future__ import annotations

from typing import Callable, Hashable

import torch

from d9d_kernels import ops
from d9d_kernels.core.statistic import SUM, Slot, optional_int, param, statistic
from d9d_kernels.metrics.binary_stats import sample_columns
from d9d_kernels.metrics.labelled import BAD, LabelledStatistic

__all__ = ["SamplewiseStatistic"]


@statistic
class SamplewiseStatistic(LabelledStatistic):
    """Sum of a per-sample score over samples, and the sample count.

    Args:
        task: "binary", "multiclass" or "multilabel".
        size: C (multiclass), L (multilabel) or None (binary).
        score: ``score(tp, fp, tn, fn) -> [N] or [N, C]`` from per-sample
            counts ``[N, C]`` (the metric's formula and average).
        key: hashable description of ``score`` (metric name, average, ...):
            statistics merge only when it is equal.
        shape: shape of one sample's score (``()`` or ``(C,)``).
        threshold, ignore_index, top_k: as the global statistics.
        inputs: update keyword names (preds, target, mask).

    Slots: ``sum`` [shape], ``count`` [1] (samples), ``bad`` [2] (labelled.BAD); SUM.
    Inputs: class / label dim last (``[N, d1, ..., C]``), as the metrics pass them.
    """

    task: str
    size: int | None = param(convert=optional_int)
    score: Callable = param(None, merge=lambda a, b: a)  # described by ``key``
    key: Hashable = None
    shape: tuple[int, ...] = param((), convert=tuple)
    threshold: float = param(0.5, convert=float)
    ignore_index: int | None = None
    top_k: int = param(1, convert=int)

    def _config(self):
        # ``score`` is a function (its repr holds an address): ``key`` stands for it
        return [(k, v) for k, v in super()._config() if k != "score"]

    def slots(self) -> list[Slot]:
        return [Slot("sum", SUM, self.shape), Slot("count", SUM, (1,)), BAD]

    def update(self, state: dict[str, torch.Tensor], **inputs) -> None:
        preds, target, mask = self.unpack(inputs)
        if mask is not None:
            mask = torch.broadcast_to(mask, target.shape)
        n = target.shape[0]
        if self.task == "multiclass":
            tp, fp, tn, fn = self._class_counts(state, preds, target, mask)
        else:
            tp, fp, tn, fn = self._binary_counts(state, preds, target, mask)
        state["sum"].add_(self.score(tp, fp, tn, fn).sum(0))
        state["count"].add_(float(n))

    def _binary_counts(self, state, preds, target, mask):
        """One ``binary_stats`` call over ``[S, N * L]`` columns -> ``[N, L]`` each."""
        n, L = target.shape[0], self.size or 1
        labels_last = self.size is not None
        counts = torch.zeros(n * L, 4, dtype=torch.float64, device=state["sum"].device)
        cols = [None if x is None else sample_columns(x, labels_last) for x in (preds, target, mask)]
        ops.binary_stats(*cols, state=counts, bad=state["bad"], threshold=self.threshold,
                         ignore_index=self.ignore_index)
        c = counts.view(n, L, 4)
        return c[..., 0], c[..., 1], c[..., 2], c[..., 3]

    def _class_counts(self, state, preds, target, mask):
        """``class_stats`` once per sample (its rows a view) -> ``[N, C]`` each."""
        n, C = target.shape[0], self.size
        dev = state["sum"].device
        stats = torch.zeros(n, 1, 3, C, dtype=torch.float64, device=dev)
        extras = torch.zeros(n, 2, dtype=torch.float64, device=dev)
        scores = preds.dim() > target.dim()
        if not scores and preds.is_floating_point():
            # floating class indices: non-whole values are counted as bad (as the global statistic)
            preds = ops.as_index(preds)
        for i in range(n):
            p = preds[i].reshape(-1, C) if scores else preds[i].reshape(-1)
            ops.class_stats(
                p, target[i].reshape(-1), None if mask is None else mask[i].reshape(-1), num_classes=C,
                stats=stats[i], extras=extras[i], bad=state["bad"], ignore_index=self.ignore_index,
                top_ks=(self.top_k,),
            )
        tp, pred, tgt = stats[:, 0, 0], stats[:, 0, 1], stats[:, 0, 2]
        fp, fn = pred - tp, tgt - tp
        return tp, fp, extras[:, :1] - tp - fp - fn, fn
