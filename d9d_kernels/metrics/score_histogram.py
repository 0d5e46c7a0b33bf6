"""HistogramStatistic: binned positive / negative score counts over ``ops.score_histogram``.

AUROC and AveragePrecision on the same inputs, ``num_bins``, task and
``ignore_index`` share one histogram (linearly additive: synced by a SUM).
"""

from __future__ import annotations

from typing import Hashable

import torch

from d9d_kernels import ops
from d9d_kernels.metrics.binary_stats import flatten_labels
from d9d_kernels.metrics.class_stats import nonfinite_rows
from d9d_kernels.core.statistic import SUM, Slot, Statistic

__all__ = ["HistogramStatistic"]


class HistogramStatistic(Statistic):
    """``hist`` [2, L, B] (positives, negatives per label and bin) + ``bad`` [1].

    Args:
        num_labels: L (labels, or classes when ``multiclass``); ``None`` for binary.
        num_bins: B; the bin of probability p is ``clamp(floor(p B), 0, B - 1)``.
        multiclass: targets are class indices (one-vs-rest; softmax for logits).
        ignore_index: target value whose entries (rows when multiclass) are dropped.
        count_nonfinite: also count NaN/Inf preds in a ``nonfinite`` slot.
        inputs: update keyword names.
    """

    def __init__(
        self,
        num_labels: int | None,
        num_bins: int,
        multiclass: bool = False,
        ignore_index: int | None = None,
        count_nonfinite: bool = False,
        inputs: tuple[str, ...] = ("preds", "target", "mask"),
    ):
        self.num_labels = None if num_labels is None else int(num_labels)
        self.num_bins = int(num_bins)
        self.multiclass = bool(multiclass)
        self.ignore_index = ignore_index
        self.count_nonfinite = bool(count_nonfinite)
        self.inputs = tuple(inputs)

    def __repr__(self) -> str:
        return (
            f"HistogramStatistic(num_labels={self.num_labels}, num_bins={self.num_bins}, "
            f"multiclass={self.multiclass}, ignore_index={self.ignore_index})"
        )

    def merge_key(self) -> Hashable:
        return ("score_histogram", self.num_labels, self.num_bins, self.multiclass, self.ignore_index, self.inputs)

    def merge(self, other: "HistogramStatistic") -> "HistogramStatistic":
        assert self.merge_key() == other.merge_key()
        return HistogramStatistic(
            self.num_labels, self.num_bins, self.multiclass, self.ignore_index,
            self.count_nonfinite or other.count_nonfinite, self.inputs,
        )

    def slots(self) -> list[Slot]:
        out = [Slot("hist", SUM, (2, self.num_labels or 1, self.num_bins)), Slot("bad", SUM, (1,))]
        if self.count_nonfinite:
            out.append(Slot("nonfinite", SUM, (1,)))
        return out

    def update(self, state: dict[str, torch.Tensor], **inputs) -> None:
        preds, target = inputs[self.inputs[0]], inputs[self.inputs[1]]
        mask = inputs.get(self.inputs[2]) if len(self.inputs) > 2 else None
        if self.multiclass:
            C = self.num_labels
            if mask is not None:
                mask = torch.broadcast_to(mask, target.shape).reshape(-1)
            preds, target = preds.reshape(-1, C), target.reshape(-1)
        else:
            preds, target, mask = flatten_labels(self.num_labels, preds, target, mask)
        ops.score_histogram(
            preds, target, mask,
            hist=state["hist"], bad=state["bad"],
            multiclass=self.multiclass, ignore_index=self.ignore_index,
        )
        if self.count_nonfinite and preds.is_floating_point():
            state["nonfinite"].add_(nonfinite_rows(preds, target, mask, self.ignore_index, target.dim()))

    def view(self, state: dict[str, torch.Tensor], need: "HistogramStatistic") -> dict[str, torch.Tensor]:
        out = {"hist": state["hist"], "bad": state["bad"]}
        if need.count_nonfinite:
            out["nonfinite"] = state["nonfinite"]
        return out
