"""ClassStatistic: multiclass sufficient statistics over ``ops.class_stats``.

One kernel call per update gives, for every requested top-k, per-class
``tp / predicted / target`` counts (O(C) memory), the valid-row count and
the summed target NLL; the ``[C, C]`` confusion matrix only when a member
asks for it (MatthewsCorrCoef, CohenKappa, ConfusionMatrix). In a group all
multiclass members on the same inputs, ``num_classes`` and ``ignore_index``
merge into one statistic: the union of their top-k's, confusion matrix if
any wants it, NLL if any wants it (Perplexity).
"""

from __future__ import annotations

from typing import Hashable

import torch

from d9d_kernels import ops
from d9d_kernels.ops._common import as_index
from d9d_kernels.ops._dispatch import FLOATS, pick
from d9d_kernels.reference import valid_score_rows
from d9d_kernels.core.statistic import SUM, Slot, Statistic

__all__ = ["ClassStatistic", "nonfinite_rows", "score_blocks", "mergeable"]

#: Channel-first scores (``[N, C, d1, ...]`` moved to ``[N, d1, ..., C]``, a
#: view) do not flatten to ``[R, C]`` without a copy. A sample of at least
#: SAMPLE_VIEW_SCORES scores goes to the op as its own ``[S, C]`` view (one
#: call, ~14 us, per sample); smaller samples are gathered into blocks of about
#: BLOCK_SCORES scores, each a copy: extra memory stays one block, not the
#: batch. Measured with bench/bench_update.py (segmentation section).
SAMPLE_VIEW_SCORES = 1 << 16
BLOCK_SCORES = 1 << 20


def mergeable(sizes, strides) -> bool:
    """Whether dims of these sizes/strides flatten to one dim as a view."""
    expected = None
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size == 1:
            continue
        if expected is not None and stride != expected:
            return False
        expected = stride * size
    return True


def score_blocks(preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None, num_classes: int):
    """Scores ``[..., C]`` and their ``target`` ``[...]`` as ``[(preds [R, C],
    target [R], mask [R] | None)]``: one block when the leading dims flatten
    as a view, else blocks of whole samples (dim 0) that do."""
    C = num_classes
    if mask is not None:
        mask = torch.broadcast_to(mask, target.shape)
    if mergeable(preds.shape[:-1], preds.stride()[:-1]):
        return [(preds.reshape(-1, C), target.reshape(-1), None if mask is None else mask.reshape(-1))]
    n = preds.shape[0]
    per_sample = max(1, preds[0].numel())
    k = 1 if per_sample >= SAMPLE_VIEW_SCORES else -(-BLOCK_SCORES // per_sample)
    return [
        (preds[i : i + k].reshape(-1, C), target[i : i + k].reshape(-1),
         None if mask is None else mask[i : i + k].reshape(-1))
        for i in range(0, n, k)
    ]


def nonfinite_rows(
    preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None, ignore_index: int | None, row_dims: int,
    class_rows: bool = False,
) -> torch.Tensor:
    """Float64 ``[1]``: rows (the leading ``row_dims`` dims of ``preds``) with a
    NaN/Inf score, among those kept by ``mask`` and ``ignore_index``.

    Separates NaN input from out-of-range targets, which the kernels count in
    one ``bad`` slot, so that ``nan_strategy`` applies to NaN only. With
    ``class_rows`` (class_stats score rows) the kernels' rule applies instead:
    -Inf is a masked logit, a row is non-finite when it holds a NaN or +Inf or
    only -Inf (``reference.valid_score_rows``).
    """
    keep = None if mask is None else torch.broadcast_to(mask, target.shape)
    if ignore_index is not None:
        ig = target != ignore_index
        keep = ig if keep is None else keep & ig
    if class_rows and preds.dim() > row_dims:
        bad = ~valid_score_rows(preds.flatten(row_dims))
    else:
        bad = ~torch.isfinite(preds)
    if bad.dim() > row_dims:
        bad = bad.flatten(row_dims).any(-1)
    if keep is not None:
        bad = bad & keep
    return bad.sum(dtype=torch.float64).reshape(1)


class ClassStatistic(Statistic):
    """Per-class counts of one ``class_stats`` kernel call.

    Args:
        num_classes: C.
        ignore_index: target value whose rows are dropped, or None.
        top_ks: the k's this statistic provides (distinct, ``1 <= k <= C``).
        confmat: also keep the ``[C, C]`` confusion matrix.
        nll: also sum ``logsumexp(s) - s[target]`` (needs score preds).
        count_nonfinite: also count rows with NaN/Inf scores separately
            (``nan_strategy`` "ignore" / "propagate" need to tell them from
            out-of-range targets, which ``bad`` lumps together).
        inputs: update keyword names (preds, target, mask).

    Slots: ``stats`` [K, 3, C] (tp, predicted, target per k), ``extras`` [2]
    (valid rows, NLL sum), ``bad`` [1], and optionally ``confmat`` [C, C],
    ``nonfinite`` [1]; all SUM.
    """

    def __init__(
        self,
        num_classes: int,
        ignore_index: int | None = None,
        top_ks: tuple[int, ...] = (1,),
        confmat: bool = False,
        nll: bool = False,
        count_nonfinite: bool = False,
        inputs: tuple[str, ...] = ("preds", "target", "mask"),
    ):
        self.num_classes = int(num_classes)
        self.ignore_index = ignore_index
        self.top_ks = tuple(sorted(set(int(k) for k in top_ks)))
        self.confmat = bool(confmat)
        self.nll = bool(nll)
        self.count_nonfinite = bool(count_nonfinite)
        self.inputs = tuple(inputs)

    def __repr__(self) -> str:
        return (
            f"ClassStatistic(num_classes={self.num_classes}, ignore_index={self.ignore_index}, "
            f"top_ks={self.top_ks}, confmat={self.confmat}, nll={self.nll}, count_nonfinite={self.count_nonfinite})"
        )

    def merge_key(self) -> Hashable:
        return ("class_stats", self.num_classes, self.ignore_index, self.inputs)

    def merge(self, other: "ClassStatistic") -> "ClassStatistic":
        assert self.merge_key() == other.merge_key()
        return ClassStatistic(
            self.num_classes,
            self.ignore_index,
            self.top_ks + other.top_ks,
            self.confmat or other.confmat,
            self.nll or other.nll,
            self.count_nonfinite or other.count_nonfinite,
            self.inputs,
        )

    def slots(self) -> list[Slot]:
        C = self.num_classes
        out = [
            Slot("stats", SUM, (len(self.top_ks), 3, C)),
            Slot("extras", SUM, (2,)),
            Slot("bad", SUM, (1,)),
        ]
        if self.confmat:
            out.append(Slot("confmat", SUM, (C, C)))
        if self.count_nonfinite:
            out.append(Slot("nonfinite", SUM, (1,)))
        return out

    def update(self, state: dict[str, torch.Tensor], **inputs) -> None:
        p_name, t_name = self.inputs[0], self.inputs[1]
        preds, target = inputs[p_name], inputs[t_name]
        mask = inputs.get(self.inputs[2]) if len(self.inputs) > 2 else None
        if preds.is_floating_point() and preds.dim() == target.dim():
            # floating class indices (same shape as target): non-whole values are counted as bad
            preds = as_index("class_stats", "preds", preds, preds.device)
        lse = inputs.get("lse")  # Perplexity's given logsumexp: no exp pass in the kernel
        if preds.dim() > target.dim() and preds.dim() > 2:
            blocks = score_blocks(preds, target, mask, self.num_classes)
        else:
            blocks = [(preds, target, mask)]
        for p, t, m in blocks:
            ops.class_stats(
                p,
                t,
                m,
                num_classes=self.num_classes,
                stats=state["stats"],
                extras=state["extras"],
                bad=state["bad"],
                confmat=state.get("confmat"),
                ignore_index=self.ignore_index,
                top_ks=self.top_ks,
                nll=self.nll and lse is None,
            )
            if self.count_nonfinite and p.is_floating_point():
                state["nonfinite"].add_(nonfinite_rows(p, t, m, self.ignore_index, t.dim(), class_rows=True))
        if lse is not None:  # after the kernel: its checks run first
            from d9d_kernels.metrics.text import add_lse_nll

            add_lse_nll(state, preds, target, mask, lse, self.ignore_index, count_rows=False)

    def bind(self, sample: dict):
        """The raw ``class_stats`` op when ``sample`` needs no reshaping:
        scores ``[N, C]`` or int64 indices ``[N]``, int64 target ``[N]``, no
        mask or a bool ``[N]`` one, C++/CUDA backend (dk.ops checks: ~8 us)."""
        preds, target = sample[self.inputs[0]], sample[self.inputs[1]]
        mask = sample.get(self.inputs[2]) if len(self.inputs) > 2 else None
        n = target.shape
        direct = (
            target.dtype == torch.int64
            and len(n) == 1
            and (preds.shape == (n[0], self.num_classes) and preds.dtype in FLOATS
                 or preds.shape == n and preds.dtype == torch.int64)
            and (mask is None or (mask.dtype == torch.bool and mask.shape == n))
            and not self.count_nonfinite
            and "lse" not in sample
            and pick("class_stats", preds.device, None) in ("cpp", "cuda")
        )
        if not direct:
            return super().bind(sample)
        op = torch.ops.d9d_kernels.class_stats.default
        p_name, t_name = self.inputs[0], self.inputs[1]
        m_name = self.inputs[2] if len(self.inputs) > 2 else None
        C, ignore, ks, nll = self.num_classes, self.ignore_index, list(self.top_ks), self.nll

        def run(state, inputs):
            op(inputs[p_name], inputs[t_name], inputs.get(m_name), C, ignore, ks, nll,
               state["stats"], state.get("confmat"), state["extras"], state["bad"])

        return run

    def view(self, state: dict[str, torch.Tensor], need: "ClassStatistic") -> dict[str, torch.Tensor]:
        """``need``'s own layout: ``stats`` [len(need.top_ks), 3, C] etc."""
        idx = [self.top_ks.index(k) for k in need.top_ks]
        if idx == list(range(idx[0], idx[0] + len(idx))):
            stats = state["stats"][idx[0] : idx[0] + len(idx)]
        else:
            stats = state["stats"][idx]
        out = {"stats": stats, "extras": state["extras"], "bad": state["bad"]}
        if need.confmat:
            out["confmat"] = state["confmat"]
        if need.count_nonfinite:
            out["nonfinite"] = state["nonfinite"]
        return out
