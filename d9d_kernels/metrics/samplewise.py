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
from d9d_kernels.core.statistic import SUM, Slot, Statistic
from d9d_kernels.metrics.binary_stats import sample_columns
from d9d_kernels.metrics.class_stats import nonfinite_rows
from d9d_kernels.ops._common import as_index

__all__ = ["SamplewiseStatistic"]


class SamplewiseStatistic(Statistic):
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
        count_nonfinite: also count NaN/Inf preds in a ``nonfinite`` slot.
        inputs: update keyword names (preds, target, mask).

    Slots: ``sum`` [shape], ``count`` [1] (samples), ``bad`` [1] (+ ``nonfinite`` [1]); SUM.
    Inputs: class / label dim last (``[N, d1, ..., C]``), as the metrics pass them.
    """

    def __init__(
        self,
        task: str,
        size: int | None,
        score: Callable,
        key: Hashable,
        shape: tuple[int, ...] = (),
        threshold: float = 0.5,
        ignore_index: int | None = None,
        top_k: int = 1,
        count_nonfinite: bool = False,
        inputs: tuple[str, ...] = ("preds", "target", "mask"),
    ):
        self.task = task
        self.size = None if size is None else int(size)
        self.score = score
        self.key = key
        self.shape = tuple(shape)
        self.threshold = float(threshold)
        self.ignore_index = ignore_index
        self.top_k = int(top_k)
        self.count_nonfinite = bool(count_nonfinite)
        self.inputs = tuple(inputs)

    def __repr__(self) -> str:
        return (f"SamplewiseStatistic(task={self.task!r}, size={self.size}, key={self.key!r}, "
                f"ignore_index={self.ignore_index}, top_k={self.top_k})")

    def merge_key(self) -> Hashable:
        return ("samplewise", self.task, self.size, self.key, self.shape, self.threshold, self.ignore_index,
                self.top_k, self.inputs)

    def merge(self, other: "SamplewiseStatistic") -> "SamplewiseStatistic":
        assert self.merge_key() == other.merge_key()
        return SamplewiseStatistic(
            self.task, self.size, self.score, self.key, self.shape, self.threshold, self.ignore_index, self.top_k,
            self.count_nonfinite or other.count_nonfinite, self.inputs,
        )

    def slots(self) -> list[Slot]:
        out = [Slot("sum", SUM, self.shape), Slot("count", SUM, (1,)), Slot("bad", SUM, (1,))]
        if self.count_nonfinite:
            out.append(Slot("nonfinite", SUM, (1,)))
        return out

    def update(self, state: dict[str, torch.Tensor], **inputs) -> None:
        preds, target = inputs[self.inputs[0]], inputs[self.inputs[1]]
        mask = inputs.get(self.inputs[2]) if len(self.inputs) > 2 else None
        if mask is not None:
            mask = torch.broadcast_to(mask, target.shape)
        n = target.shape[0]
        if self.task == "multiclass":
            tp, fp, tn, fn = self._class_counts(state, preds, target, mask)
        else:
            tp, fp, tn, fn = self._binary_counts(state, preds, target, mask)
        state["sum"].add_(self.score(tp, fp, tn, fn).sum(0))
        state["count"].add_(float(n))
        if self.count_nonfinite and preds.is_floating_point():
            rows = target.dim() if self.task == "multiclass" else preds.dim()
            state["nonfinite"].add_(nonfinite_rows(preds, target, mask, self.ignore_index, rows,
                                                   class_rows=self.task == "multiclass"))

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
            preds = as_index("class_stats", "preds", preds, preds.device)
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
