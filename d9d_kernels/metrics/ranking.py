"""AUROC and AveragePrecision from fixed-bin score histograms.

The state is ``[2, L, B]`` float64 counts of positives / negatives per score
bin: linearly additive, so it syncs with the group's single SUM all_reduce
and the result after a sync is exactly the single-process result on the
concatenated data. With ``num_bins=10_000`` the values match scikit-learn's
``roc_auc_score`` / ``average_precision_score`` within 1e-3 (scores tied
within a bin count as ties). Formulas and degenerate cases:
``formulas.ranking``.

Logits are recognised per update (any valid pred outside [0, 1]: sigmoid,
softmax over the row for multiclass) on the device, without a host sync.
"""

from __future__ import annotations

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.formulas import ranking as R
from d9d_kernels.metrics.score_histogram import HistogramStatistic
from d9d_kernels.metrics.labelled import INPUTS

__all__ = ["AUROC", "AveragePrecision"]



class _Ranking(Metric):
    _formula = None

    def __init__(
        self,
        task: str,
        num_classes: int | None = None,
        num_labels: int | None = None,
        average: str | None = "macro",
        num_bins: int = 10_000,
        ignore_index: int | None = None,
        nan_strategy: str = "error",
        thresholds: int | None = None,
        class_dim: int | None = None,
    ):
        super().__init__(nan_strategy=nan_strategy)
        name = type(self).__name__
        A.check_class_dim(name, class_dim)
        if thresholds is not None:  # torchmetrics spelling: an int number of thresholds = bins
            A.check(isinstance(thresholds, int) and not isinstance(thresholds, bool), name, "thresholds",
                    f"must be an int (number of bins) here; explicit threshold lists are not supported, got {type(thresholds).__name__}",
                    TypeError)
            num_bins = thresholds
        A.check_choice(name, "task", task, A.TASKS)
        average = "none" if average is None else average
        A.check_choice(name, "average", average, R.AVERAGES)
        A.check_int(name, "num_bins", num_bins, lo=1)
        A.check_ignore_index(name, ignore_index)
        if task == "multiclass":
            A.check(num_classes is not None, name, "num_classes", "is required for task='multiclass'")
            A.check_int(name, "num_classes", num_classes, lo=2)
        if task == "multilabel":
            A.check(num_labels is not None, name, "num_labels", "is required for task='multilabel'")
            A.check_int(name, "num_labels", num_labels)
        self.task = task
        self.num_classes = num_classes if task == "multiclass" else None
        self.num_labels = num_labels if task == "multilabel" else None
        self.average = average
        self.num_bins = int(num_bins)
        self.ignore_index = ignore_index
        self.class_dim = class_dim

    def _statistics(self):
        L = self.num_classes if self.task == "multiclass" else self.num_labels
        return {
            "hist": HistogramStatistic(
                L, self.num_bins, multiclass=self.task == "multiclass", ignore_index=self.ignore_index,
                inputs=INPUTS,
            )
        }

    def update(self, preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Adds a batch: binary ``[N, ...]`` scores; multilabel ``[N, L, ...]``
        (or ``[..., L]``); multiclass ``[N, C, ...]`` (or ``[..., C]``) scores with
        ``[N, ...]`` class-index targets. ``mask`` broadcasts to ``target``."""
        name = type(self).__name__
        A.check_preds_target(name, preds, target)
        ps, ts = tuple(preds.shape), tuple(target.shape)
        if self.task == "multiclass":
            A.check_index_dtype(name, "target", target)
            if not (preds.is_floating_point()):
                A.fail(name, "preds", f"must be floating scores for task='multiclass', got {preds.dtype}", TypeError)
            if not (len(ps) == len(ts) + 1):
                A.fail(name, "preds", f"scores must have one dim more than target (the classes), got {ps} and {ts}")
            preds = A.channel_last(preds, A.score_class_dim(name, ps, ts, self.num_classes, self.class_dim))
        else:
            if not (ps == ts):
                A.fail(name, "preds", f"must have target's shape {ts}, got {ps}")
            A.check_mask(name, mask, ts)
            if self.task == "multilabel":
                dim = A.label_dim(name, ps, self.num_labels, self.class_dim)
                if dim == 1 and len(ps) > 2:
                    if mask is not None:
                        mask = A.channel_last(torch.broadcast_to(mask, target.shape), 1)
                    preds, target = A.channel_last(preds, 1), A.channel_last(target, 1)
        if self.task == "multiclass":
            A.check_mask(name, mask, ts)
        self._feed({"hist": dict(preds=preds, target=target, mask=mask)})

    def _raise_on_bad(self) -> bool:
        return True

    def _bad_message(self, count) -> str:
        return A.bad_message(self._label, count, self.nan_strategy)

    def _compute(self, states):
        s = states["hist"]
        average = "macro" if self.task == "binary" else self.average
        value = type(self)._formula(s["hist"], average)
        if self.task == "binary":
            value = value.reshape(())
        if self.nan_strategy == "propagate":
            value = torch.where(s["bad"][1] > 0, torch.full_like(value, float("nan")), value)
        return value


class AUROC(_Ranking):
    """Area under the ROC curve from ``num_bins`` score bins (torchmetrics
    ``AUROC(thresholds=num_bins)`` / sklearn ``roc_auc_score``; multiclass is
    one-vs-rest, ``multi_class="ovr"``).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.AUROC(task="binary")
        >>> m.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        >>> m.compute().item()
        0.75
    """

    _formula = staticmethod(R.auroc)


class AveragePrecision(_Ranking):
    """Step-wise average precision from ``num_bins`` score bins (torchmetrics
    ``AveragePrecision`` / sklearn ``average_precision_score``)."""

    _formula = staticmethod(R.average_precision)
