"""CalibrationError (top-label ECE / MCE / RMS), torchmetrics 1.9 semantics.

State: ``bins`` SUM ``[3, n_bins + 1]`` = per-bin (count, confidence sum,
accuracy sum), ``bad`` SUM ``[1]``. Binning is torchmetrics' own:
``bucketize(confidence, linspace(0, 1, n_bins + 1), right=True) - 1`` with the
boundaries in the confidence's dtype (float32 for multiclass, as torchmetrics
casts there), so a confidence of exactly 1.0 lands in the extra last bin as it
does there. The histograms add up across updates and ranks, so the result
equals torchmetrics' (which keeps every confidence) on the concatenated data.

The score histogram kernel (``score_histogram``) counts positives/negatives
per bin but not the confidence sum each bin needs, hence one ``index_add_``
of the three per-row values per update. Members of a group with the same
configuration (e.g. l1, l2 and max) bin the same inputs once.
"""

from __future__ import annotations

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics._memo import LastInputs
from d9d_kernels.reference import add_bad

__all__ = ["CalibrationError"]

NORMS = ("l1", "l2", "max")

#: ECE / RMS / MCE members of a group on the same inputs bin them once (d9d_kernels/metrics/_memo.py)
_memo = LastInputs()


def calibration_error(bins: torch.Tensor, norm: str) -> torch.Tensor:
    """torchmetrics ``_ce_compute`` from binned (count, confidence sum, accuracy sum)."""
    count, conf_sum, acc_sum = bins[0], bins[1], bins[2]
    conf = torch.nan_to_num(conf_sum / count)
    acc = torch.nan_to_num(acc_sum / count)
    prop = count / count.sum()
    gap = acc - conf
    if norm == "l1":
        return torch.sum(gap.abs() * prop)
    if norm == "max":
        return torch.max(gap.abs())
    ce = torch.sum(gap * gap * prop)
    return torch.where(ce > 0, torch.sqrt(ce.clamp(min=0)), torch.zeros_like(ce))


class CalibrationError(Metric):
    """Top-label calibration error (torchmetrics ``CalibrationError``).

    Args:
        task: ``"binary"`` (probabilities or logits ``[N, ...]``, 0/1 targets)
            or ``"multiclass"`` (scores ``[N, C, ...]`` channel-first or
            ``[N, C]``, class-index targets ``[N, ...]``). torchmetrics has no
            multilabel calibration error; neither has this library.
        n_bins: number of equal-width confidence bins on [0, 1].
        norm: ``"l1"`` (ECE), ``"l2"`` (RMS calibration error), ``"max"`` (MCE).
        num_classes: C, required for ``task="multiclass"``.
        ignore_index: target value whose rows are left out.
        nan_strategy: ``"propagate"`` (default: NaN scores are read exactly as
            torchmetrics reads them: the batch counts as logits and the row
            lands in the last bin with confidence 0, not NaN),
            ``"ignore"`` (rows with a NaN/Inf score are left out and
            counted: ``bad_input_counts()``) or ``"error"`` (``compute()``
            raises with the count).

    Logits are recognised per update as torchmetrics does: a kept score
    outside [0, 1] makes the batch logits (sigmoid / softmax over classes).
    Targets out of range are counted on the device, left out, and make
    ``compute()`` raise ``ValueError`` with the count.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.CalibrationError(task="multiclass", num_classes=3, n_bins=3, norm="l1")
        >>> m.update(torch.tensor([[0.25, 0.20, 0.55], [0.55, 0.05, 0.40],
        ...                        [0.10, 0.30, 0.60], [0.90, 0.05, 0.05]]), torch.tensor([0, 1, 2, 0]))
        >>> round(m.compute().item(), 4)
        0.2
    """

    def __init__(
        self,
        task: str,
        n_bins: int = 15,
        norm: str = "l1",
        num_classes: int | None = None,
        ignore_index: int | None = None,
        nan_strategy: str = "propagate",
    ):
        super().__init__(nan_strategy=nan_strategy)
        name = "CalibrationError"
        if task == "multilabel":
            A.fail(name, "task", "'multilabel' is not supported (torchmetrics has no multilabel calibration "
                   "error): use task='binary' on the flattened labels")
        A.check_choice(name, "task", task, ("binary", "multiclass"))
        A.check_int(name, "n_bins", n_bins)
        A.check_choice(name, "norm", norm, NORMS)
        A.check_ignore_index(name, ignore_index)
        if task == "multiclass":
            A.check(num_classes is not None, name, "num_classes", "is required for task='multiclass'")
            A.check_int(name, "num_classes", num_classes, lo=2)
        self.task, self.n_bins, self.norm = task, int(n_bins), norm
        self.num_classes = num_classes if task == "multiclass" else None
        self.ignore_index = ignore_index
        self.add_state("bins", shape=(3, self.n_bins + 1))
        self.add_state("bad", shape=(2,))  # by cause, as labelled.BAD

    def __repr__(self) -> str:
        nc = f", num_classes={self.num_classes}" if self.num_classes else ""
        return f"CalibrationError(task={self.task!r}, n_bins={self.n_bins}, norm={self.norm!r}{nc})"

    def update(self, preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Adds a batch (device-local, no host sync)."""
        name = self._label
        A.check_preds_target(name, preds, target)
        A.check(preds.is_floating_point(), name, "preds", f"must be floating probabilities/logits, got {preds.dtype}",
                TypeError)
        A.check(not target.is_floating_point(), name, "target", f"must hold integer labels, got {target.dtype}",
                TypeError)
        ps, ts = tuple(preds.shape), tuple(target.shape)
        if self.task == "binary":
            A.check(ps == ts, name, "target", f"must have preds' shape {ps}, got {ts}")
        else:
            C = self.num_classes
            ok = len(ps) == len(ts) + 1 and len(ps) >= 2 and ps[0] == ts[0] and ps[2:] == ts[1:] and ps[1] == C
            A.check(ok, name, "preds", f"must be [N, C={C}, ...] scores for target [N, ...], got preds {ps}, target {ts}")
        A.check_mask(name, mask, ts)
        key = (self.task, self.n_bins, self.num_classes, self.ignore_index, self.nan_strategy)
        binned = _memo.get((preds, target, mask), key)
        if binned is None:
            binned = self._binned(preds, target, mask)
            _memo.put((preds, target, mask), key, binned)
        super().update(binned=binned)

    def _update(self, binned):
        bad, idx, rows = binned
        self.bad += bad
        self.bins.index_add_(1, idx, rows)

    def _binned(self, preds, target, mask):
        """(bad counts [2] by cause, bin index [M], (weight, weight·confidence, weight·accuracy) [3, M])."""
        t = target.reshape(-1).long()
        keep = torch.ones_like(t, dtype=torch.bool) if mask is None else torch.broadcast_to(mask, target.shape).reshape(-1)
        if self.ignore_index is not None:
            keep = keep & (t != self.ignore_index)
        if self.task == "binary":
            p = preds.reshape(-1)
            in_range = (t == 0) | (t == 1)
        else:
            C = self.num_classes
            p = preds.movedim(1, -1).reshape(-1, C)
            in_range = (t >= 0) & (t < C)
        if self.nan_strategy != "propagate":  # an extra read of the scores: only when asked for
            finite = torch.isfinite(p) if self.task == "binary" else torch.isfinite(p).all(-1)
        else:  # NaN scores are read as torchmetrics reads them: none is left out or counted
            finite = torch.ones_like(keep)
        bad = torch.zeros(2, dtype=torch.float64, device=preds.device)
        # left out before the logits decision: the batch reads as torchmetrics reads its finite rows
        keep = add_bad(bad, keep, in_range, finite)
        if self.task == "binary":
            probs = (p >= 0) & (p <= 1)
            p = torch.where((keep & ~probs).any(), torch.sigmoid(p), p)
            conf, acc = p, t.to(p.dtype)
        else:
            probs = ((p >= 0) & (p <= 1)).all(-1)
            p = torch.where((keep & ~probs).any(), torch.softmax(p, dim=1), p)
            conf, pred = p.max(dim=1)
            conf, acc = conf.float(), pred.eq(t).float()
        conf = torch.where(keep, conf, torch.zeros_like(conf))
        edges = torch.linspace(0, 1, self.n_bins + 1, dtype=conf.dtype, device=conf.device)
        idx = (torch.bucketize(conf, edges, right=True) - 1).clamp(0, self.n_bins)
        w = keep.to(torch.float64)
        rows = torch.stack([w, w * conf.to(torch.float64), w * acc.to(torch.float64)])
        return bad, idx, rows

    def _raise_on_bad(self) -> bool:
        return True

    def _bad_message(self, count: int) -> str:
        what = "target out of range" + (" or a NaN/Inf score" if self.nan_strategy == "error" else "")
        return (f"{self._label}: {count} invalid row(s) ({what}) were counted and left out since the last reset; "
                "fix the labels, pass ignore_index=, or call reset()")

    def _compute(self, state):
        return calibration_error(state["bins"], self.norm)
