"""More classification metrics of torchmetrics 1.9 on the shared class /
binary statistics: ``StatScores``, ``HammingDistance``,
``NegativePredictiveValue`` (formulas of the per-class ``tp, fp, tn, fn``
that every classification metric keeps: in a group they share its one
kernel call), and ``ExactMatch`` (its own small statistic: exact samples and
samples, two floats).

Arguments, input formats, ``nan_strategy``, ``mask`` and
``multidim_average`` as the classification metrics in ``classification.py``
(docs/metrics.md). Multiclass ``top_k > 1``: StatScores, HammingDistance and
NegativePredictiveValue count as torchmetrics does, one prediction per row
(the target if it is in the row's top-k, else the top-1 class: the
``RefinedTopKStatistic`` of ``Specificity``).
"""

from __future__ import annotations

import torch

from d9d_kernels.core.statistic import SUM, Slot, optional_int, param, statistic
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.classification import _Classification
from d9d_kernels.metrics.formulas import classification as F
from d9d_kernels.metrics.labelled import BAD, INPUTS, LabelledStatistic
from d9d_kernels.metrics.samplewise import SamplewiseStatistic
from d9d_kernels.reference import INPUT_AUTO, _to_probs, add_bad, valid_score_rows

__all__ = ["StatScores", "HammingDistance", "NegativePredictiveValue", "ExactMatch", "ExactMatchStatistic"]


def _check_average(average: str) -> None:
    if average not in F.AVERAGES:
        raise ValueError(f"average must be one of {F.AVERAGES}, got {average!r}")


STAT_SCORES_AVERAGES = ("micro", "macro", "weighted", "none")


class StatScores(_Classification):
    """``[tp, fp, tn, fn, support]`` (torchmetrics ``StatScores``; support =
    ``tp + fn``): binary ``[5]``; multiclass / multilabel reduced over the
    classes by ``average`` — ``"micro"`` (default) sums, ``"macro"`` the mean
    over classes, ``"weighted"`` weighted by support, ``"none"`` ``[C, 5]``.
    float64 counts (torchmetrics: int64). ``multidim_average="samplewise"``:
    the mean over samples of torchmetrics' per-sample rows.
    ``"weighted"`` with no support at all: zeros (torchmetrics: NaN).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.StatScores(task="multiclass", num_classes=3, average="none")
        >>> m.update(torch.tensor([2, 1, 0, 1]), torch.tensor([2, 1, 0, 0]))
        >>> m.compute().long().tolist()
        [[1, 0, 2, 1, 2], [1, 1, 2, 0, 1], [1, 0, 3, 0, 1]]
    """

    _one_prediction_per_row = True

    def _statistic(self):
        if self.multidim_average == "samplewise":
            size = self.num_classes if self.task == "multiclass" else self.num_labels
            shape = (size, 5) if self.task != "binary" and self.average == "none" else (5,)
            return SamplewiseStatistic(
                self.task, size, self._sample_scores, ("StatScores", self.average), shape,
                threshold=self.threshold, ignore_index=self.ignore_index, top_k=self.top_k, inputs=INPUTS,
            )
        return super()._statistic()

    def _formula(self, tp, fp, tn, fn, average, multilabel, top_k):
        res = torch.stack([tp, fp, tn, fn, tp + fn], dim=-1)
        if average == "micro":
            return res.sum(-2)
        if average == "macro":
            return res.mean(-2)
        if average == "weighted":
            w = tp + fn
            return (res * F.safe_div(w, w.sum(-1, keepdim=True)).unsqueeze(-1)).sum(-2)
        return res


class HammingDistance(_Classification):
    """Hamming distance (loss): the fraction of wrong labels, ``1 - accuracy``
    per class / label before averaging (torchmetrics ``HammingDistance``;
    sklearn ``hamming_loss`` for binary / multilabel micro).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.HammingDistance(task="multilabel", num_labels=3)
        >>> m.update(torch.tensor([[0, 0, 1], [1, 0, 1]]), torch.tensor([[0, 1, 0], [1, 0, 1]]))
        >>> round(m.compute().item(), 4)
        0.3333
    """

    _one_prediction_per_row = True

    def _formula(self, tp, fp, tn, fn, average, multilabel, top_k):
        _check_average(average)
        if average == "micro":
            if multilabel:
                return 1.0 - F.safe_div((tp + tn).sum(-1), (tp + tn + fp + fn).sum(-1))
            return 1.0 - F.safe_div(tp.sum(-1), (tp + fn).sum(-1))
        score = 1.0 - (F.safe_div(tp + tn, tp + tn + fp + fn) if multilabel else F.safe_div(tp, tp + fn))
        # torchmetrics averages without top_k (its top_k=1 rule for absent classes)
        return F._average(score, tp, fp, fn, average, multilabel, 1)


class NegativePredictiveValue(_Classification):
    """Negative predictive value ``tn / (tn + fn)`` (torchmetrics
    ``NegativePredictiveValue``), averaged as precision is.

    ``zero_division`` (0, 1 or NaN): the score of a class with ``tn + fn == 0``
    (nothing predicted negative), as torchmetrics.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.NegativePredictiveValue(task="binary")
        >>> m.update(torch.tensor([0, 1, 0, 0, 1, 0]), torch.tensor([0, 1, 0, 1, 0, 1]))
        >>> round(m.compute().item(), 4)
        0.5
    """

    _one_prediction_per_row = True
    _uses_zero_division = True

    def _formula(self, tp, fp, tn, fn, average, multilabel, top_k):
        _check_average(average)
        zd = self.zero_division
        if average == "micro":
            return F.safe_div(tn.sum(-1), (tn + fn).sum(-1), zd)
        return F._average(F.safe_div(tn, tn + fn, zd), tp, fp, fn, average, multilabel, top_k)


# -- ExactMatch ------------------------------------------------------------------


@statistic
class ExactMatchStatistic(LabelledStatistic):
    """Samples whose every kept element is right, and samples:
    ``counts`` SUM [2], ``bad`` [2] (labelled.BAD, counted per sample).

    A *sample* is a row ``n`` of multiclass ``[N, d1, ...]`` (all its
    positions) or one ``(n, d1, ...)`` position of multilabel ``[N, ..., L]``
    (all its labels), as torchmetrics' ``ExactMatch``. An element whose
    target is ``ignore_index`` counts as right (torchmetrics); ``mask``
    drops elements, and a sample without a kept element is no sample. A
    sample with a bad target (or class index) is counted in ``bad[0]``, one
    with a NaN/Inf prediction (and good targets) in ``bad[1]``; both are left out.

    Args:
        task: "multiclass" or "multilabel".
        size: C or L.
        threshold: multilabel: positive iff probability > threshold (logits,
            recognised per update, after a sigmoid).
        ignore_index: target value that counts as right.
    Inputs: class / label dim last (``[N, d1, ..., C]`` scores), as the metrics pass them.
    """

    task: str
    size: int | None = param(convert=optional_int)
    threshold: float = param(0.5, convert=float)
    ignore_index: int | None = None

    def slots(self) -> list[Slot]:
        return [Slot("counts", SUM, (2,)), BAD]

    def update(self, state: dict[str, torch.Tensor], **inputs) -> None:
        preds, target, mask = self.unpack(inputs)
        kept = torch.ones(target.shape, dtype=torch.bool, device=target.device) if mask is None else \
            torch.broadcast_to(mask, target.shape)
        ign = target == self.ignore_index if self.ignore_index is not None else torch.zeros_like(kept)
        C = self.size
        if self.task == "multiclass":
            t_ok = ign | ((target >= 0) & (target < C))
            if preds.dim() > target.dim():  # scores [..., C]: argmax, NaN/+inf/all -inf rows are bad
                p_ok = valid_score_rows(preds.reshape(-1, C)).reshape(target.shape)
                pred = preds.argmax(-1)
            else:
                pred = preds
                t_ok = t_ok & (ign | ((pred >= 0) & (pred < C)))  # an index pred out of range: a label mistake
                p_ok = torch.ones_like(kept) if not preds.is_floating_point() else torch.isfinite(preds)
            right = ign | (pred == target)
            dims = tuple(range(1, target.dim()))
        else:
            t = target.to(torch.float64)
            t_ok = ign | (t == 0) | (t == 1)
            if preds.is_floating_point():
                p = preds.to(torch.float64)
                p_ok = torch.isfinite(p)
                prob = _to_probs(p, kept & p_ok & t_ok & ~ign, INPUT_AUTO, None)
                pos = prob > self.threshold
            else:
                p_ok = torch.ones_like(kept)
                pos = preds != 0
            right = ign | (pos == (t == 1))
            dims = (-1,)
        if not dims:  # 1-D multiclass: every element is a sample
            dims = None
        red = (lambda x: x) if dims is None else (lambda x: x.any(dim=dims))  # noqa: E731
        allr = (lambda x: x) if dims is None else (lambda x: x.all(dim=dims))  # noqa: E731
        judged = kept & ~ign  # an ignored element is right whatever its prediction holds
        ok = add_bad(state["bad"], red(kept), ~red(judged & ~t_ok), ~red(judged & ~p_ok))
        exact = allr(right | ~kept) & ok
        state["counts"].add_(torch.stack([exact.sum(dtype=torch.float64), ok.sum(dtype=torch.float64)]))


class ExactMatch(_Classification):
    """Exact match ratio (torchmetrics ``ExactMatch``): the fraction of
    samples whose every position (multiclass ``[N, d1, ...]``) or every label
    (multilabel ``[N, L, d1, ...]``: each position of a sample is a sample, as
    there) is predicted right; sklearn ``accuracy_score`` (subset accuracy)
    for multilabel ``[N, L]``. Tasks "multiclass" and "multilabel".

    ``multidim_average="samplewise"`` (torchmetrics: a vector of per-sample
    0/1 divided by the number of updates) is refused.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.ExactMatch(task="multiclass", num_classes=3)
        >>> m.update(torch.tensor([[0, 0, 2], [2, 2, 1]]), torch.tensor([[0, 0, 2], [2, 1, 1]]))
        >>> m.compute().item()
        0.5
    """

    _allowed_tasks = ("multiclass", "multilabel")
    _uses_average = False

    def __init__(self, task: str, num_classes: int | None = None, num_labels: int | None = None,
                 threshold: float = 0.5, multidim_average: str = "global", ignore_index: int | None = None,
                 nan_strategy: str = "error", class_dim: int | None = None):
        A.check_choice("ExactMatch", "multidim_average", multidim_average, A.MULTIDIM_AVERAGES)
        A.check(multidim_average == "global", "ExactMatch", "multidim_average",
                "='samplewise' is not supported: torchmetrics returns each sample's 0/1 divided by the number of "
                "updates, a state that grows with the samples; use 'global'")
        super().__init__(task, num_classes, num_labels, threshold, 1, "micro", ignore_index, nan_strategy,
                         "global", class_dim)

    def _statistic(self):
        size = self.num_classes if self.task == "multiclass" else self.num_labels
        return ExactMatchStatistic(self.task, size, self.threshold, self.ignore_index, inputs=INPUTS)

    def _check_vocab(self, preds, target, mask):
        A.fail("ExactMatch", "vocab", "is not supported (a sample's positions are not per shard)")

    def _value(self, s):
        c = s["counts"]
        return F.safe_div(c[0], c[1])
