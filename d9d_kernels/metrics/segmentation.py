"""Segmentation metrics with torchmetrics 1.9 ``torchmetrics.segmentation`` semantics:
``Dice`` (= ``DiceScore``), ``GeneralizedDiceScore``, ``MeanIoU``.

Inputs as torchmetrics takes them (``input_format``):

* ``"one-hot"``: preds and target ``[N, C, ...]``; integer/bool (multi-)hot
  tensors, or float scores (argmax over dim 1, as torchmetrics does).
* ``"index"``: preds and target ``[N, ...]`` class indices.
* ``"mixed"``: one of them one-hot ``[N, C, ...]``, the other ``[N, ...]`` indices.

All three are per-sample metrics (a score per image, then averaged over
images), so each update reduces its batch to per-sample, per-class counts
``(intersection, pred sum, target sum)`` ``[N, C]`` (``segmentation_counts``:
one ``index_add_`` for index inputs, one reduction for hot ones) and adds
per-sample scores into fixed-size SUM slots. Sums of per-sample scores add up
across updates and ranks: the result equals torchmetrics' on the
concatenated samples.

Index values outside ``[0, num_classes)`` (other than ``ignore_index``) are
counted on the device, left out, and make ``compute()`` raise ``ValueError``
with the count (torchmetrics' ``one_hot`` raises at update).
"""

from __future__ import annotations

import math

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics._memo import LastInputs

__all__ = ["Dice", "DiceScore", "GeneralizedDiceScore", "MeanIoU", "segmentation_counts"]

INPUT_FORMATS = ("one-hot", "index", "mixed")


def _safe_divide(num, den, zero_division: float):
    return torch.where(den != 0, num / den, torch.full((), zero_division, dtype=num.dtype, device=num.device))


def _hot(t: torch.Tensor, C: int) -> torch.Tensor:
    """``[N, C, S]`` from index ``[N, S]`` (bool: 1 byte a pixel and class, where
    ``one_hot`` would take 8) or a hot tensor as it is (its own dtype)."""
    if t.dim() == 2:
        return t[:, None, :] == torch.arange(C, device=t.device)[None, :, None]
    return t


def segmentation_counts(metric: str, preds, target, num_classes: int | None, input_format: str,
                        include_background: bool, ignore_index: int | None = None, mask=None):
    """Per-sample, per-class ``(intersection, pred_sum, target_sum, bad, present)``.

    Returns float64 ``[N, C']`` tensors (``C' = C - 1`` without background when
    ``C > 1``), the float64 ``[1]`` count of out-of-range index pixels and
    ``present`` bool ``[N]``: the samples that count (with ``mask``: those with
    a kept pixel; else all).
    ``mask``: bool, broadcastable to the pixel grid ``[N, d1, ...]``.
    Shapes are checked here (metadata only); values never leave the device.
    """
    ps, ts = tuple(preds.shape), tuple(target.shape)
    p_hot = input_format == "one-hot" or (input_format == "mixed" and len(ps) == len(ts) + 1)
    t_hot = input_format == "one-hot" or (input_format == "mixed" and len(ts) == len(ps) + 1)
    if input_format == "mixed":
        A.check(p_hot != t_hot, metric, "target", f"with input_format='mixed' exactly one of preds/target must have one "
                f"more (class) dim, got preds {ps}, target {ts}")
        hot_s, idx_s = (ps, ts) if p_hot else (ts, ps)
        A.check(hot_s[0] == idx_s[0] and hot_s[2:] == idx_s[1:], metric, "target",
                f"shape {ts} does not match preds {ps} (one-hot [N, C, ...] vs index [N, ...])")
    else:
        A.check(ps == ts, metric, "target", f"must have preds' shape {ps}, got {ts}")
    hot_shape = ps if p_hot else ts if t_hot else None
    if hot_shape is not None:
        A.check(len(hot_shape) >= 3, metric, "preds", f"one-hot inputs must be [N, C, d1, ...] (>= 3 dims), got {hot_shape}")
        C = hot_shape[1]
        A.check(num_classes is None or num_classes == C, metric, "num_classes",
                f"is {num_classes} but the one-hot input has {C} channels")
    else:
        A.check(len(ps) >= 2, metric, "preds", f"index inputs must be [N, d1, ...] (>= 2 dims), got {ps}")
        C = num_classes
    for arg, t, hot in (("preds", preds, p_hot), ("target", target, t_hot)):
        if not hot:
            A.check(not t.is_floating_point(), metric, arg, f"in index format must hold integer class indices, got {t.dtype}",
                    TypeError)
    if ignore_index is not None:
        A.check(not t_hot, metric, "ignore_index", "needs index targets (input_format='index' or 'mixed' with "
                "index target)")
    N = ps[0]
    grid = (N, *(ps[2:] if p_hot else ps[1:]))
    S = math.prod(grid[1:])  # pixels per sample (explicit: N may be 0)
    A.check_mask(metric, mask, grid)

    def as_index(t, hot):
        if hot and t.is_floating_point():  # scores: argmax over classes, as torchmetrics' _format_logits
            return t.argmax(dim=1).reshape(N, S)
        return None if hot else t.reshape(N, S)

    pi, ti = as_index(preds, p_hot), as_index(target, t_hot)
    bad = torch.zeros(1, dtype=torch.float64, device=preds.device)
    keep = None if mask is None else torch.broadcast_to(mask, grid).reshape(N, S)
    present = (torch.ones(N, dtype=torch.bool, device=preds.device) if keep is None else keep.any(1))
    if ti is not None:
        if keep is None:
            keep = torch.ones_like(ti, dtype=torch.bool)
        if ignore_index is not None:
            keep = keep & (ti != ignore_index)
        t_ok = (ti >= 0) & (ti < C)
        bad = bad + (keep & ~t_ok).sum()
        keep = keep & t_ok
    if pi is not None:
        p_ok = (pi >= 0) & (pi < C)
        valid = p_ok if keep is None else keep & p_ok
        bad = bad + (~p_ok if keep is None else keep & ~p_ok).sum()
        keep = valid
    if pi is not None and ti is not None:
        # both index: per-(sample, class) counts by one index_add_ each, no one-hot tensors
        off = (torch.arange(N, device=pi.device) * C)[:, None]
        w = keep.to(torch.float64).reshape(-1)
        pidx = (pi.clamp(0, C - 1) + off).reshape(-1)
        tidx = (ti.clamp(0, C - 1) + off).reshape(-1)
        out = torch.zeros(3, N * C, dtype=torch.float64, device=pi.device)
        out[0].index_add_(0, pidx, w * (pi == ti).reshape(-1))
        out[1].index_add_(0, pidx, w)
        out[2].index_add_(0, tidx, w)
        inter, psum, tsum = out.reshape(3, N, C).unbind(0)
    else:
        ph = _hot(pi if pi is not None else preds.reshape(N, C, S), C)
        th = _hot(ti if ti is not None else target.reshape(N, C, S), C)
        if keep is not None:  # ignored / masked pixels leave both sides
            ph, th = ph * keep[:, None, :], th * keep[:, None, :]
        # integer sums (exact; ~15x faster than summing into float64 on CPU), then float64
        inter, psum, tsum = ((ph * th).sum(-1).double(), ph.sum(-1).double(), th.sum(-1).double())
    if not include_background and C > 1:
        inter, psum, tsum = inter[:, 1:], psum[:, 1:], tsum[:, 1:]
    return inter, psum, tsum, bad.reshape(1), present


#: one counting pass per group update for members of one configuration (d9d_kernels/metrics/_memo.py)
_memo = LastInputs()


class _Segmentation(Metric):
    _name = "Segmentation"

    def _init_common(self, num_classes, include_background, input_format, required=True):
        name = self._name
        if required or num_classes is not None:
            A.check(num_classes is not None, name, "num_classes", "is required")
            A.check_int(name, "num_classes", num_classes)
        A.check(isinstance(include_background, bool), name, "include_background",
                f"must be a bool, got {include_background!r}", TypeError)
        A.check_choice(name, "input_format", input_format, INPUT_FORMATS)
        A.check(input_format != "index" or num_classes is not None, name, "num_classes",
                "is required for input_format='index'")
        self.num_classes, self.include_background, self.input_format = num_classes, include_background, input_format

    def _out_classes(self) -> int:
        C = self.num_classes
        return C - 1 if not self.include_background and C > 1 else C

    def update(self, preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Adds a batch of samples (device-local, no host sync).

        ``mask``: bool, broadcastable to the pixel grid ``[N, d1, ...]``; False
        pixels leave both preds and target, and a sample without a kept pixel
        is no sample (e.g. ``[N, 1, 1]`` for padding duplicated by a
        DistributedSampler). Not in torchmetrics."""
        A.check_preds_target(self._label, preds, target)
        ignore = getattr(self, "ignore_index", None)
        key = (self.num_classes, self.input_format, self.include_background, ignore)
        counts = _memo.get((preds, target, mask), key)
        if counts is None:
            counts = segmentation_counts(self._label, preds, target, self.num_classes, self.input_format,
                                         self.include_background, ignore, mask)
            _memo.put((preds, target, mask), key, counts)
        K = counts[0].shape[1]
        expect = None if self.num_classes is None else self._out_classes()
        A.check(expect is None or K == expect, self._label, "num_classes", f"expects {expect} classes, got {K}")
        super().update(counts=counts)

    def _update(self, counts):
        inter, psum, tsum, bad, present = counts
        self.bad += bad
        self._add(inter, psum, tsum, present)

    _bad_cause = "target_out_of_range"  # pred or target class indices outside [0, num_classes)

    def _raise_on_bad(self) -> bool:
        return True

    def _bad_message(self, count: int) -> str:
        return (f"{self._label}: {count} pixel(s) with a class index outside [0, num_classes) were counted and left "
                "out since the last reset; fix the inputs (or pass ignore_index= for void labels) and reset()")


def _one_sample(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, 1, -1) if t.dim() == 1 else t.unsqueeze(0) if t.dim() == 2 else t


def _dice_average(num, den, support, average: str):
    """torchmetrics ``_dice_score_compute`` on ``[..., C]`` rows (NaN where undefined)."""
    nan = float("nan")
    if average == "micro":
        return _safe_divide(num.sum(-1), den.sum(-1), nan)
    dice = _safe_divide(num, den, nan)
    if average == "macro":
        return torch.nanmean(dice, dim=-1)
    if average == "weighted":
        weights = _safe_divide(support, support.sum(-1, keepdim=True), nan)
        nan_rows = dice.isnan().all(dim=-1)
        out = torch.nansum(dice * weights, dim=-1)
        return torch.where(nan_rows, torch.full_like(out, nan), out)
    return dice


class Dice(_Segmentation):
    """Dice score (torchmetrics ``segmentation.DiceScore``; ``DiceScore`` is the same class).

    Args:
        num_classes: C.
        include_background: keep class 0.
        average: ``"micro"``, ``"macro"`` (default, as torchmetrics 1.9),
            ``"weighted"``, ``"none"``/``None`` (per class).
        aggregation_level: ``"samplewise"`` (default: a score per sample,
            NaN samples skipped, then averaged) or ``"global"`` (counts
            summed over all samples first).
        input_format: ``"one-hot"``, ``"index"`` or ``"mixed"``.

    Slots: ``glob`` [3, C'] (2·intersection, pred + target sums, support),
    ``samp`` [2, K] (sum and count of the non-NaN per-sample scores), ``bad`` [1].

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.Dice(num_classes=3, input_format="index")
        >>> m.update(torch.tensor([[0, 1, 2, 2]]), torch.tensor([[0, 1, 1, 2]]))
        >>> round(m.compute().item(), 4)
        0.7778
    """

    _name = "Dice"

    def __init__(self, num_classes: int, include_background: bool = True, average: str | None = "macro",
                 aggregation_level: str = "samplewise", input_format: str = "one-hot"):
        super().__init__()
        self._name = type(self).__name__
        self._init_common(num_classes, include_background, input_format)
        average = "none" if average is None else average
        A.check_choice(self._name, "average", average, ("micro", "macro", "weighted", "none"))
        A.check_choice(self._name, "aggregation_level", aggregation_level, ("samplewise", "global"))
        self.average, self.aggregation_level = average, aggregation_level
        K = self._out_classes()
        self.add_state("glob", shape=(3, K))
        self.add_state("samp", shape=(2, K if average == "none" else 1))
        self.add_state("bad", shape=(1,))

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(num_classes={self.num_classes}, average={self.average!r}, "
                f"aggregation_level={self.aggregation_level!r}, input_format={self.input_format!r})")

    def _add(self, inter, psum, tsum, present):
        num, den = 2.0 * inter, psum + tsum
        self.glob += torch.stack([num.sum(0), den.sum(0), tsum.sum(0)])
        v = _dice_average(num, den, tsum, self.average).reshape(num.shape[0], self.samp.shape[1])
        self.samp += torch.stack([torch.nansum(v, 0), (~v.isnan()).sum(0).to(torch.float64)])

    def _compute(self, state):
        if self.aggregation_level == "global":
            g = state["glob"]
            out = _dice_average(g[0], g[1], g[2], self.average)
        else:
            s = state["samp"]
            out = s[0] / s[1]
        return out if self.average == "none" else out.reshape(())


DiceScore = Dice


class GeneralizedDiceScore(_Segmentation):
    """Generalized Dice score (torchmetrics ``segmentation.GeneralizedDiceScore``):
    per sample ``2 Σ_c w_c |P∩T|_c / Σ_c w_c (|P|_c + |T|_c)`` with
    ``w_c = 1/|T|_c²`` (``"square"``), ``1/|T|_c`` (``"simple"``) or 1
    (``"linear"``), averaged over samples; ``per_class`` keeps the class axis.

    A class absent from a sample's target (infinite weight) gets torchmetrics'
    replacement weight, index for index (its ``repeat(...).T`` layout).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.GeneralizedDiceScore(num_classes=3, input_format="index")
        >>> m.update(torch.tensor([[0, 1, 2, 2]]), torch.tensor([[0, 1, 1, 2]]))
        >>> round(m.compute().item(), 4)
        0.7826
    """

    _name = "GeneralizedDiceScore"

    def __init__(self, num_classes: int, include_background: bool = True, per_class: bool = False,
                 weight_type: str = "square", input_format: str = "one-hot"):
        super().__init__()
        self._init_common(num_classes, include_background, input_format)
        A.check(isinstance(per_class, bool), self._name, "per_class", f"must be a bool, got {per_class!r}", TypeError)
        A.check_choice(self._name, "weight_type", weight_type, ("square", "simple", "linear"))
        self.per_class, self.weight_type = per_class, weight_type
        self.add_state("score", shape=(self._out_classes() if per_class else 1,))
        self.add_state("samples", shape=(1,))
        self.add_state("bad", shape=(1,))

    def __repr__(self) -> str:
        return (f"GeneralizedDiceScore(num_classes={self.num_classes}, per_class={self.per_class}, "
                f"weight_type={self.weight_type!r}, input_format={self.input_format!r})")

    def _add(self, inter, psum, tsum, present):
        N, K = tsum.shape
        if N == 0:  # an empty batch (shape: no host read) adds nothing; max over no samples is undefined
            return
        if self.weight_type == "simple":
            w = 1.0 / tsum
        elif self.weight_type == "linear":
            w = torch.ones_like(tsum)
        else:
            w = 1.0 / (tsum * tsum)
        inf = torch.isinf(w)
        w = torch.where(inf, torch.zeros_like(w), w)
        # torchmetrics: w_max = max(w, 0).repeat(N, 1).T.flatten(), indexed like the [N, K] flat
        # weights: entry (n, c) takes the max of class (n·K + c) // N. Over the present samples
        # only (rank r among them, their count M), so masked padding changes nothing; device ops.
        maxes = w.max(0).values
        rank = torch.cumsum(present.to(torch.int64), 0) - 1
        M = present.sum().clamp(min=1)
        flat = rank[:, None] * K + torch.arange(K, device=w.device)[None, :]
        w_max = maxes[torch.div(flat, M, rounding_mode="floor").clamp(0, K - 1)]
        w = torch.where(inf, w_max, w)
        num, den = 2.0 * inter * w, (psum + tsum) * w
        if not self.per_class:
            num, den = num.sum(1), den.sum(1)
        self.score += _safe_divide(num, den, 0.0).sum(0).reshape(-1)
        self.samples += present.sum(dtype=torch.float64).reshape(1)

    def _compute(self, state):
        out = state["score"] / state["samples"]
        return out if self.per_class else out.reshape(())


class MeanIoU(_Segmentation):
    """Mean intersection over union (torchmetrics ``segmentation.MeanIoU``):
    per sample and class ``|P∩T| / |P∪T|``, pairs with an empty union skipped;
    ``per_class=False``: the mean over all kept (sample, class) pairs,
    ``per_class=True``: per class (-1 for a class never present).

    Args:
        num_classes: C (required for ``input_format="index"`` and for
            ``per_class=True``; one-hot inputs must have C channels).
        include_background: keep class 0.
        per_class: per-class values ``[C']`` instead of the mean.
        input_format: ``"one-hot"``, ``"index"`` or ``"mixed"``.
        ignore_index: index-format target value whose pixels are left out
            (not in torchmetrics' MeanIoU; its common segmentation habit,
            e.g. 255 for void).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.MeanIoU(num_classes=3, input_format="index", per_class=True)
        >>> m.update(torch.tensor([[0, 1, 2, 2]]), torch.tensor([[0, 1, 1, 2]]))
        >>> [round(v, 4) for v in m.compute().tolist()]
        [1.0, 0.5, 0.5]
    """

    _name = "MeanIoU"

    def __init__(self, num_classes: int | None = None, include_background: bool = True, per_class: bool = False,
                 input_format: str = "one-hot", ignore_index: int | None = None):
        super().__init__()
        A.check(not (per_class and num_classes is None), self._name, "num_classes",
                "is required with per_class=True: the per-class sums live in a fixed-size packed state allocated at "
                "construction (synced in the group's one all_reduce), so the class count cannot be inferred from the "
                "first batch as torchmetrics does. Pass num_classes=C (per_class=False with one-hot inputs needs none)")
        self._init_common(num_classes, include_background, input_format, required=per_class)
        A.check(isinstance(per_class, bool), self._name, "per_class", f"must be a bool, got {per_class!r}", TypeError)
        A.check_ignore_index(self._name, ignore_index)
        A.check(ignore_index is None or input_format != "one-hot", self._name, "ignore_index",
                "needs index targets (input_format='index' or 'mixed')")
        self.per_class, self.ignore_index = per_class, ignore_index
        K = self._out_classes() if per_class else 1
        self.add_state("score", shape=(K,))
        self.add_state("count", shape=(K,))
        self.add_state("bad", shape=(1,))

    def __repr__(self) -> str:
        return (f"MeanIoU(num_classes={self.num_classes}, per_class={self.per_class}, "
                f"input_format={self.input_format!r}, ignore_index={self.ignore_index})")

    def update(self, preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Adds a batch of samples (``mask`` as for Dice); index-format
        ``[H, W]`` / ``[L]`` inputs are one sample (torchmetrics'
        ``_mean_iou_reshape_args``)."""
        if self.input_format != "one-hot":
            A.check_preds_target(self._label, preds, target)
            preds, target = _one_sample(preds), _one_sample(target)
        super().update(preds, target, mask)

    def _add(self, inter, psum, tsum, present):
        union = psum + tsum - inter
        valid = union > 0
        iou = _safe_divide(inter, union, 0.0) * valid
        if self.per_class:
            self.score += iou.sum(0)
            self.count += valid.sum(0).to(torch.float64)
        else:
            self.score += iou.sum().reshape(1)
            self.count += valid.sum().to(torch.float64).reshape(1)

    def _compute(self, state):
        out = state["score"] / state["count"]
        return out.nan_to_num(-1.0) if self.per_class else out.reshape(())
