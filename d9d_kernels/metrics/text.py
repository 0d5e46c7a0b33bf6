"""Perplexity from logits in one pass (log-sum-exp inside ``class_stats``).

``exp(Σ (logsumexp(s) - s[target]) / valid tokens)``; no log-softmax tensor is
materialised. ``update(..., lse=...)`` takes the per-token logsumexp the
trainer's cross-entropy already computed: the exp pass is skipped (NLL =
``lse - s[target]``), the state and the result are the same. With ``num_classes`` (the vocabulary size) given, Perplexity
uses the same ``ClassStatistic`` as the classification metrics: in a
``MetricGroup`` with ``Accuracy(task="multiclass", num_classes=V)`` (top-1
and top-k) on the same inputs and ``ignore_index``, ONE kernel call per
update serves them all. Without it, Perplexity keeps only ``[2]`` floats of
state and asks the kernel for the NLL alone (no top-k, no per-class counts).
``update(..., vocab=dk.VocabShard(...))`` takes tensor-parallel logits split
by vocabulary (``d9d_kernels.metrics.vocab_parallel``).
"""

from __future__ import annotations

import torch

from d9d_kernels import ops
from d9d_kernels.core.metric import Metric
from d9d_kernels.core.statistic import SUM, Slot, statistic
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.class_stats import ClassStatistic
from d9d_kernels.metrics.labelled import BAD, INPUTS, LabelledStatistic
from d9d_kernels.metrics.linear_logits import LinearLogits, add_linear_class_stats, check_linear
from d9d_kernels.metrics.vocab_parallel import add_vocab_class_stats, resolve
from d9d_kernels.reference import add_bad

__all__ = ["Perplexity"]

LSE = "lse"
VOCAB = "vocab"


def add_lse_nll(state, preds, target, mask, lse, ignore_index, count_rows: bool) -> None:
    """``extras[1] += Σ lse - s[target]`` over the kept rows with a target in
    range and a finite lse (a NaN/+Inf score or an all -Inf row gives a
    non-finite lse: such rows are bad, as in the kernel). ``count_rows``:
    also count the valid and bad rows (the kernel did not)."""
    V = preds.shape[-1]
    x, t, l = preds.reshape(-1, V), target.reshape(-1), lse.reshape(-1)
    keep = torch.ones_like(t, dtype=torch.bool) if mask is None else torch.broadcast_to(mask, target.shape).reshape(-1)
    if ignore_index is not None:
        keep = keep & (t != ignore_index)
    target_ok = (t >= 0) & (t < V)
    if count_rows:
        ok = add_bad(state["bad"], keep, target_ok, torch.isfinite(l))
        state["extras"][0] += ok.sum()
    else:
        ok = keep & target_ok & torch.isfinite(l)
    st = x.gather(1, torch.where(ok, t, 0)[:, None])[:, 0]
    state["extras"][1] += torch.where(ok, l.to(torch.float64) - st.to(torch.float64), 0.0).sum()


_NO_STATS: dict = {}


def _no_stats(V: int, device: torch.device) -> torch.Tensor:
    """The empty ``stats [0, 3, V]`` of an NLL-only call, made once per (V, device)
    (a fresh one while torch.compile traces: a cached tensor must not leak into a graph)."""
    if torch.compiler.is_compiling():
        return torch.empty((0, 3, V), dtype=torch.float64, device=device)
    t = _NO_STATS.get((V, device))
    if t is None:
        t = _NO_STATS[(V, device)] = torch.empty((0, 3, V), dtype=torch.float64, device=device)
    return t


@statistic
class NLLStatistic(LabelledStatistic):
    """Valid tokens + summed NLL of one ``class_stats`` call, for any vocabulary size."""

    ignore_index: int | None = None

    def slots(self) -> list[Slot]:
        return [Slot("extras", SUM, (2,)), BAD]

    def update(self, state, **inputs) -> None:
        preds, target, mask = self.unpack(inputs)
        vocab = inputs.get(VOCAB)
        if isinstance(preds, LinearLogits):  # hidden states: rows of one vocabulary pass (none with lse)
            add_linear_class_stats(state, preds, target, mask, self.ignore_index, nll=True, lse=inputs.get(LSE),
                                   rows_by_lse=True, split=vocab)
            return
        if vocab is not None:  # this tp rank's vocabulary shard: partials, one gather, combined
            add_vocab_class_stats(state, preds, target, mask, vocab, self.ignore_index, nll=True,
                                  lse=inputs.get(LSE), rows_by_lse=True)
            return
        lse = inputs.get(LSE)
        if lse is not None:  # no kernel: the NLL of the given lse, a few [N] ops
            add_lse_nll(state, preds, target, mask, lse, self.ignore_index, count_rows=True)
        else:
            V = preds.shape[-1]
            # no top_ks: the kernel counts only extras and bad; stats [0, 3, V] holds no bytes
            ops.class_stats(preds, target, mask, num_classes=V, stats=_no_stats(V, preds.device),
                            extras=state["extras"], bad=state["bad"], ignore_index=self.ignore_index, top_ks=(), nll=True)


class Perplexity(Metric):
    """Perplexity of a language model (torchmetrics ``Perplexity``).

    Args:
        ignore_index: target value (e.g. padding) whose tokens are left out.
        num_classes: vocabulary size V (optional): lets a group share the
            kernel call with multiclass metrics on the same inputs.
        nan_strategy: as the classification metrics (default ``"error"``:
            NaN/Inf logits and out-of-range targets raise at ``compute()``).

    ``update(preds, target, mask=None, lse=None, vocab=None)``: logits ``[N, V]`` /
    ``[B, T, V]`` (any floating dtype; float64 accumulation), targets ``[N]`` /
    ``[B, T]``. ``lse`` (optional, floating, target's shape): each token's
    ``logsumexp`` of its logits, as the training loss computed it; the update
    then skips its exp pass (top-k/argmax only), same state, same result to
    the precision of the given lse. In a ``MetricGroup``, ``g.update(preds=,
    target=, lse=)`` feeds the members whose update takes ``lse``; the
    Accuracy members sharing Perplexity(num_classes=V)'s kernel call are
    filled by that same call.
    ``vocab`` (optional, ``dk.VocabShard(start, size, tp)``): ``preds`` are
    this tensor-parallel rank's vocabulary columns ``[start, start + size)``
    (``[..., size]``); the tp ranks combine per-row partials with one
    all-gather per update and each keeps the unsharded update's state (sync
    over the dp ranks only; docs/metrics.md, "Vocab-parallel logits").
    ``num_classes``, when given, is the whole vocabulary; ``lse``, when
    given with ``vocab``, is the whole vocabulary's logsumexp (the exp pass
    is skipped on every shard).
    ``preds`` may be ``dk.LinearLogits(hidden, weight)`` (hidden ``[N, D]``
    / ``[B, T, D]``): the logits ``hidden @ weight.T`` are never
    materialised (``d9d_kernels.metrics.linear_logits``); ``lse=`` then skips
    the exp work of that pass (with ``num_classes=None``, the pass itself).
    With no valid token, ``compute()`` returns 0.0.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.Perplexity()
        >>> m.update(torch.zeros(2, 3, 4), torch.tensor([[0, 1, 2], [3, 0, 1]]))
        >>> round(m.compute().item(), 6)   # uniform over 4 tokens
        4.0
    """

    def __init__(self, ignore_index: int | None = None, num_classes: int | None = None, nan_strategy: str = "error"):
        super().__init__(nan_strategy=nan_strategy)
        A.check_ignore_index("Perplexity", ignore_index)
        A.check_int("Perplexity", "num_classes", num_classes, lo=1, optional=True)
        self.ignore_index = ignore_index
        self.num_classes = num_classes

    def _statistics(self):
        if self.num_classes is None:
            return {"nll": NLLStatistic(self.ignore_index, inputs=INPUTS)}
        return {"nll": ClassStatistic(self.num_classes, self.ignore_index, (1,), nll=True, inputs=INPUTS)}

    def update(self, preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None,
               lse: torch.Tensor | None = None, vocab=None) -> None:
        """Adds a batch of logits and target token ids (device-local, no host sync)."""
        if isinstance(preds, LinearLogits):
            self._update_linear(preds, target, mask, lse, vocab)
            return
        A.check_tensor("Perplexity", "preds", preds)
        A.check_tensor("Perplexity", "target", target)
        A.check(preds.is_floating_point(), "Perplexity", "preds", f"must be floating logits, got {preds.dtype}", TypeError)
        A.check(not target.is_floating_point(), "Perplexity", "target", f"must be integer token ids, got {target.dtype}", TypeError)
        ps, ts = tuple(preds.shape), tuple(target.shape)
        A.check(len(ps) in (2, 3) and ps[:-1] == ts, "Perplexity", "preds",
                f"must be logits [N, V] or [B, T, V] with target [N] / [B, T], got preds {ps}, target {ts}")
        A.check(preds.device == target.device, "Perplexity", "target", f"must be on preds' device {preds.device}")
        A.check_mask("Perplexity", mask, ts)
        if lse is not None:
            A.check_tensor("Perplexity", "lse", lse)
            A.check(lse.is_floating_point(), "Perplexity", "lse", f"must be floating, got {lse.dtype}", TypeError)
            A.check(tuple(lse.shape) == ts, "Perplexity", "lse", f"must have target's shape {ts}, got {tuple(lse.shape)}")
            A.check(lse.device == preds.device, "Perplexity", "lse", f"must be on preds' device {preds.device}")
        if vocab is not None:
            split = resolve("Perplexity", vocab, preds, target, self.num_classes)
            kw = dict(preds=preds, target=target, mask=mask, vocab=split)
            self._feed({"nll": kw if lse is None else dict(kw, lse=lse)})
            return
        if self.num_classes is not None:
            A.check(ps[-1] == self.num_classes, "Perplexity", "preds",
                    f"has vocabulary size {ps[-1]} in its last dim but num_classes={self.num_classes}")
        if lse is None:
            self._feed({"nll": dict(preds=preds, target=target, mask=mask)})
            return
        self._feed({"nll": dict(preds=preds, target=target, mask=mask, lse=lse)})

    def _update_linear(self, preds: LinearLogits, target, mask, lse, vocab) -> None:
        """``preds=dk.LinearLogits(hidden, weight)``: the logits are never materialised."""
        ts = check_linear("Perplexity", preds, target, mask, self.num_classes, vocab)
        if lse is not None:
            A.check_tensor("Perplexity", "lse", lse)
            A.check(lse.is_floating_point(), "Perplexity", "lse", f"must be floating, got {lse.dtype}", TypeError)
            A.check(tuple(lse.shape) == ts, "Perplexity", "lse", f"must have target's shape {ts}, got {tuple(lse.shape)}")
            A.check(lse.device == preds.device, "Perplexity", "lse", f"must be on preds' device {preds.device}")
        kw = dict(preds=preds, target=target, mask=mask)
        if vocab is not None:
            kw["vocab"] = resolve("Perplexity", vocab, preds, target, self.num_classes)
        if lse is not None:
            kw["lse"] = lse
        self._feed({"nll": kw})

    def _raise_on_bad(self) -> bool:
        return True

    def _bad_message(self, count) -> str:
        return A.bad_message(self._label, count, self.nan_strategy)

    def _compute(self, states):
        s = states["nll"]
        n, nll = s["extras"][0], s["extras"][1]
        value = torch.where(n > 0, torch.exp(nll / torch.where(n > 0, n, torch.ones_like(n))), torch.zeros_like(n))
        if self.nan_strategy == "propagate":
            value = torch.where(s["bad"][1] > 0, torch.full_like(value, float("nan")), value)
        return value
