"""HistogramStatistic: binned positive / negative score counts over ``ops.score_histogram``.

AUROC and AveragePrecision on the same inputs, ``num_bins``, task and
``ignore_index`` share one histogram (linearly additive: synced by a SUM).
"""

from __future__ import annotations

import torch

from d9d_kernels import ops
from d9d_kernels.core.statistic import SUM, Slot, optional_int, param, statistic
from d9d_kernels.metrics.binary_stats import flatten_labels
from d9d_kernels.metrics.labelled import BAD, LabelledStatistic

__all__ = ["HistogramStatistic"]


@statistic
class HistogramStatistic(LabelledStatistic):
    """``hist`` [2, L, B] (positives, negatives per label and bin) + ``bad`` [2]
    (labelled.BAD); SUM.

    Args:
        num_labels: L (labels, or classes when ``multiclass``); ``None`` for binary.
        num_bins: B; the bin of probability p is ``clamp(floor(p B), 0, B - 1)``.
        multiclass: targets are class indices (one-vs-rest; softmax for logits).
        ignore_index: target value whose entries (rows when multiclass) are dropped.
        inputs: update keyword names.
    """

    num_labels: int | None = param(convert=optional_int)
    num_bins: int = param(convert=int)
    multiclass: bool = param(False, convert=bool)
    ignore_index: int | None = None

    def slots(self) -> list[Slot]:
        hist = Slot("hist", SUM, (2, self.num_labels or 1, self.num_bins))
        return [hist, BAD]

    def update(self, state: dict[str, torch.Tensor], **inputs) -> None:
        preds, target, mask = self.unpack(inputs)
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
