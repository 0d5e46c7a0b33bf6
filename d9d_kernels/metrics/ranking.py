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

``thresholds`` (torchmetrics' binned curves): an int ``T`` is
``linspace(0, 1, T)``, i.e. ``num_bins = T - 1`` (bin edges ``k / (T - 1)``);
a list / 1-d tensor of increasing thresholds in [0, 1] that all lie on a
uniform grid ``k / B`` (to 1e-7, ``B <= MAX_THRESHOLD_BINS``) is a ``B``-bin
histogram whose curve takes only those thresholds (``formulas.ranking``).
Other lists raise ``ValueError``: the histogram's bins are uniform.
"""

from __future__ import annotations

import math
from fractions import Fraction

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.formulas import ranking as R
from d9d_kernels.metrics.score_histogram import HistogramStatistic
from d9d_kernels.metrics.labelled import INPUTS

__all__ = ["AUROC", "AveragePrecision"]


def constant(values, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without blocking the
    host: on CUDA the values go through pinned memory and a non-blocking copy
    (a copy from pageable memory waits for the stream)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)

#: the default ``num_bins`` (a ``num_bins`` that differs from it and from the bins ``thresholds`` implies is refused)
DEFAULT_BINS = 10_000
#: the most bins a list of ``thresholds`` may need (its grid ``k / B``)
MAX_THRESHOLD_BINS = 100_000
#: how far a threshold may lie from its grid point ``k / B``: float32 rounding (torchmetrics' thresholds are float32)
THRESHOLD_TOL = 1e-7


def _simplest_between(lo: Fraction, hi: Fraction) -> Fraction:
    """The fraction of smallest denominator in ``[lo, hi]`` (``0 <= lo <= hi``)."""
    fl = math.floor(lo)
    if lo == fl or fl + 1 <= hi:
        return Fraction(math.ceil(lo))
    return fl + 1 / _simplest_between(1 / (hi - fl), 1 / (lo - fl))


def threshold_bins(name: str, thresholds, num_bins: int) -> tuple[int, tuple[int, ...] | None]:
    """``(num_bins, edges)`` of torchmetrics' ``thresholds`` (None: ``(num_bins,
    None)``, the full histogram); ``edges``: per threshold its bin index ``k``
    (``t = k / num_bins``), or None when the thresholds are every bin edge."""
    if thresholds is None:
        return num_bins, None
    explicit = num_bins != DEFAULT_BINS
    if isinstance(thresholds, int) and not isinstance(thresholds, bool):
        A.check(thresholds >= 2, name, "thresholds", f"as an int must be >= 2 (torchmetrics' linspace(0, 1, "
                f"thresholds)), got {thresholds}")
        B = thresholds - 1
        A.check(not explicit or num_bins == B, name, "num_bins",
                f"={num_bins} contradicts thresholds={thresholds} (= num_bins={B}: bin edges k/{B}); give one of them")
        return B, None
    if isinstance(thresholds, torch.Tensor):
        A.check(thresholds.dim() == 1 and not thresholds.is_complex(), name, "thresholds",
                f"as a tensor must be 1-d and real, got shape {tuple(thresholds.shape)}")
        values = thresholds.detach().to("cpu", torch.float64).tolist()
    elif isinstance(thresholds, (list, tuple)):
        A.check(all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in thresholds), name, "thresholds",
                f"as a list must hold floats in [0, 1], got {thresholds!r}")
        values = [float(t) for t in thresholds]
    else:
        A.fail(name, "thresholds", f"must be None, an int, a list of floats or a 1-d tensor, got "
               f"{type(thresholds).__name__}")
    A.check(len(values) >= 1, name, "thresholds", "must not be empty")
    A.check(all(0.0 <= t <= 1.0 for t in values), name, "thresholds", f"must lie in [0, 1], got {values}")
    A.check(all(a <= b for a, b in zip(values, values[1:])), name, "thresholds",
            f"must be increasing (the curve runs through them in order; sort them), got {values}")
    tol = Fraction(THRESHOLD_TOL)
    if explicit:
        B = num_bins
    else:
        B = 1
        for t in values:
            q = _simplest_between(max(Fraction(t) - tol, Fraction(0)), min(Fraction(t) + tol, Fraction(1))).denominator
            B = B * q // math.gcd(B, q)
            if B > MAX_THRESHOLD_BINS:
                break
    edges = tuple(round(t * B) for t in values)
    off = [t for t, k in zip(values, edges) if abs(t - k / B) > THRESHOLD_TOL]
    if B > MAX_THRESHOLD_BINS or off:
        why = (f"thresholds {off[:4]} are not multiples of 1/num_bins={B}" if off and explicit else
               f"no uniform grid k/num_bins with num_bins <= {MAX_THRESHOLD_BINS} holds them all")
        A.fail(name, "thresholds", f"cannot be mapped onto the score histogram, whose bins are uniform: {why}. Use "
               "thresholds=<int> (torchmetrics' linspace(0, 1, n)), thresholds on a grid k/num_bins (e.g. "
               "[0.1, 0.25, 0.5]), or thresholds=None with num_bins=... (default 10_000: within 1e-3 of the "
               "exact curve)")
    return B, edges



class _Ranking(Metric):
    _formula = None

    def __init__(
        self,
        task: str,
        num_classes: int | None = None,
        num_labels: int | None = None,
        average: str | None = "macro",
        num_bins: int = DEFAULT_BINS,
        ignore_index: int | None = None,
        nan_strategy: str = "error",
        thresholds: int | list[float] | torch.Tensor | None = None,
        class_dim: int | None = None,
    ):
        super().__init__(nan_strategy=nan_strategy)
        name = type(self).__name__
        A.check_class_dim(name, class_dim)
        A.check_int(name, "num_bins", num_bins, lo=1)
        num_bins, edges = threshold_bins(name, thresholds, num_bins)
        A.check_choice(name, "task", task, A.TASKS)
        average = "none" if average is None else average
        A.check_choice(name, "average", average, R.AVERAGES)
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
        self.thresholds = thresholds if thresholds is None or isinstance(thresholds, int) else list(
            thresholds.tolist() if isinstance(thresholds, torch.Tensor) else thresholds)
        self._edges = edges

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

    def _edge_index(self, device) -> torch.Tensor | None:
        """``thresholds`` as bin indices on ``device`` (None: every bin edge)."""
        return None if self._edges is None else constant(self._edges, torch.int64, device)

    def _value(self, hist, average) -> torch.Tensor:
        return type(self)._formula(hist, average, self._edge_index(hist.device))

    def _compute(self, states):
        s = states["hist"]
        average = "macro" if self.task == "binary" else self.average
        value = self._value(s["hist"], average)
        if self.task == "binary":
            value = value.reshape(())
        if self.nan_strategy == "propagate":
            value = torch.where(s["bad"][1] > 0, torch.full_like(value, float("nan")), value)
        return value


class AUROC(_Ranking):
    """Area under the ROC curve from ``num_bins`` score bins (torchmetrics
    ``AUROC`` / sklearn ``roc_auc_score``; multiclass is one-vs-rest,
    ``multi_class="ovr"``). ``thresholds``: torchmetrics' binned curve (module
    doc). ``max_fpr`` (task="binary", as torchmetrics): the McClish-corrected
    partial AUC up to that false positive rate (sklearn
    ``roc_auc_score(max_fpr=...)``).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.AUROC(task="binary")
        >>> m.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        >>> m.compute().item()
        0.75
    """

    _formula = staticmethod(R.auroc)

    def __init__(self, task: str, num_classes: int | None = None, num_labels: int | None = None,
                 average: str | None = "macro", num_bins: int = DEFAULT_BINS, ignore_index: int | None = None,
                 nan_strategy: str = "error", thresholds: int | list[float] | torch.Tensor | None = None,
                 class_dim: int | None = None, max_fpr: float | None = None):
        super().__init__(task, num_classes, num_labels, average, num_bins, ignore_index, nan_strategy, thresholds,
                         class_dim)
        if max_fpr is not None:
            A.check(isinstance(max_fpr, (int, float)) and not isinstance(max_fpr, bool) and 0 < max_fpr <= 1,
                    "AUROC", "max_fpr", f"must be a float in (0, 1], got {max_fpr!r}")
            A.check(task == "binary", "AUROC", "max_fpr", f"is only taken for task='binary' (as torchmetrics, whose "
                    f"{task} AUROC ignores it), got task={task!r}; compute a binary AUROC per label / class instead")
            max_fpr = float(max_fpr)
        self.max_fpr = max_fpr

    def _value(self, hist, average) -> torch.Tensor:
        return R.auroc(hist, average, self._edge_index(hist.device), self.max_fpr)


class AveragePrecision(_Ranking):
    """Step-wise average precision from ``num_bins`` score bins (torchmetrics
    ``AveragePrecision`` / sklearn ``average_precision_score``)."""

    _formula = staticmethod(R.average_precision)
