"""BinaryStatistic: per-label tp / fp / tn / fn over ``ops.binary_stats``.

Serves every binary and multilabel classification metric; members with the
same ``num_labels``, ``threshold``, ``ignore_index`` and inputs share one
state slice and one kernel call in a group.
"""

from __future__ import annotations

import torch

from d9d_kernels import ops
from d9d_kernels.core.statistic import SUM, Slot, optional_int, param, statistic
from d9d_kernels.metrics.class_stats import mergeable
from d9d_kernels.metrics.labelled import BAD, LabelledStatistic

__all__ = ["BinaryStatistic", "flatten_labels", "sample_columns"]


def sample_columns(t: torch.Tensor, labels_last: bool) -> torch.Tensor:
    """``[N, d1, ..., L]`` (``labels_last``) or ``[N, d1, ...]`` as ``[S, N * L]``
    (``L = 1``): column ``n * L + l`` holds sample n's label l. A view of
    channel-first ``[N, L, d1, ...]`` input (the form ``binary_stats`` reads
    in place through its strides), a copy otherwise."""
    x = t.movedim(-1, 1) if labels_last else t.unsqueeze(1)
    return x.reshape(x.shape[0] * x.shape[1], -1).t()


def _label_columns(state: dict, L: int, preds, target, mask, run) -> None:
    """Multilabel ``[N, d1, ..., L]`` that does not flatten to ``[R, L]`` as a
    view (channel-first input with its label dim moved last): one
    ``binary_stats`` call on ``[S, N * L]`` columns (views) into per-(sample,
    label) counts, then summed over samples into ``state``."""
    n = preds.shape[0]
    if mask is not None:
        mask = torch.broadcast_to(mask, target.shape)
    counts = torch.zeros(n * L, 4, dtype=torch.float64, device=state["state"].device)
    cols = [None if x is None else sample_columns(x, True) for x in (preds, target, mask)]
    run(*cols, counts)
    state["state"].add_(counts.view(n, L, 4).sum(0))


def flatten_labels(num_labels: int | None, preds, target, mask):
    """Binary (``num_labels=None``): everything flattened to ``[N]``;
    multilabel: ``[..., L]`` flattened to ``[N, L]``. The mask is broadcast first."""
    if mask is not None:
        mask = torch.broadcast_to(mask, target.shape)
    if num_labels is None:
        return preds.reshape(-1), target.reshape(-1), None if mask is None else mask.reshape(-1)
    L = num_labels
    return preds.reshape(-1, L), target.reshape(-1, L), None if mask is None else mask.reshape(-1, L)


@statistic
class BinaryStatistic(LabelledStatistic):
    """Per-label confusion counts of one ``binary_stats`` call.

    Args:
        num_labels: L for multilabel, ``None`` for binary (one label; any
            input shape, flattened).
        threshold: positive iff probability > threshold (logits: after sigmoid).
        ignore_index: target value whose entries are dropped, or None.
        inputs: update keyword names.

    Slots: ``state`` [L, 4] (tp, fp, tn, fn), ``bad`` [2] (labelled.BAD); SUM.
    """

    num_labels: int | None = param(convert=optional_int)
    threshold: float = param(0.5, convert=float)
    ignore_index: int | None = None

    def slots(self) -> list[Slot]:
        return [Slot("state", SUM, (self.num_labels or 1, 4)), BAD]

    def update(self, state: dict[str, torch.Tensor], **inputs) -> None:
        preds, target, mask = self.unpack(inputs)

        def run(p, t, m, counts):
            ops.binary_stats(p, t, m, state=counts, bad=state["bad"], threshold=self.threshold,
                             ignore_index=self.ignore_index)

        if self.num_labels is not None and preds.dim() > 2 and not mergeable(preds.shape[:-1], preds.stride()[:-1]):
            _label_columns(state, self.num_labels, preds, target, mask, run)
        else:
            preds, target, mask = flatten_labels(self.num_labels, preds, target, mask)
            run(preds, target, mask, state["state"])
