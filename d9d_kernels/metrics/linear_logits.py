"""LM metrics from hidden states: ``preds=dk.LinearLogits(hidden, weight)``, the logits never materialised.

Per token t with target y, one pass over the vocabulary (``ops.linear_logits``)
gives the row max and argmax, ``Σ exp(z - max)``, the target logit z_y and
r = #{j : z_j > z_y or (z_j == z_y and j < y)}, the tie rule of
``class_stats`` (torch.argmax / a stable descending sort). From these rows
``add_linear_class_stats`` writes exactly the slots ``class_stats`` would
have written from ``preds=hidden @ weight.T``:

* valid rows, bad rows by cause (target out of range; a NaN / +Inf logit or
  all -Inf: a non-finite row max), the NLL ``max + log Σ - z_y`` (or
  ``lse - z_y`` with the loss's ``lse=``: no exp work);
* for every k of the statistic: the hits ``r < k`` into ``tp[y]`` and the
  support into ``target[y]``; top-1 also ``predicted[argmax]`` and the
  confusion matrix ``[y, argmax]``; top-k > 1 has no per-class predicted
  counts (every logit would be needed), so members reading them reject
  LinearLogits (``unsupported``).

The rows are memoised on the LinearLogits object (``rows``): in a
MetricGroup, a ``ClassStatistic`` and Perplexity's ``NLLStatistic`` fed the
same ``LinearLogits`` and target share one pass.

``vocab=dk.VocabShard(start, size, tp)`` with ``weight`` this rank's shard
``[size, D]`` (tensor-parallel LM head; ``hidden`` the full rows on every tp
rank): the shard holding each target computes its logit, one all-gather
shares it (the rank counts need it on every shard), each rank reduces its
shard, and a second all-gather combines the per-rank rows (max, rescaled
sums, summed counts, first argmax), identical on every tp rank.
"""

from __future__ import annotations

import dataclasses

import torch

from d9d_kernels.metrics import _args as A
from d9d_kernels.ops import FLOATS
from d9d_kernels.reference import add_bad, linear_logits_combine

__all__ = ["LinearLogits", "add_linear_class_stats", "check_linear", "TAKEN_BY"]

#: the metrics (and their arguments) that take LinearLogits, for error messages
TAKEN_BY = ("Perplexity; multiclass Accuracy and Recall (any top_k, any average); with top_k=1 also Precision, "
            "F1Score, FBetaScore, Specificity, JaccardIndex, MatthewsCorrCoef, CohenKappa, ConfusionMatrix "
            "(task='multiclass', multidim_average='global')")


@dataclasses.dataclass(frozen=True, eq=False)
class LinearLogits:
    """The logits ``hidden @ weight.T (+ bias)`` of an LM head, as a ``preds=`` that is never materialised.

    Args:
        hidden: ``[N, D]`` or ``[B, T, D]`` float16 / bfloat16 / float32 /
            float64 (the final hidden states).
        weight: ``[V, D]`` (``lm_head.weight``), hidden's dtype and device;
            with ``vocab=dk.VocabShard(...)``, this tp rank's rows ``[size, D]``.
        bias: ``[V]`` or None.
        softcap: None or > 0: logits ``softcap * tanh(z / softcap)`` (Gemma 2,
            cut-cross-entropy's ``softcap``).

    The logits are those eager PyTorch materialises: ``F.linear(hidden,
    weight, bias)`` in the inputs' dtype (float32 accumulation, rounded to
    the dtype), soft-capped in that dtype. Metrics fed ``preds=LinearLogits(...)``
    give the results of ``preds=`` those logits (same tie rule), up to the
    rounding of the matmul: the target logit is a separate dot product, so a
    logit within a rounding step of the target's may rank differently.
    Taken by ``TAKEN_BY``; every other metric raises ``ValueError``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> hidden, weight = torch.eye(3)[:2], torch.eye(3) * 5
        >>> m = dk.Accuracy(task="multiclass", num_classes=3)
        >>> m.update(dk.LinearLogits(hidden, weight), torch.tensor([0, 2]))
        >>> m.compute().item()
        0.5
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None = None
    softcap: float | None = None

    def __post_init__(self):
        h, w, b = self.hidden, self.weight, self.bias
        for arg, t in (("hidden", h), ("weight", w)):
            if not isinstance(t, torch.Tensor):
                A.fail("LinearLogits", arg, f"must be a torch.Tensor, got {type(t).__name__}", TypeError)
        if h.dtype not in FLOATS:
            A.fail("LinearLogits", "hidden", f"must be floating (f16/bf16/f32/f64), got {h.dtype}", TypeError)
        if h.dim() not in (2, 3):
            A.fail("LinearLogits", "hidden", f"must be [N, D] or [B, T, D], got shape {tuple(h.shape)}")
        if w.dtype != h.dtype:
            A.fail("LinearLogits", "weight", f"must have hidden's dtype {h.dtype}, got {w.dtype}", TypeError)
        if w.dim() != 2 or w.shape[1] != h.shape[-1] or w.shape[0] < 1:
            A.fail("LinearLogits", "weight",
                   f"must be [V, D] with V >= 1 and D = hidden.shape[-1] = {h.shape[-1]}, got shape {tuple(w.shape)}")
        if w.device != h.device:
            A.fail("LinearLogits", "weight", f"must be on hidden's device {h.device}, got {w.device}")
        if b is not None:
            if not isinstance(b, torch.Tensor) or b.dtype != h.dtype:
                A.fail("LinearLogits", "bias", f"must be a tensor of hidden's dtype {h.dtype}, got "
                       f"{getattr(b, 'dtype', type(b).__name__)}", TypeError)
            if tuple(b.shape) != (w.shape[0],) or b.device != h.device:
                A.fail("LinearLogits", "bias", f"must be [V] = [{w.shape[0]}] on {h.device}, got shape "
                       f"{tuple(b.shape)} on {b.device}")
        sc = self.softcap
        if sc is not None:
            if not isinstance(sc, (int, float)) or isinstance(sc, bool) or not sc > 0 or sc == float("inf"):
                A.fail("LinearLogits", "softcap", f"must be None or a finite float > 0, got {sc!r}")
            object.__setattr__(self, "softcap", float(sc))
        object.__setattr__(self, "_memo", None)

    def __repr__(self) -> str:
        return (f"LinearLogits(hidden={tuple(self.hidden.shape)} {self.hidden.dtype}, weight={tuple(self.weight.shape)}"
                f", bias={'None' if self.bias is None else tuple(self.bias.shape)}, softcap={self.softcap})")

    # the logits' metadata, as a tensor's (metric checks, VocabShard's resolve)
    @property
    def shape(self) -> torch.Size:
        """The logits' shape: ``hidden.shape[:-1] + (V,)``."""
        return torch.Size((*self.hidden.shape[:-1], self.weight.shape[0]))

    def dim(self) -> int:
        return self.hidden.dim()

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hidden.dtype

    def rows(self, target: torch.Tensor, sumexp: bool, split=None) -> torch.Tensor:
        """float64 ``[N, 5]`` rows of ``ops.linear_logits`` for the flattened
        ``target`` (global ids), memoised for this target: a pass with the
        sum of exps also serves callers that do not need it. ``split``: a
        checked ``VocabSplit`` (``weight`` is this rank's shard): the combined
        rows of every tp rank."""
        key = (target, _version(target), None if split is None else (split.ctx.cache_key, split.start, split.total))
        memo = self._memo
        if memo is not None and memo[0][0] is target and memo[0][1:] == key[1:] and (memo[1] or not sumexp):
            return memo[2]
        rows = _rows(self, target.reshape(-1), sumexp, split)
        if not torch.compiler.is_compiling():
            # the object lives for one step: holding the target that long keeps its id unambiguous
            object.__setattr__(self, "_memo", (key, sumexp, rows))
        return rows

    def target_logit(self, target: torch.Tensor) -> torch.Tensor:
        """float64 ``[N]``: each row's target logit (-inf where the target is not in ``[0, V)``), no vocabulary pass."""
        from d9d_kernels.ops.linear_logits import target_logits

        h, w = self.hidden.reshape(-1, self.hidden.shape[-1]), self.weight
        return target_logits(h, w, self.bias, target.reshape(-1).to(torch.int64), 0, self.softcap).to(torch.float64)


def _version(t: torch.Tensor):
    """The version counter (None for inference tensors, which have none)."""
    return None if t.is_inference() else t._version


def _rows(ll: LinearLogits, t: torch.Tensor, sumexp: bool, split) -> torch.Tensor:
    from d9d_kernels.ops.linear_logits import linear_logits, target_logits

    h = ll.hidden.reshape(-1, ll.hidden.shape[-1])
    t = t.to(torch.int64)
    if split is None:
        return linear_logits(h, ll.weight, ll.bias, t, softcap=ll.softcap, sumexp=sumexp)
    ctx, W = split.ctx, split.ctx.world_size
    # 1. the target logit from the shard holding it (-inf elsewhere), shared: every shard ranks against it
    mine = target_logits(h, ll.weight, ll.bias, t, split.start, ll.softcap).to(torch.float64)
    g = torch.empty(W, *mine.shape, dtype=torch.float64, device=mine.device)
    ctx.all_gather_into_tensor(g, mine).wait()
    zt = g.amax(0)
    # 2. this shard's rows, then every shard's, combined
    part = linear_logits(h, ll.weight, ll.bias, t, zt, start=split.start, softcap=ll.softcap, sumexp=sumexp)
    g = torch.empty(W, *part.shape, dtype=torch.float64, device=part.device)
    ctx.all_gather_into_tensor(g, part).wait()
    out = torch.empty_like(part)
    linear_logits_combine(g, out)
    return out


def unsupported(metric) -> str | None:
    """Why ``metric`` (a classification metric) cannot take LinearLogits, or None."""
    name = type(metric).__name__
    if metric.task != "multiclass":
        return f"needs task='multiclass' for {name}, got task={metric.task!r}"
    if metric.multidim_average != "global":
        return f"needs multidim_average='global', got {metric.multidim_average!r}"
    if metric.top_k > 1 and not metric._linear_top_k:
        return (f"needs top_k=1 for {name}: its per-class predicted counts of a top-{metric.top_k} need every "
                "logit (Accuracy and Recall take any top_k)")
    return None


def check_linear(metric: str, ll: LinearLogits, target, mask, num_classes: int | None, vocab) -> tuple:
    """Metadata checks of ``preds=ll`` with ``target`` / ``mask``, named after ``metric``."""
    A.check_tensor(metric, "target", target)
    A.check_index_dtype(metric, "target", target)
    lead = tuple(ll.hidden.shape[:-1])
    A.check(tuple(target.shape) == lead, metric, "target",
            f"must have hidden's leading shape {lead} (hidden [N, D] / [B, T, D]), got {tuple(target.shape)}")
    A.check(target.device == ll.device, metric, "target",
            f"must be on hidden's device {ll.device}, got {target.device}")
    A.check_mask(metric, mask, lead)
    if vocab is None and num_classes is not None:
        A.check(ll.weight.shape[0] == num_classes, metric, "preds",
                f"LinearLogits has {ll.weight.shape[0]} vocabulary rows in weight but num_classes={num_classes}")
    return lead


def add_linear_class_stats(state: dict, ll: LinearLogits, target: torch.Tensor, mask, ignore_index, top_ks=(),
                           nll: bool = False, confmat: bool = False, lse: torch.Tensor | None = None,
                           rows_by_lse: bool = False, split=None) -> None:
    """The ``class_stats`` slots of ``preds=hidden @ weight.T`` (module
    docstring) from ``ll``'s rows: ``stats`` [K, 3, V] when ``top_ks``
    (predicted counts for k = 1 only), ``extras``, ``bad``, ``confmat``.
    ``lse`` / ``rows_by_lse`` as ``vocab_parallel.add_vocab_class_stats``."""
    V = split.total if split is not None else ll.weight.shape[0]
    t = target.reshape(-1).to(torch.int64)
    n = t.shape[0]
    if n == 0:
        return
    l = None if lse is None else lse.reshape(-1).to(torch.float64)
    if l is not None and rows_by_lse and not top_ks and not confmat:
        zt = ll.target_logit(t) if split is None else ll.rows(target, False, split)[:, 2]
        M = None  # the given lse decides which rows are valid: no vocabulary pass
    else:
        r = ll.rows(target, nll and l is None, split)  # the caller's target object: the memo key
        M, zt = r[:, 0], r[:, 2]
    keep = torch.ones_like(t, dtype=torch.bool) if mask is None \
        else torch.broadcast_to(mask, target.shape).reshape(-1)
    if ignore_index is not None:
        keep = keep & (t != ignore_index)
    target_ok = (t >= 0) & (t < V)
    if l is not None:
        l_finite = torch.isfinite(l)
        lse_ok = keep & target_ok & l_finite
    preds_ok = l_finite if (l is not None and rows_by_lse) else torch.isfinite(M)
    ok = add_bad(state["bad"], keep, target_ok, preds_ok)
    okf = ok.to(torch.float64)
    e = state["extras"]
    e[0] += okf.sum()
    if nll and l is None:
        lse_r = M + torch.log(torch.where(ok, r[:, 1], 1.0))
        e[1] += torch.where(ok, lse_r - zt, 0.0).sum()
    elif nll:
        e[1] += torch.where(lse_ok, l - zt, 0.0).sum()
    if not top_ks and not confmat:
        return
    tgt = torch.where(ok, t, 0)
    am = torch.where(ok, r[:, 4].to(torch.int64), 0)
    stats = state.get("stats")
    for i, k in enumerate(top_ks):
        # top-1 from the argmax: tp <= predicted per class, as from materialised logits
        hit = ok & ((am == t) if k == 1 else (r[:, 3] < k))
        stats[i, 0].index_add_(0, tgt, hit.to(torch.float64))
        if k == 1:
            stats[i, 1].index_add_(0, am, okf)
        stats[i, 2].index_add_(0, tgt, okf)
    if confmat and state.get("confmat") is not None:
        state["confmat"].view(-1).index_add_(0, tgt * V + am, okf)

