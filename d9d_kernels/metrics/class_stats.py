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

import torch

from d9d_kernels import ops
from d9d_kernels.core.statistic import SUM, Slot, either, param, statistic, union
from d9d_kernels.metrics.labelled import BAD, LabelledStatistic
from d9d_kernels.reference import valid_score_rows
from d9d_kernels.metrics.vocab_parallel import add_vocab_class_stats
from d9d_kernels.metrics.linear_logits import LinearLogits, add_linear_class_stats

__all__ = ["ClassStatistic", "RefinedTopKStatistic", "refine_top_k", "score_blocks", "mergeable"]

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


def _top_ks(ks) -> tuple[int, ...]:
    return tuple(sorted({int(k) for k in ks}))


@statistic
class ClassStatistic(LabelledStatistic):
    """Per-class counts of one ``class_stats`` kernel call.

    Args:
        num_classes: C.
        ignore_index: target value whose rows are dropped, or None.
        top_ks: the k's this statistic provides (distinct, ``1 <= k <= C``);
            merged by union.
        confmat: also keep the ``[C, C]`` confusion matrix (merged by ``either``).
        nll: also sum ``logsumexp(s) - s[target]`` (needs score preds; merged by ``either``).
        inputs: update keyword names (preds, target, mask).

    Update inputs: ``preds`` (or a ``LinearLogits``: no kernel call on
    logits, ``linear_logits.add_linear_class_stats`` writes the same slots,
    predicted counts for k = 1 only), ``target``, ``mask`` (names from ``inputs``),
    optionally ``lse`` (Perplexity's given logsumexp) or ``vocab`` (a
    ``vocab_parallel.VocabSplit``: preds are one tp rank's vocabulary shard;
    no kernel call, the shards' combined rows write the same slots).

    Slots: ``stats`` [K, 3, C] (tp, predicted, target per k), ``extras`` [2]
    (valid rows, NLL sum), ``bad`` [2] (labelled.BAD), and optionally
    ``confmat`` [C, C]; all SUM.
    """

    num_classes: int = param(convert=int)
    ignore_index: int | None = None
    top_ks: tuple[int, ...] = param((1,), convert=_top_ks, merge=union)
    confmat: bool = param(False, convert=bool, merge=either)
    nll: bool = param(False, convert=bool, merge=either)

    def slots(self) -> list[Slot]:
        C = self.num_classes
        out = [
            Slot("stats", SUM, (len(self.top_ks), 3, C)),
            Slot("extras", SUM, (2,)),
            BAD,
        ]
        if self.confmat:
            out.append(Slot("confmat", SUM, (C, C)))
        return out

    def update(self, state: dict[str, torch.Tensor], **inputs) -> None:
        preds, target, mask = self.unpack(inputs)
        vocab = inputs.get("vocab")  # a checked VocabSplit: preds are this tp rank's vocabulary shard
        if isinstance(preds, LinearLogits):  # hidden states: one pass over the vocabulary, no logits
            add_linear_class_stats(state, preds, target, mask, self.ignore_index, self.top_ks, nll=self.nll,
                                   confmat=self.confmat, lse=inputs.get("lse"), split=vocab)
            return
        if vocab is not None:
            add_vocab_class_stats(state, preds, target, mask, vocab, self.ignore_index, self.top_ks, nll=self.nll,
                                  confmat=self.confmat, lse=inputs.get("lse"))
            return
        if preds.is_floating_point() and preds.dim() == target.dim():
            # floating class indices (same shape as target): non-whole values are counted as bad
            preds = ops.as_index(preds)
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
        if lse is not None:  # after the kernel: its checks run first
            from d9d_kernels.metrics.text import add_lse_nll

            add_lse_nll(state, preds, target, mask, lse, self.ignore_index, count_rows=False)

    def _direct(self, sample: dict) -> bool:
        """Whether ``sample`` needs no reshaping: scores ``[N, C]`` or int64
        indices ``[N]``, int64 target ``[N]``, no mask or a bool ``[N]`` one."""
        preds, target, mask = self.unpack(sample)
        if isinstance(preds, LinearLogits):
            return False
        n = target.shape
        return (
            target.dtype == torch.int64
            and len(n) == 1
            and (preds.shape == (n[0], self.num_classes) and preds.dtype in ops.FLOATS
                 or preds.shape == n and preds.dtype == torch.int64)
            and (mask is None or (mask.dtype == torch.bool and mask.shape == n))
            and "lse" not in sample
            and "vocab" not in sample
        )

    def view(self, state: dict[str, torch.Tensor], need: "ClassStatistic") -> dict[str, torch.Tensor]:
        """``need``'s own layout: ``stats`` [len(need.top_ks), 3, C] etc.
        (``counts`` names them)."""
        out = super().view(state, need)
        idx = [self.top_ks.index(k) for k in need.top_ks]
        if idx == list(range(idx[0], idx[0] + len(idx))):
            out["stats"] = state["stats"][idx[0] : idx[0] + len(idx)]
        else:
            out["stats"] = state["stats"][idx]
        return out

    @staticmethod
    def counts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A member's state (``states[name]`` in ``_compute``) by name, as
        views: ``tp``, ``predicted``, ``actual`` ``[k, C]`` (true positives,
        rows predicted as the class, rows whose target is the class, per
        top-k of the member), ``rows`` (valid rows), ``nll_sum``
        (Σ logsumexp(s) − s[target], with ``nll``)."""
        st = state["stats"]
        return {"tp": st[:, 0], "predicted": st[:, 1], "actual": st[:, 2], "rows": state["extras"][0],
                "nll_sum": state["extras"][1]}


def refine_top_k(scores: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    """torchmetrics' one prediction per row under ``top_k=k`` (its
    ``_refine_preds_oh``), as scores ``[..., C]`` whose top-1 is that
    prediction: a valid row whose target ranks in its top ``k`` (ties: lower
    index first, as ``class_stats``) becomes the target's one-hot; every other
    row is kept as it is, so its top-1 is the prediction and its NaN/Inf or
    out-of-range target is still counted as bad by ``class_stats``."""
    C = scores.shape[-1]
    t = target.to(torch.int64).clamp(0, C - 1).unsqueeze(-1)
    s_t = scores.gather(-1, t)
    ahead = (scores > s_t) | ((scores == s_t) & (torch.arange(C, device=scores.device) < t))
    hit = (ahead.sum(-1) < k) & valid_score_rows(scores)
    one_hot = torch.zeros_like(scores).scatter_(-1, t, 1.0)
    return torch.where(hit.unsqueeze(-1), one_hot, scores)


@statistic
class RefinedTopKStatistic(ClassStatistic):
    """``ClassStatistic`` (``top_ks=(1,)``) of ``refine_top_k``'s predictions:
    the per-class counts torchmetrics derives ``top_k > 1`` specificity from
    (one prediction per row, so ``tn`` is exact). Score preds only; a torch
    pass over the scores before the kernel, so never the raw op."""

    k: int = param(1, convert=int)

    def update(self, state: dict[str, torch.Tensor], **inputs) -> None:
        preds, target, _ = self.unpack(inputs)
        super().update(state, **{**inputs, self.inputs[0]: refine_top_k(preds, target, self.k)})

    def _direct(self, sample: dict) -> bool:
        return False
