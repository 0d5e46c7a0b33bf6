"""Classification metrics over the shared class / binary statistics.

Every metric here is a thin wiring of a sufficient statistic
(``ClassStatistic`` for task="multiclass", ``BinaryStatistic`` for "binary"
and "multilabel") to a pure formula in ``formulas.classification``. In a
``MetricGroup``, members on the same inputs merge their statistics: Accuracy
+ top-5 Accuracy + macro F1 + Precision + Recall + ConfusionMatrix run ONE
``class_stats`` kernel per ``g.update(...)``.

Constructor arguments follow torchmetrics 1.9 (``task``, ``num_classes``,
``num_labels``, ``threshold``, ``top_k``, ``average``, ``ignore_index``,
``multidim_average`` where torchmetrics has it), defaults included
(``average="micro"``, JaccardIndex ``"macro"``). Inputs are read as
torchmetrics reads them: scores ``[N, C, d1, ...]`` with targets
``[N, d1, ...]``, multilabel ``[N, L, d1, ...]``; channel-last
``[..., C]`` when channel-first does not fit the shapes, or always with
``class_dim=-1`` (docs/metrics.md). ``multidim_average="samplewise"``:
``compute()`` is the mean of torchmetrics' per-sample values
(``SamplewiseStatistic``). Plus ``nan_strategy``:

* ``"error"`` (default): ``compute()`` raises ``ValueError`` with the count of
  bad rows (class index out of range, NaN/Inf scores); bad rows are left out.
  Multiclass score rows: ``-inf`` is a masked logit (ranked last), not bad;
  a row with NaN, ``+inf`` or only ``-inf`` is.
* ``"ignore"``: rows with NaN/Inf scores are left out silently; out-of-range
  indices still raise.
* ``"propagate"``: the result is NaN when a NaN/Inf score was seen;
  out-of-range indices still raise.
"""

from __future__ import annotations

import math

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.binary_stats import BinaryStatistic
from d9d_kernels.metrics.class_stats import ClassStatistic, RefinedTopKStatistic
from d9d_kernels.metrics.samplewise import SamplewiseStatistic
from d9d_kernels.metrics.vocab_parallel import resolve
from d9d_kernels.metrics.formulas import classification as F
from d9d_kernels.metrics.labelled import INPUTS
from d9d_kernels.metrics.linear_logits import TAKEN_BY, LinearLogits, check_linear, unsupported

__all__ = [
    "Accuracy",
    "Precision",
    "Recall",
    "F1Score",
    "FBetaScore",
    "Specificity",
    "JaccardIndex",
    "MatthewsCorrCoef",
    "CohenKappa",
    "ConfusionMatrix",
]


#: why a multiclass metric needs ``num_classes`` (torchmetrics' task wrappers require it too)
NUM_CLASSES_REQUIRED = (
    "is required for task='multiclass', also for average='micro' (torchmetrics' task wrapper requires it as well; "
    "only its MulticlassAccuracy(num_classes=None, average='micro') goes without): the per-class counts live in a "
    "fixed-size packed state allocated at construction, class-index preds carry no class count to infer it from, "
    "and out-of-range targets are counted against it. Pass num_classes=C"
)


def check_zero_division(metric: str, value, taken: bool = True) -> float:
    """``zero_division`` as a float: 0, 1 or NaN (torchmetrics' values; NaN as
    its arithmetic gives it, e.g. ``validate_args=False`` or JaccardIndex)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not (float(value) in (0.0, 1.0) or value != value):
        A.fail(metric, "zero_division", f"must be 0, 1 or float('nan'), got {value!r}")
    if not taken and float(value) != 0.0:
        A.fail(metric, "zero_division", f"is not taken by {metric} (torchmetrics' {metric} has none either: an "
               "undefined value is 0.0 here); drop it")
    return float(value)


class _Classification(Metric):
    """Task / argument handling shared by every classification metric."""

    _default_average = "micro"
    _uses_average = True
    _needs_confmat = False
    _has_multidim_average = True
    _allowed_tasks = A.TASKS
    #: takes ``preds=LinearLogits`` with top_k > 1: the formula reads no per-class predicted counts
    _linear_top_k = False
    #: whether the value reads ``zero_division`` (torchmetrics: Precision, Recall,
    #: F-beta, Jaccard); Accuracy and Specificity take it and ignore it, as there
    _uses_zero_division = False
    _takes_zero_division = True
    #: multiclass ``top_k > 1`` counts torchmetrics' one prediction per row (the target when it is in the
    #: row's top-k, else the top-1 class: ``RefinedTopKStatistic``), not every top-k class as predicted
    _one_prediction_per_row = False

    def __init__(
        self,
        task: str,
        num_classes: int | None = None,
        num_labels: int | None = None,
        threshold: float = 0.5,
        top_k: int = 1,
        average: str | None = "default",
        ignore_index: int | None = None,
        nan_strategy: str = "error",
        multidim_average: str = "global",
        class_dim: int | None = None,
        zero_division: float = 0.0,
    ):
        super().__init__(nan_strategy=nan_strategy)
        name = type(self).__name__
        zero_division = check_zero_division(name, zero_division, self._takes_zero_division)
        A.check_choice(name, "task", task, self._allowed_tasks)
        A.check_choice(name, "multidim_average", multidim_average, A.MULTIDIM_AVERAGES)
        if multidim_average != "global" and not self._has_multidim_average:
            A.fail(name, "multidim_average",
                   f"is not supported by {name} (torchmetrics has none either), got {multidim_average!r}")
        A.check_class_dim(name, class_dim)
        if average == "default":
            average = self._default_average
        if average is None:
            average = "none"
        A.check_choice(name, "average", average, F.AVERAGES)
        A.check_choice(name, "nan_strategy", nan_strategy, A.NAN_STRATEGIES)
        A.check_ignore_index(name, ignore_index)
        A.check_threshold(name, threshold)
        A.check_int(name, "top_k", top_k)
        if task == "multiclass":
            A.check(num_classes is not None, name, "num_classes", NUM_CLASSES_REQUIRED)
            A.check_int(name, "num_classes", num_classes, lo=2)
            if not (top_k <= num_classes):
                A.fail(name, "top_k", f"must be <= num_classes={num_classes}, got {top_k}")
            if not (top_k == 1 or not self._needs_confmat):
                A.fail(name, "top_k", f"must be 1 for {name}, got {top_k}")
        else:
            if not (top_k == 1):
                A.fail(name, "top_k", f"is only supported for task='multiclass', got top_k={top_k} for task={task!r}")
        if task == "multilabel":
            A.check(num_labels is not None, name, "num_labels", "is required for task='multilabel'")
            A.check_int(name, "num_labels", num_labels)
        self.task = task
        self.num_classes = num_classes if task == "multiclass" else None
        self.num_labels = num_labels if task == "multilabel" else None
        self.threshold = float(threshold)
        self.top_k = int(top_k)
        self.average = average
        self.ignore_index = ignore_index
        self.multidim_average = multidim_average
        self.class_dim = class_dim
        self.zero_division = zero_division
        if self._top_k_by_row and multidim_average == "samplewise":
            A.fail(name, "multidim_average", f"='samplewise' is not supported with top_k > 1, got top_k={top_k}")

    @property
    def _top_k_by_row(self) -> bool:
        """Whether this instance counts one prediction per row (``_one_prediction_per_row``, multiclass, top_k > 1)."""
        return self._one_prediction_per_row and self.task == "multiclass" and self.top_k > 1

    # -- statistics ---------------------------------------------------------

    def _statistic(self):
        if self._top_k_by_row:
            return RefinedTopKStatistic(self.num_classes, self.ignore_index, k=self.top_k, inputs=INPUTS)
        if self.multidim_average == "samplewise":
            size = self.num_classes if self.task == "multiclass" else self.num_labels
            shape = (size,) if self.task != "binary" and self.average == "none" else ()
            # every argument of _sample_scores: members whose scores differ never share the sums
            key = (type(self).__name__, self.average, getattr(self, "beta", None), repr(getattr(self, "zero_division", 0)))
            return SamplewiseStatistic(
                self.task, size, self._sample_scores, key, shape, threshold=self.threshold,
                ignore_index=self.ignore_index, top_k=self.top_k, inputs=INPUTS,
            )
        if self.task == "multiclass":
            return ClassStatistic(
                self.num_classes, self.ignore_index, (self.top_k,), confmat=self._needs_confmat, inputs=INPUTS,
            )
        return BinaryStatistic(self.num_labels, self.threshold, self.ignore_index, inputs=INPUTS)

    def _statistics(self):
        return {"stats": self._statistic()}

    # -- update -------------------------------------------------------------

    def _check_inputs(self, preds, target, mask):
        """Checks metadata; returns ``preds, target`` with the class / label
        dim last (views of the inputs: channel-first ``[N, C, d1, ...]`` is
        moved, not copied; the inputs themselves when nothing moves)."""
        name = type(self).__name__
        A.check_preds_target(name, preds, target)
        ps, ts = tuple(preds.shape), tuple(target.shape)
        least = (2, "[N, d1, ...]")  # the least samplewise input (torchmetrics' rule)
        if self.task == "multiclass":
            C = self.num_classes
            A.check_index_dtype(name, "target", target)
            if preds.dim() == target.dim() + 1:
                if not preds.is_floating_point():
                    A.fail(name, "preds", f"with one dim more than target must be floating scores, got {preds.dtype}",
                           TypeError)
                preds = A.channel_last(preds, A.score_class_dim(name, ps, ts, C, self.class_dim))
                least = (3, "[N, C, d1, ...]")
            else:
                if ps != ts:
                    A.fail(name, "preds", f"must be class indices of target's shape {ts} or scores [N, C, d1, ...] / "
                           f"target.shape + (C,) with C = num_classes = {C}, got {ps}")
                if not (self.top_k == 1):
                    A.fail(name, "preds", f"must be scores [N, C, ...] for top_k={self.top_k}, got class indices")
        else:
            if not (ps == ts):
                A.fail(name, "preds", f"must have target's shape {ts}, got {ps}")
            if self.task == "multilabel":
                dim = A.label_dim(name, ps, self.num_labels, self.class_dim)
                preds, target = A.channel_last(preds, dim), A.channel_last(target, dim)
                least = (3, "[N, num_labels, d1, ...]")
        if self.multidim_average == "samplewise" and len(ps) < least[0]:
            A.fail(name, "preds", f"must be at least {least[0]}-D {least[1]} for multidim_average='samplewise', "
                   f"got {ps}")
        A.check_mask(name, mask, ts)
        return preds, target

    def update(self, preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None, vocab=None) -> None:
        """Adds a batch (device-local, no host sync). ``mask`` broadcasts to
        ``target`` as given (before any class dim is moved).

        ``vocab``: a ``dk.VocabShard`` when ``preds`` are this tensor-parallel
        rank's columns ``[start, start + size)`` of the class scores
        (``[..., size]``, class dim last; task="multiclass",
        multidim_average="global"): the tp ranks exchange per-row partials
        (one all-gather per update) and each writes the state of the
        unsharded scores (``d9d_kernels.metrics.vocab_parallel``).

        ``preds`` may be ``dk.LinearLogits(hidden, weight)`` (task="multiclass",
        hidden ``[N, D]`` / ``[B, T, D]`` with target ``[N]`` / ``[B, T]``):
        the logits are never materialised (``d9d_kernels.metrics.linear_logits``);
        with ``vocab``, ``weight`` is this tp rank's shard."""
        if isinstance(preds, LinearLogits):
            self._update_linear(preds, target, mask, vocab)
            return
        if vocab is not None:
            self._check_vocab(preds, target, mask)
            name = type(self).__name__
            split = resolve(name, vocab, preds, target, self.num_classes)
            self._feed({"stats": dict(preds=preds, target=target, mask=mask, vocab=split)})
            return
        preds_cl, target_cl = self._check_inputs(preds, target, mask)
        if mask is not None and target_cl is not target:
            mask = A.channel_last(torch.broadcast_to(mask, target.shape), 1)
        self._feed({"stats": dict(preds=preds_cl, target=target_cl, mask=mask)})

    def _update_linear(self, preds: LinearLogits, target, mask, vocab) -> None:
        name = type(self).__name__
        why = unsupported(self)
        if why is not None:
            A.fail(name, "preds", f"is a dk.LinearLogits, which {why}; LinearLogits is taken by: {TAKEN_BY}")
        check_linear(name, preds, target, mask, self.num_classes, vocab)
        kw = dict(preds=preds, target=target, mask=mask)
        if vocab is not None:
            kw["vocab"] = resolve(name, vocab, preds, target, self.num_classes)
        self._feed({"stats": kw})

    def _check_vocab(self, preds, target, mask):
        """Metadata checks of a vocab-sharded update (this rank's own; ``resolve`` checks across tp)."""
        name = type(self).__name__
        A.check(self.task == "multiclass", name, "vocab", f"needs task='multiclass', got task={self.task!r}")
        A.check(not self._top_k_by_row, name, "vocab",
                f"is not supported with top_k > 1 (the rows' top-k is not per shard), got top_k={self.top_k}")
        A.check(self.multidim_average == "global", name, "vocab",
                f"needs multidim_average='global', got {self.multidim_average!r}")
        A.check_preds_target(name, preds, target)
        A.check_index_dtype(name, "target", target)
        A.check(preds.is_floating_point(), name, "preds", f"must be floating scores with vocab=, got {preds.dtype}",
                TypeError)
        ps, ts = tuple(preds.shape), tuple(target.shape)
        A.check(len(ps) == len(ts) + 1 and ps[:-1] == ts, name, "preds",
                f"must be this rank's scores target.shape + (size,) with vocab= (class dim last), got preds {ps}, "
                f"target {ts}")
        A.check_mask(name, mask, ts)

    # -- compute ------------------------------------------------------------

    def _counts(self, s):
        """``tp, fp, tn, fn`` ([C] or [L]) and whether they are per label."""
        if self.task == "multiclass":
            st = s["stats"][0]
            n = s["extras"][0]
            tp, pred, tgt = st[0], st[1], st[2]
            fp = pred - tp
            fn = tgt - tp
            return tp, fp, n - tp - fp - fn, fn
        st = s["state"]
        return st[:, 0], st[:, 1], st[:, 2], st[:, 3]

    def _raise_on_bad(self) -> bool:
        return True  # out-of-range indices raise under every nan_strategy

    def _bad_message(self, count) -> str:
        return A.bad_message(self._label, count, self.nan_strategy)

    def _finish(self, s, value: torch.Tensor) -> torch.Tensor:
        if self.nan_strategy == "propagate":
            value = torch.where(s["bad"][1] > 0, float("nan"), value)
        return value

    def _compute(self, states):
        s = states["stats"]
        if self.multidim_average == "samplewise":
            return self._finish(s, F.safe_div(s["sum"], s["count"][0]))
        return self._finish(s, self._value(s))

    def _value(self, s) -> torch.Tensor:
        return self._sample_scores(*self._counts(s))

    def _sample_scores(self, tp, fp, tn, fn) -> torch.Tensor:
        """The metric of counts ``[..., C]`` (leading dims: samples), reduced over the last dim."""
        if self.task == "binary":
            return self._formula(tp, fp, tn, fn, "micro", True, 1)
        return self._formula(tp, fp, tn, fn, self.average, self.task != "multiclass", self.top_k)

    def _formula(self, tp, fp, tn, fn, average, multilabel, top_k):
        raise NotImplementedError


class Accuracy(_Classification):
    """Accuracy (torchmetrics ``Accuracy`` / sklearn ``accuracy_score``; macro = balanced accuracy).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.Accuracy(task="multiclass", num_classes=3)
        >>> m.update(torch.tensor([0, 2, 1, 1]), torch.tensor([0, 1, 1, 1]))
        >>> m.compute().item()
        0.75
    """

    _linear_top_k = True

    def _formula(self, tp, fp, tn, fn, average, multilabel, top_k):
        return F.accuracy(tp, fp, tn, fn, average, multilabel, top_k)


class Precision(_Classification):
    """Precision ``tp / (tp + fp)`` (torchmetrics ``Precision`` / sklearn ``precision_score``).

    ``zero_division`` (0, 1 or NaN): the score of a class with ``tp + fp == 0``."""

    _uses_zero_division = True

    def _formula(self, tp, fp, tn, fn, average, multilabel, top_k):
        return F.precision(tp, fp, tn, fn, average, multilabel, top_k, self.zero_division)


class Recall(_Classification):
    """Recall ``tp / (tp + fn)`` (torchmetrics ``Recall`` / sklearn ``recall_score``).

    ``zero_division`` (0, 1 or NaN): the score of a class with ``tp + fn == 0``."""

    _uses_zero_division = True
    _linear_top_k = True

    def _formula(self, tp, fp, tn, fn, average, multilabel, top_k):
        return F.recall(tp, fp, tn, fn, average, multilabel, top_k, self.zero_division)


class FBetaScore(_Classification):
    """F-beta (torchmetrics ``FBetaScore`` / sklearn ``fbeta_score``).

    ``zero_division`` (0, 1 or NaN): the score of a class with ``tp + fp + fn == 0``."""

    _uses_zero_division = True

    def __init__(self, task: str, beta: float = 1.0, num_classes=None, num_labels=None, threshold=0.5, top_k=1,
                 average="default", ignore_index=None, nan_strategy="error", multidim_average="global", class_dim=None,
                 zero_division: float = 0.0):
        name = type(self).__name__
        A.check(isinstance(beta, (int, float)) and not isinstance(beta, bool) and beta > 0, name, "beta",
                f"must be a float > 0, got {beta!r}")
        self.beta = float(beta)
        super().__init__(task, num_classes, num_labels, threshold, top_k, average, ignore_index, nan_strategy,
                         multidim_average, class_dim, zero_division)

    def _formula(self, tp, fp, tn, fn, average, multilabel, top_k):
        return F.fbeta(tp, fp, tn, fn, self.beta, average, multilabel, top_k, self.zero_division)


class F1Score(FBetaScore):
    """F1 (torchmetrics ``F1Score`` / sklearn ``f1_score``).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.F1Score(task="binary")
        >>> m.update(torch.tensor([0.9, 0.2, 0.7, 0.1]), torch.tensor([1, 0, 0, 1]))
        >>> m.compute().item()
        0.5
    """

    def __init__(self, task: str, num_classes=None, num_labels=None, threshold=0.5, top_k=1,
                 average="default", ignore_index=None, nan_strategy="error", multidim_average="global", class_dim=None,
                 zero_division: float = 0.0):
        super().__init__(task, 1.0, num_classes, num_labels, threshold, top_k, average, ignore_index, nan_strategy,
                         multidim_average, class_dim, zero_division)


class Specificity(_Classification):
    """Specificity ``tn / (tn + fp)`` (torchmetrics ``Specificity``).

    ``top_k > 1`` counts as torchmetrics does: one prediction per row, the
    target when it is in the row's top-k, else the top-1 class
    (``RefinedTopKStatistic``).
    """

    _one_prediction_per_row = True

    def _formula(self, tp, fp, tn, fn, average, multilabel, top_k):
        # top_k=1: the counts of top_k > 1 are already one prediction per row, and torchmetrics' average
        # takes no top_k there (macro leaves out only classes absent from both target and predictions)
        return F.specificity(tp, fp, tn, fn, average, multilabel, 1)


class JaccardIndex(_Classification):
    """Jaccard index / IoU ``tp / (tp + fp + fn)`` (torchmetrics ``JaccardIndex``,
    default ``average="macro"`` / sklearn ``jaccard_score``).

    Multiclass ``ignore_index`` of a class ``0 <= i < num_classes``: as
    torchmetrics, class ``i`` leaves the averages (scikit-learn's
    ``labels=`` without it, on the rows whose target is not ``i``).
    """

    _default_average = "macro"
    _has_multidim_average = False
    _uses_zero_division = True

    def _formula(self, tp, fp, tn, fn, average, multilabel, top_k):
        zd, i = self.zero_division, self.ignore_index
        if self.task != "multiclass" or i is None or not 0 <= i < self.num_classes or average == "none":
            return F.jaccard(tp, fp, tn, fn, average, multilabel, top_k, zd)
        # ignore_index is a class: its rows are dropped, and the rows predicting it belong to no union (its
        # false positives are zeroed), so it leaves the micro sums and the macro mean, as in torchmetrics;
        # in "none" it scores 0 / fp as there (0.0 where it was predicted, else zero_division)
        fp_out = fp.clone()
        fp_out[..., i] = 0.0
        if average == "micro" or zd == 0.0:
            return F.jaccard(tp, fp_out, tn, fn, average, multilabel, top_k, zd)
        # macro / weighted: the class's weight is 0, but a NaN score of it (zero_division=NaN) still
        # reaches the weighted sum, as torchmetrics' ``(weights * jaccard / weights.sum()).sum()``
        score = F.jaccard(tp, fp, tn, fn, "none", multilabel, top_k, zd)
        return F._average(score, tp, fp_out, fn, average, multilabel, top_k)


class _ConfmatMetric(_Classification):
    _needs_confmat = True
    _uses_average = False
    _has_multidim_average = False

    def _confmat(self, s) -> torch.Tensor:
        """``[C, C]`` (multiclass) or ``[L, 2, 2]`` (binary: L = 1)."""
        if self.task == "multiclass":
            return s["confmat"]
        tp, fp, tn, fn = self._counts(s)
        return F.binary_confmat(tp, fp, tn, fn)


class MatthewsCorrCoef(_ConfmatMetric):
    """Matthews correlation (sklearn ``matthews_corrcoef``; torchmetrics
    ``MatthewsCorrCoef``). Multilabel: the labels' 2x2 matrices summed (as
    torchmetrics). 0.0 when undefined (sklearn)."""

    _takes_zero_division = False

    def _value(self, s):
        cm = self._confmat(s)
        if self.task != "multiclass":
            cm = cm.sum(0)
        return F.matthews_corrcoef(cm)


class CohenKappa(_ConfmatMetric):
    """Cohen's kappa (sklearn ``cohen_kappa_score``; torchmetrics ``CohenKappa``),
    ``weights=None|"linear"|"quadratic"``; tasks binary / multiclass. 0.0 when undefined."""

    _allowed_tasks = ("binary", "multiclass")

    def __init__(self, task: str, num_classes=None, threshold=0.5, weights: str | None = None, ignore_index=None,
                 nan_strategy="error", class_dim=None):
        super().__init__(task, num_classes=num_classes, threshold=threshold, ignore_index=ignore_index,
                         nan_strategy=nan_strategy, class_dim=class_dim)
        A.check_choice(type(self).__name__, "weights", weights, (None, "none", "linear", "quadratic"))
        self.weights = None if weights == "none" else weights

    def _value(self, s):
        cm = self._confmat(s)
        if self.task != "multiclass":
            cm = cm[0]
        return F.cohen_kappa(cm, self.weights)


class ConfusionMatrix(_ConfmatMetric):
    """Confusion matrix, rows = target, columns = prediction (torchmetrics
    ``ConfusionMatrix`` / sklearn ``confusion_matrix``): ``[2, 2]`` binary,
    ``[L, 2, 2]`` multilabel, ``[C, C]`` multiclass; ``normalize`` None /
    "true" / "pred" / "all" (empty rows/columns stay 0)."""

    def __init__(self, task: str, num_classes=None, num_labels=None, threshold=0.5, normalize: str | None = None,
                 ignore_index=None, nan_strategy="error", class_dim=None):
        super().__init__(task, num_classes=num_classes, num_labels=num_labels, threshold=threshold,
                         ignore_index=ignore_index, nan_strategy=nan_strategy, class_dim=class_dim)
        A.check_choice(type(self).__name__, "normalize", normalize, (None, "none", "true", "pred", "all"))
        self.normalize = None if normalize == "none" else normalize

    def _value(self, s):
        cm = self._confmat(s)
        if self.task == "binary":
            cm = cm[0]
        return F.normalize_confmat(cm, self.normalize)

    def plot(self, values=None, ax=None):
        """As ``Metric.plot``; a multilabel ``[L, 2, 2]`` result is drawn as one
        2x2 heat map per label on a grid of subplots (torchmetrics'
        ``MultilabelConfusionMatrix.plot``), into ``ax`` when it is an array of
        at least L axes. Returns ``(fig, axes)``."""
        if values is None:
            values = self.compute()
        if isinstance(values, torch.Tensor) and values.dim() == 3:
            return _plot_per_label(values, ax, self._label)
        return super().plot(values, ax)


def _plot_per_label(values: torch.Tensor, ax, title: str):
    """One heat map per leading index of ``values`` ``[L, 2, 2]``: ``(fig, axes[:L])``."""
    from d9d_kernels.plot import _pyplot, plot_values

    plt = _pyplot()
    L = values.shape[0]
    if ax is None:
        cols = max(1, math.ceil(math.sqrt(L)))
        rows = max(1, math.ceil(L / cols))
        fig, grid = plt.subplots(rows, cols, squeeze=False, constrained_layout=True)
        axes = list(grid.reshape(-1))
        for extra in axes[L:]:
            extra.axis("off")
    else:
        axes = list(ax.reshape(-1)) if hasattr(ax, "reshape") else list(ax) if isinstance(ax, (list, tuple)) else [ax]
        A.check(len(axes) >= L, title, "ax", f"must be None or an array of at least {L} axes (one per label of the "
                f"[{L}, 2, 2] multilabel matrix), got {len(axes)}")
        fig = axes[0].get_figure()
    for i in range(L):
        plot_values(values[i], axes[i], title=f"{title} label {i}")
    return fig, axes[:L]
