"""Vocab-parallel (Megatron-style tensor-parallel) logits for the class statistics.

Under tensor parallelism the LM head's logits are split by vocabulary: tp
rank r holds the columns ``[start_r, start_r + size_r)`` of a vocabulary of
size V (uneven splits allowed). ``update(..., vocab=dk.VocabShard(start,
size, tp))`` on ``dk.Perplexity`` and the multiclass classification metrics
(``dk.Accuracy(task="multiclass", top_k=...)`` and the other ``ClassStatistic``
members) takes such a shard:

1. each rank reduces its shard to per-row partials: row max, ``Σ exp(x -
   max)``, the target's logit when the target falls in the shard (else
   ``-inf``), and its local top-k values with GLOBAL indices (k = the largest
   top-k needed; ties broken as ``reference.class_stats``: lower index
   first). On CPU one compiled pass over the shard does it
   (``ops.vocab_partials``); elsewhere, torch ops (``_local_partials``, the
   specification; float32 sums, float64 for float64 logits);
2. ONE ``all_gather`` over the tp context of a ``[N, P]`` float64 buffer of
   these partials per update;
3. every tp rank combines the gathered partials identically (global max,
   logsumexp, target logit, merged top-k) and writes the same state as the
   unsharded update would; on CPU in one compiled call
   (``ops.vocab_class_stats``), elsewhere torch ops (``_combine``, ``_add_rows``) (valid / ignored / bad counts, NaN /
   +Inf / all -Inf rows, ``mask`` and ``ignore_index``, tie rules).

The tp ranks so hold replicas of the state: sync the metric over the data
parallel dims only (``DistributedContext.from_mesh(mesh, dims=("dp",))``),
as for any replicated input, or the tp ranks are counted tp times.

Metadata (rows, shard bounds, logits width) is checked by a small all-gather
on the first update of each ``(tp group, rows, start, size, width)``
signature and cached: every rank gets the same table and raises the same
``ValueError`` for a split that does not tile ``[0, V)`` or for different row
counts. Nothing reads tensor data on the host.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from d9d_kernels.metrics import _args as A
from d9d_kernels.ops.vocab_partials import vocab_class_stats, vocab_partials
from d9d_kernels.reference import add_bad
from d9d_kernels.distributed import DistributedContext, _is_d9d_context, as_context

__all__ = ["VocabShard", "VocabSplit", "resolve", "vocab_gather", "add_vocab_class_stats"]

#: scores reduced at once: bounds the float32 temporary of the exp pass
#: (4 MiB) whatever N is; fewer, larger chunks pay less per-op overhead (bench/bench_lm.py --tp)
CHUNK_SCORES = 1 << 20
#: columns per block of the top-k candidate search (bench/bench_lm.py --tp)
BLOCK = 64
#: index of padding candidates: ranked after every real column of any vocabulary
PAST = 1 << 52
#: signatures whose metadata check is cached (oldest dropped first; every tp
#: rank sees the same sequence of signatures, so the caches agree)
MAX_CACHED = 256


@dataclasses.dataclass(frozen=True)
class VocabShard:
    """This rank's slice of a vocabulary split over a tensor-parallel group.

    Args:
        start: the vocabulary id of the logits' column 0 on this rank.
        size: the number of vocabulary columns held here (``preds.shape[-1]``).
        tp: the tensor-parallel ranks that together hold the vocabulary: a
            ``dk.DistributedContext``, a ``ProcessGroup``, a 1-d ``DeviceMesh``
            (e.g. ``mesh["tp"]``), a d9d ``DistributedContext`` (its regular
            domain's ``"tp"`` dim, not the data dims a metric syncs over) or
            None (the world group).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> shard = dk.VocabShard(0, 4, dk.DistributedContext.local())  # one rank holds all of V = 4
        >>> m = dk.Perplexity()
        >>> m.update(torch.zeros(3, 4), torch.tensor([0, 1, 3]), vocab=shard)
        >>> round(m.compute().item(), 6)
        4.0
    """

    start: int
    size: int
    tp: Any = None

    def __post_init__(self):
        for arg in ("start", "size"):
            v = getattr(self, arg)
            if not isinstance(v, int) or isinstance(v, bool):
                raise TypeError(f"VocabShard: argument '{arg}' must be an int, got {v!r}")
        if self.start < 0:
            raise ValueError(f"VocabShard: argument 'start' must be >= 0, got {self.start}")
        if self.size < 1:
            raise ValueError(f"VocabShard: argument 'size' must be >= 1, got {self.size}")
        tp = self.tp
        if _is_d9d_context(tp):  # the tp dim; as_context(d9d ctx) would be the data dims
            tp = DistributedContext.from_d9d(tp, dims="tp")
        object.__setattr__(self, "_ctx", as_context(tp))

    @property
    def ctx(self) -> DistributedContext:
        """The tp context (``as_context(tp)``)."""
        return self._ctx


@dataclasses.dataclass(frozen=True)
class VocabSplit:
    """A shard checked against the other tp ranks: the statistics' input.

    ``total`` is V (the sum of the sizes), ``rows`` the tokens per rank."""

    ctx: DistributedContext
    start: int
    size: int
    total: int
    rows: int


_checked: dict[tuple, VocabSplit] = {}


def resolve(metric: str, shard, preds: torch.Tensor, target: torch.Tensor,
            num_classes: int | None = None) -> VocabSplit:
    """The checked split of ``shard`` for logits ``preds`` ``[..., size]`` with
    ``target`` ``[...]``: one small all-gather of each rank's (rows, start,
    size, width) on the first call of a signature, then cached. Raises
    ``ValueError`` naming ``metric`` on every tp rank when the shards do not
    tile ``[0, V)``, a rank's logits width is not its size, the rank row
    counts differ, or V is not ``num_classes`` (when given)."""
    split = _resolve(metric, shard, preds, target)
    if num_classes is not None:
        A.check(split.total == num_classes, metric, "vocab",
                f"shards tile a vocabulary of {split.total} but num_classes={num_classes}")
    return split


def _resolve(metric: str, shard, preds: torch.Tensor, target: torch.Tensor) -> VocabSplit:
    if not isinstance(shard, VocabShard):
        raise TypeError(f"{metric}: argument 'vocab' must be a dk.VocabShard, got {type(shard).__name__}")
    ctx = shard.ctx
    rows = target.numel()
    width = preds.shape[-1] if preds.dim() else 0
    key = (ctx.cache_key, rows, shard.start, shard.size, width)
    hit = _checked.get(key)
    if hit is not None:  # the same group: a context built anew each step needs no new check
        return hit if hit.ctx is ctx else dataclasses.replace(hit, ctx=ctx)
    mine = torch.tensor([rows, shard.start, shard.size, width], dtype=torch.float64)
    table = torch.empty(ctx.world_size, 4, dtype=torch.float64)
    ctx.all_gather_into_tensor(table, mine).wait()
    total = _check_table(metric, table.tolist(), ctx.ranks if not ctx.is_local else [0], _tp_hint(shard.tp))
    split = VocabSplit(ctx, shard.start, shard.size, total, rows)
    if len(_checked) >= MAX_CACHED:
        _checked.pop(next(iter(_checked)))
    _checked[key] = split
    return split


def _tp_hint(tp) -> str | None:
    """Why shards that do not tile ``[0, V)`` likely name the wrong ranks: no tp
    given (the world group) or a whole multi-dim mesh; None otherwise."""
    if tp is None:
        return "VocabShard has no tp, so its group is every rank of the world, not the tensor-parallel ranks"
    if getattr(tp, "ndim", 1) > 1 and hasattr(tp, "mesh_dim_names"):
        return (f"VocabShard's tp is a {tp.ndim}-d DeviceMesh {tuple(tp.mesh_dim_names or ())}, so its group is "
                "every rank of that mesh, not the tensor-parallel ranks")
    return None


def _check_table(metric: str, table: list, ranks: list, hint: str | None = None) -> int:
    """V from every rank's ``(rows, start, size, width)``; the same verdict on every rank.
    ``hint`` (``_tp_hint``) leads a tiling error: the shards likely name the wrong ranks."""
    rows = [int(r[0]) for r in table]
    if len(set(rows)) > 1:
        listed = ", ".join(f"rank {g}: {n}" for g, n in zip(ranks, rows))
        raise ValueError(f"{metric}: argument 'preds' has different row counts on the tp ranks ({listed}); every tp "
                         "rank must hold the logits of the same tokens")
    for g, (_, start, size, width) in zip(ranks, table):
        if int(width) != int(size):
            raise ValueError(f"{metric}: argument 'vocab' says size={int(size)} on tp rank {g} but its preds hold "
                             f"{int(width)} vocabulary columns in the last dim")
    spans = sorted((int(start), int(start) + int(size), g) for g, (_, start, size, _) in zip(ranks, table))
    end, prev = 0, None
    for lo, hi, g in spans:
        if lo != end:
            what = f"gap [{end}, {lo})" if lo > end else f"overlap [{lo}, {min(end, hi)})"
            left = f"tp rank {prev[2]} holds [{prev[0]}, {prev[1]})" if prev else "no rank starts at 0"
            detail = (f"shards do not tile the vocabulary [0, V): {what}; {left}, tp rank {g} holds [{lo}, {hi}) (all: "
                      + ", ".join(f"rank {r}: [{a}, {b})" for a, b, r in spans) + ")")
            if hint is not None:
                raise ValueError(f"{metric}: argument 'vocab': {hint}; pass tp=dist_context (d9d's "
                                 f"DistributedContext: its 'tp' dim) or tp=mesh[\"tp\"] to VocabShard ({detail})")
            raise ValueError(f"{metric}: argument 'vocab' {detail}")
        end, prev = hi, (lo, hi, g)
    return end


def _local_partials(x: torch.Tensor, t: torch.Tensor, start: int, kmax: int, sumexp: bool,
                    scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, P]`` float64 partials of one block of rows of a shard ``x`` ``[n, size]``:
    ``max, target logit, (Σ exp(x - max)), kmax values, kmax global indices``.
    ``scratch``: an ``[n, size]`` float32 (float64 for float64 ``x``) buffer
    for the conversion and the exp pass, reused across blocks (a fresh one per
    block costs page faults of the same order as the exp itself)."""
    n, size = x.shape
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32  # exact for bf16 / fp16 / fp32 scores
    P = 2 + int(sumexp) + 2 * kmax
    out = torch.empty(n, P, dtype=torch.float64, device=x.device)
    if scratch is None and (sumexp or x.dtype != acc):
        scratch = torch.empty(n, size, dtype=acc, device=x.device)
    # bf16 / fp16 scores: converted once and reduced in float32 (the copy plus
    # float32 block maxima cost half the bfloat16 block maxima); the exp pass
    # needs them in acc anyway
    xr = x if x.dtype == acc else scratch.copy_(x)
    # block maxima: one read of the shard gives the row max and the blocks the top-k lie in
    L = size // BLOCK * BLOCK
    parts = [xr[:, :L].unflatten(1, (L // BLOCK, BLOCK)).amax(2)] if L else []
    if L < size:
        parts.append(xr[:, L:].amax(1, keepdim=True))
    bmax = (torch.cat(parts, 1) if len(parts) > 1 else parts[0]).to(acc)
    m = bmax.amax(1)  # NaN propagates: such rows are bad after the combine
    out[:, 0] = m
    tl = t - start
    here = (tl >= 0) & (tl < size)
    st = x.gather(1, torch.where(here, tl, 0)[:, None])[:, 0]
    out[:, 1] = torch.where(here, st.to(torch.float64), float("-inf"))
    c = 3 if sumexp else 2
    if kmax:  # before the exp pass, which overwrites scratch
        _local_topk(xr, bmax, kmax, start, out[:, c : c + kmax], out[:, c + kmax :])
    if sumexp:
        ms = torch.where(torch.isfinite(m), m, 0)
        out[:, 2] = torch.sub(xr, ms[:, None], out=scratch).exp_().sum(1)
    return out


def _rank_key(v: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as (float32 ``v`` desc, index ``i`` asc) are: the
    float's bits made monotone (``-0.0`` first turned into ``+0.0``, equal to
    it), the index below them. Distinct keys make ``torch.topk`` exact, and it
    is several times faster than a stable sort of the small candidate rows."""
    b = (v + 0.0).view(torch.int32).to(torch.int64)
    b = torch.where(b < 0, b ^ 0x7FFFFFFF, b)
    return b * (1 << 32) + ((1 << 31) - 1 - i)


def _first(v: torch.Tensor, i: torch.Tensor | None, k: int) -> torch.Tensor:
    """Positions (in each row) of the ``k`` first of ``v`` by (value desc,
    ``i`` asc; ``i`` None: the position), in that order."""
    if i is None:
        i = torch.arange(v.shape[1], device=v.device).expand(v.shape)
    if v.dtype == torch.float32:
        return torch.topk(_rank_key(v, i), k, dim=1).indices
    o = torch.sort(i, dim=1, stable=True).indices  # float64 scores: index order, then a stable sort by value
    return o.gather(1, torch.sort(v.gather(1, o), dim=1, descending=True, stable=True).indices[:, :k])


def _local_topk(x, bmax, kmax, start, vals, idx) -> None:
    """The shard's top ``kmax`` by (value desc, index asc) into ``vals`` /
    ``idx`` (global indices; -inf and a sentinel index past every real column
    where the shard is narrower than kmax).

    Only the kmax best blocks by (block max desc, block index asc) can hold
    them: a block ranked after kmax others has, in each of those, an element
    ranked before any of its own. So the exact ranking looks at ``[n, kmax *
    BLOCK]`` candidates, not the shard (torch.topk leaves ties unspecified)."""
    n, size = x.shape
    kb = min(kmax, bmax.shape[1])
    blocks = _first(bmax, None, kb)
    cand = (blocks[:, :, None] * BLOCK + torch.arange(BLOCK, device=x.device)).reshape(n, kb * BLOCK)
    real = cand < size  # the last block may be short: its padding is -inf past every real column
    cv = torch.where(real, x.gather(1, cand.clamp(max=size - 1)).to(bmax.dtype), float("-inf"))
    kk = min(kmax, size)
    o = _first(cv, cand, kk)
    vals[:, :kk] = cv.gather(1, o)
    idx[:, :kk] = cand.gather(1, o) + start
    if kk < kmax:
        vals[:, kk:] = float("-inf")
        idx[:, kk:] = float(PAST)


def vocab_gather(x: torch.Tensor, t: torch.Tensor, split: VocabSplit, kmax: int, sumexp: bool) -> torch.Tensor:
    """The partials of the shard ``x`` ``[N, size]`` (targets ``t`` ``[N]``) of
    every tp rank, ``[W, N, P]``: this rank's pass and ONE all-gather over the tp context."""
    buf = vocab_partials(x, t, split.start, kmax, sumexp)
    if buf is None:
        buf = _chunked_partials(x, t, split.start, kmax, sumexp)
    g = torch.empty(split.ctx.world_size, *buf.shape, dtype=torch.float64, device=x.device)
    split.ctx.all_gather_into_tensor(g, buf).wait()
    return g


def _chunked_partials(x: torch.Tensor, t: torch.Tensor, start: int, kmax: int, sumexp: bool) -> torch.Tensor:
    """``_local_partials`` of ``x`` in blocks of rows sharing one scratch (where ``ops.vocab_partials`` cannot run)."""
    n = x.shape[0]
    buf = torch.empty(n, 2 + int(sumexp) + 2 * kmax, dtype=torch.float64, device=x.device)
    step = max(1, CHUNK_SCORES // max(1, x.shape[1]))
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    need = sumexp or x.dtype != acc
    scratch = torch.empty(min(step, n), x.shape[1], dtype=acc, device=x.device) if need else None
    for i in range(0, n, step):
        rows = min(step, n - i)
        buf[i : i + rows] = _local_partials(x[i : i + rows], t[i : i + rows], start, kmax, sumexp,
                                            None if scratch is None else scratch[:rows])
    return buf


class VocabRows:
    """The combined per-row results of one vocab-parallel update (identical on every tp rank).

    ``row_max`` float64 [N] (NaN/+Inf/-Inf flag bad rows), ``lse`` float64
    [N] or None, ``target_logit`` float64 [N], ``top`` int64 [N, kmax]
    global indices, best first (ties: lower index first), or None."""

    __slots__ = ("row_max", "lse", "target_logit", "top")

    def __init__(self, row_max, lse, target_logit, top):
        self.row_max, self.lse, self.target_logit, self.top = row_max, lse, target_logit, top


def _combine(g: torch.Tensor, n: int, W: int, kmax: int, sumexp: bool) -> VocabRows:
    """The gathered partials ``g`` ``[W, n, P]`` combined per row with torch
    ops (with ``_add_rows`` the specification of ``ops.vocab_class_stats``, and where it cannot run)."""
    m_r = g[:, :, 0]
    M = m_r.amax(0)
    target_logit = g[:, :, 1].amax(0)  # -inf on every rank but the target's
    lse = None
    c = 2
    if sumexp:
        Ms = torch.where(torch.isfinite(M), M, 0.0)
        lse = Ms + torch.log((g[:, :, 2] * torch.exp(m_r - Ms)).sum(0))
        c = 3
    top = None
    if kmax:
        vals = g[:, :, c : c + kmax].permute(1, 0, 2).reshape(n, W * kmax)
        idx = g[:, :, c + kmax :].permute(1, 0, 2).reshape(n, W * kmax)
        # (value desc, index asc): sort by index, then a stable sort by value
        o = torch.argsort(idx, dim=1, stable=True)
        vals, idx = vals.gather(1, o), idx.gather(1, o)
        o = torch.sort(vals, dim=1, descending=True, stable=True).indices[:, :kmax]
        top = idx.gather(1, o).to(torch.int64)
    return VocabRows(M, lse, target_logit, top)


def add_vocab_class_stats(state: dict, preds: torch.Tensor, target: torch.Tensor, mask, split: VocabSplit,
                          ignore_index, top_ks=(), nll: bool = False, confmat: bool = False,
                          lse: torch.Tensor | None = None, rows_by_lse: bool = False) -> None:
    """``reference.class_stats`` of the unsharded logits, from this rank's
    shard ``preds`` ``[..., size]``: the same slots (``stats`` [K, 3, V] when
    ``top_ks``, ``extras``, ``bad`` [2], ``confmat``), written identically on
    every tp rank.

    ``lse`` (target's shape): the whole vocabulary's per-token logsumexp (the
    loss's); the exp pass is skipped and the NLL is ``lse - s[target]`` over
    the rows with a finite lse, as ``text.add_lse_nll``; ``rows_by_lse``
    (Perplexity without ``num_classes``): those rows are also the valid ones
    (``add_lse_nll(count_rows=True)``), else the scores decide as in the kernel.

    On CPU ``ops.vocab_class_stats`` combines and adds the rows in one call;
    elsewhere ``_combine`` and ``_add_rows`` (torch ops, its specification)."""
    V = split.total
    if split.rows == 0:  # every tp rank has no rows (resolve checked): nothing to gather
        return
    x = preds.reshape(-1, preds.shape[-1])
    t = target.reshape(-1).to(torch.int64)
    kmax = max(max(top_ks, default=0), 1 if confmat else 0)
    sumexp = nll and lse is None
    g = vocab_gather(x, t, split, kmax, sumexp)
    m = None if mask is None else torch.broadcast_to(mask, target.shape).reshape(-1).contiguous()
    l = None if lse is None else lse.reshape(-1).to(torch.float64).contiguous()
    stats = state.get("stats")
    if stats is None:  # an NLL-only statistic: no class counts
        stats = g.new_empty(0, 3, V)
    out = (stats, state["extras"], state["bad"], state.get("confmat") if confmat else None)
    if vocab_class_stats(g, t, m, ignore_index, l, V, top_ks, nll, rows_by_lse and l is not None, *out):
        return
    _add_rows(_combine(g, t.shape[0], g.shape[0], kmax, sumexp), t, m, ignore_index, V, top_ks, nll, l,
              rows_by_lse, *out)


def _add_rows(r: VocabRows, t: torch.Tensor, mask, ignore_index, V: int, top_ks, nll: bool,
              lse: torch.Tensor | None, rows_by_lse: bool, stats, extras, bad, confmat) -> None:
    """The combined rows ``r`` of targets ``t`` ``[N]`` added to the state
    tensors with torch ops (the specification of ``ops.vocab_class_stats``,
    and where it cannot run)."""
    keep = torch.ones_like(t, dtype=torch.bool) if mask is None else mask
    if ignore_index is not None:
        keep = keep & (t != ignore_index)
    preds_ok = torch.isfinite(r.row_max)  # no NaN / +Inf, not all -Inf
    target_ok = (t >= 0) & (t < V)
    if lse is not None:
        l_finite = torch.isfinite(lse)
        lse_ok = keep & target_ok & l_finite
        if rows_by_lse:
            preds_ok = l_finite
    ok = add_bad(bad, keep, target_ok, preds_ok)
    okf = ok.to(torch.float64)
    tgt = torch.where(ok, t, 0)
    e = extras
    e[0] += okf.sum()
    if nll and lse is None:
        e[1] += torch.where(ok, r.lse - r.target_logit, 0.0).sum()
    elif nll:
        e[1] += torch.where(lse_ok, lse - r.target_logit, 0.0).sum()
    if r.top is not None:
        top = torch.where(ok[:, None], r.top, 0)
    n = t.shape[0]
    for i, k in enumerate(top_ks):
        tk = top[:, :k]
        hit = (tk == tgt[:, None]).any(1) & ok
        stats[i, 0].index_add_(0, tgt, hit.to(torch.float64))
        stats[i, 1].index_add_(0, tk.reshape(-1), okf[:, None].expand(n, k).reshape(-1))
        stats[i, 2].index_add_(0, tgt, okf)
    if confmat is not None:
        confmat.view(-1).index_add_(0, tgt * V + top[:, 0], okf)
