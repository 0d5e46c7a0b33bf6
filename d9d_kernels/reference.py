"""Pure-PyTorch reference of every d9d_kernels op.

This file is the specification of the ops: the C++ (``csrc/cpu``), CUDA
(``csrc/cuda``) and Triton (``d9d_kernels/triton``) kernels must produce the
same state, bit for bit on counts, to float64 rounding on sums. It is also
the ``"torch"`` backend (used when nothing compiled is available) and the
baseline of ``bench/bench_kernels.py``.

Conventions shared by all ops
-----------------------------
* Every op is *in place*: it adds into float64 state tensors that the caller
  owns (slices of a metric group's packed buffer) and returns nothing.
  float64 keeps counts exact up to 2**53.
* Inputs are flattened by the ``d9d_kernels.ops`` wrappers; the ops see the
  shapes documented below. Floating inputs may be float16, bfloat16, float32
  or float64; they are promoted to float64 before any arithmetic.
* ``mask`` (bool, same leading shape as ``target``/``x`` or ``None``) drops
  elements: a dropped element changes no slot at all.
* Nothing is checked on the host that needs the data: elements that are bad
  (a NaN/Inf value, a class index out of range) are *counted* into the
  ``bad`` counter on the device, and the metric raises at ``compute()``.
  ``bad`` is float64 ``[1]`` where there is one cause (a non-finite value:
  weighted_moments, running_extrema) and ``[2]`` where there are two
  (class_stats, binary_stats, score_histogram): ``[0]`` a bad target (or
  class index), ``[1]`` a NaN/Inf prediction with a good target.
* Nothing here reads tensor data on the host, so the reference also runs
  under ``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import torch

__all__ = [
    "MOMENTS",
    "MOMENTS_SIZE",
    "weighted_moments",
    "class_stats",
    "valid_score_rows",
    "add_bad",
    "binary_stats",
    "score_histogram",
    "running_extrema",
    "expert_histogram",
    "moments_recenter",
    "moments_center",
    "linear_logits",
    "linear_logits_combine",
    "LINEAR_ROWS",
    "INPUT_PROBS",
    "INPUT_LOGITS",
    "INPUT_AUTO",
]

# Slots of the weighted-moments state (float64 [MOMENTS_SIZE]).
# px, py are the pivots (see weighted_moments); sums are about them.
MOMENTS = {
    "w": 0,  # Σ w
    "sx": 1,  # Σ w (x - px)
    "sxx": 2,  # Σ w (x - px)^2
    "sy": 3,  # Σ w (y - py)
    "syy": 4,  # Σ w (y - py)^2
    "sxy": 5,  # Σ w (x - px)(y - py)
    "sae": 6,  # Σ w |x - y|
    "sse": 7,  # Σ w (x - y)^2
    "n": 8,  # Σ 1   (number of valid elements, unweighted)
}
MOMENTS_SIZE = 9

# input_kind of binary_stats / score_histogram
INPUT_PROBS = 0  # preds are probabilities in [0, 1] (or 0/1 integers)
INPUT_LOGITS = 1  # preds are logits: sigmoid (softmax for multiclass) applied
INPUT_AUTO = 2  # logits iff any valid pred of this call lies outside [0, 1]


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def _valid(shape, device, mask):
    if mask is None:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return mask.to(torch.bool)


def weighted_moments(
    x: torch.Tensor,
    y: torch.Tensor | None,
    weights: torch.Tensor | None,
    mask: torch.Tensor | None,
    skip_bad: bool,
    state: torch.Tensor,
    bad: torch.Tensor,
    pivot: torch.Tensor | None = None,
) -> None:
    """One-pass weighted moments of ``x`` (and of ``y`` and ``x - y``).

    Args:
        x: ``[N]`` floating.
        y: ``[N]`` floating or ``None`` (then slots sy..sse are untouched).
        weights: ``[N]`` floating or ``None`` (weight 1).
        mask: ``[N]`` bool or ``None``.
        skip_bad: if True, elements whose x, y or w is NaN/Inf are left out of
            every sum (``nan_strategy="ignore"``); if False they are summed
            (NaN propagates, ``nan_strategy="propagate"``). Either way they
            are counted into ``bad``.
        state: float64 ``[MOMENTS_SIZE]``, slots as in ``MOMENTS``; added to.
        bad: float64 ``[1]``; += number of valid elements with a non-finite
            x, y or w.
        pivot: float64 ``[2]`` = ``(px, py)`` or ``None`` (pivots 0). A NaN
            pivot is *unset*: it is first set to the x (y) of the first valid
            element, in index order, whose x, y and w are all finite; it is
            then left alone. Sums about a pivot near the data keep
            variances exact for data like ``1e6 + noise``.
    """
    x = _f64(x.reshape(-1))
    valid = _valid(x.shape, x.device, mask).reshape(-1)
    w = torch.ones_like(x) if weights is None else _f64(weights.reshape(-1))
    yy = None if y is None else _f64(y.reshape(-1))
    finite = torch.isfinite(x) & torch.isfinite(w)
    if yy is not None:
        finite = finite & torch.isfinite(yy)
    bad.add_((valid & ~finite).sum(dtype=torch.float64).reshape(1))
    use = valid & finite if skip_bad else valid

    if pivot is None:
        px = torch.zeros((), dtype=torch.float64, device=x.device)
        py = torch.zeros((), dtype=torch.float64, device=x.device)
    else:
        good = valid & finite
        # first good element in index order (argmax of bool returns the first True)
        first = torch.argmax(good.to(torch.int8)) if x.numel() > 0 else None
        if first is not None:
            has = good.any()
            new_px = torch.where(torch.isnan(pivot[0]) & has, x.index_select(0, first.reshape(1))[0], pivot[0])
            pivot[0].copy_(new_px)
            if yy is not None:
                new_py = torch.where(torch.isnan(pivot[1]) & has, yy.index_select(0, first.reshape(1))[0], pivot[1])
                pivot[1].copy_(new_py)
        # an unset pivot only occurs when no good element exists; use 0 then
        px = torch.nan_to_num(pivot[0], nan=0.0)
        py = torch.nan_to_num(pivot[1], nan=0.0)

    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    wu = torch.where(use, w, zero)
    dx = torch.where(use, x - px, zero)
    s = torch.zeros(MOMENTS_SIZE, dtype=torch.float64, device=x.device)
    s[0] = wu.sum()
    s[1] = (wu * dx).sum()
    s[2] = (wu * dx * dx).sum()
    if yy is not None:
        dy = torch.where(use, yy - py, zero)
        diff = torch.where(use, x - yy, zero)
        s[3] = (wu * dy).sum()
        s[4] = (wu * dy * dy).sum()
        s[5] = (wu * dx * dy).sum()
        s[6] = (wu * diff.abs()).sum()
        s[7] = (wu * diff * diff).sum()
    s[8] = use.sum(dtype=torch.float64)
    state.add_(s)


def _entries(table: torch.Tensor, n: int) -> torch.Tensor:
    """``[B, n]`` flat indices of each table row's ``n`` values from its offset ``table[:, 0]``."""
    return table[:, :1] + torch.arange(n, device=table.device)


def moments_recenter(sums: torch.Tensor, pivots: torch.Tensor, new_pivots: torch.Tensor, table: torch.Tensor) -> None:
    """Moment sums re-expressed about new pivots, in place (a sync's, a merge's, forward's step).

    Args:
        sums: float64 ``[n]``, a flat buffer holding ``MOMENTS_SIZE`` vectors.
        pivots: float64 ``[p]``, a flat buffer holding their pivots (px, py),
            NaN = unset (the sums are about 0); each entry's is set to its
            new pivot on return.
        new_pivots: float64 ``[p]``, laid out as ``pivots``; NaN = 0.
        table: int64 ``[B, 3]``, one row per entry: the offset of its vector in
            ``sums``, of its pivot in ``pivots`` (and ``new_pivots``), and
            whether its y is data (read by ``moments_center`` only).

    With ``d = old - new`` (pivots as ``torch.nan_to_num`` reads them):
    ``sx' = sx + w dx``, ``sxx' = sxx + (2 dx sx + w dx^2)`` (same for y),
    ``sxy' = sxy + (dx sy + dy sx) + w dx dy``; ``w, sae, sse, n`` unchanged.
    """
    mi, pi = _entries(table, MOMENTS_SIZE), _entries(table[:, 1:], 2)
    m, new = sums[mi], new_pivots[pi]
    d = torch.nan_to_num(pivots[pi], nan=0.0) - torch.nan_to_num(new, nan=0.0)
    w, s = m[:, :1], m[:, 1:4:2]  # s: (sx, sy)
    out = m.clone()
    out[:, 1:4:2] = s + w * d
    out[:, 2:5:2] = m[:, 2:5:2] + (2.0 * d * s + w * d * d)
    out[:, 5] = m[:, 5] + (d[:, 0] * s[:, 1] + d[:, 1] * s[:, 0]) + w[:, 0] * d[:, 0] * d[:, 1]
    sums[mi] = out
    pivots[pi] = new


def moments_center(sums: torch.Tensor, pivots: torch.Tensor, table: torch.Tensor, threshold: float,
                   centre: torch.Tensor, off: torch.Tensor) -> None:
    """The centres moment sums are most precise about, and whether they are off-centre.

    Args:
        sums, pivots, table: as ``moments_recenter``'s (read only).
        threshold: ulps lost to the pivot above which a component is off-centre.
        centre: float64 ``[p]``, laid out as ``pivots``: per entry and
            component (x; y where the table says y is data) the weighted mean
            ``p + d`` (``d = s / w``), written where ``w > 0`` and it is
            finite; left as is elsewhere.
        off: bool ``[1]``: set to True if a written component's sums about
            the pivot lost more than ``threshold`` ulps that sums about the
            mean keep: ``(|d| + |p|) / (|mean| + std)``, and where y is data
            also ``d^2 / (var + (p 2^-40)^2)``; never cleared.
    """
    mi, pi = _entries(table, MOMENTS_SIZE), _entries(table[:, 1:], 2)
    m, p = sums[mi], torch.nan_to_num(pivots[pi], nan=0.0)
    paired = table[:, 2:] != 0
    w = m[:, :1]
    d = m[:, 1:4:2] / w
    var = m[:, 2:5:2] / w - d * d
    var = torch.where(var < 0, 0.0, var)  # cancellation can leave it below 0; NaN stays NaN
    mean = p + d
    lost = (d.abs() + p.abs()) / (mean.abs() + var.sqrt())
    lost = torch.where(paired, torch.maximum(lost, d * d / (var + (p * 2.0**-40) ** 2)), lost)
    keep = (w > 0) & torch.isfinite(mean) & (paired | torch.tensor([True, False], device=sums.device))
    centre[pi] = torch.where(keep, mean, centre[pi])
    off.logical_or_((keep & (lost > threshold)).any().reshape(1))


def valid_score_rows(scores: torch.Tensor) -> torch.Tensor:
    """``[...]`` bool from scores ``[..., C]``: no NaN or +Inf, and not only -Inf.

    -Inf is a masked logit (probability 0, ranked last): language models mask
    vocabulary entries that way, so such rows stay valid.
    """
    return (scores < float("inf")).all(dim=-1) & (scores > float("-inf")).any(dim=-1)


def add_bad(bad: torch.Tensor, keep: torch.Tensor, target_ok: torch.Tensor, preds_ok: torch.Tensor) -> torch.Tensor:
    """Counts the kept entries by cause into ``bad`` [2] and returns the valid ones.

    ``bad[0]`` += kept entries whose target is invalid, ``bad[1]`` += kept
    entries with a valid target and an invalid (NaN/Inf) prediction: the
    target is judged first, so a padding label is reported as such whatever
    its logits hold, and ``nan_strategy`` (which applies to predictions only)
    never hides a bad label.
    """
    t_bad = keep & ~target_ok
    p_bad = keep & target_ok & ~preds_ok
    bad.add_(torch.stack([t_bad.sum(dtype=torch.float64), p_bad.sum(dtype=torch.float64)]))
    return keep & target_ok & preds_ok


def _class_scores_valid(preds, target, valid, num_classes, ignore_index, bad):
    """Valid rows of class_stats; counts the bad ones into ``bad`` [2]."""
    keep = valid.clone()
    if ignore_index is not None:
        keep = keep & (target != ignore_index)
    target_ok = (target >= 0) & (target < num_classes)
    if preds.is_floating_point():
        return add_bad(bad, keep, target_ok, valid_score_rows(preds) if preds.numel() else keep)
    # an index pred out of range is a label mistake as well (counted with the targets)
    return add_bad(bad, keep, target_ok & (preds >= 0) & (preds < num_classes), torch.ones_like(keep))


def class_stats(
    preds: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None,
    num_classes: int,
    ignore_index: int | None,
    top_ks: list[int],
    nll: bool,
    stats: torch.Tensor,
    confmat: torch.Tensor | None,
    extras: torch.Tensor,
    bad: torch.Tensor,
) -> None:
    """Multiclass per-class statistics, optionally from scores in one pass.

    Args:
        preds: class indices ``[N]`` (integer) or scores/logits ``[N, C]``
            (floating, ``C == num_classes``).
        target: ``[N]`` integer class indices.
        mask: ``[N]`` bool or ``None``.
        num_classes: C.
        ignore_index: rows whose target equals it are dropped (not bad).
        top_ks: K distinct values ``1 <= k <= C`` (K = 0 only with nll and
            scores: extras and bad alone); must be ``[1]`` for index
            preds. For scores, class j ranks ahead of class i in a row iff
            ``s_j > s_i`` or ``s_j == s_i and j < i`` (ties: lower index
            first, as ``torch.argmax``); the top-k are the k first.
        nll: if True (scores only), ``extras[1] += Σ logsumexp(s) - s[target]``
            over valid rows (natural log), computed without a softmax tensor.
        stats: float64 ``[K, 3, C]``; for each k in top_ks, added to:
            ``[k, 0, c]`` rows with target c and c in the top-k (true positives),
            ``[k, 1, c]`` rows with c in the top-k (predicted),
            ``[k, 2, c]`` rows with target c.
        confmat: float64 ``[C, C]`` or ``None``; ``confmat[target, argmax] += 1``.
        extras: float64 ``[2]``: ``[0]`` += valid rows, ``[1]`` += NLL sum.
        bad: float64 ``[2]``, rows kept by mask/ignore_index that are left
            out, by cause: ``[0]`` += rows whose target (or index pred) is
            outside ``[0, C)``; ``[1]`` += the other rows whose scores hold a
            NaN or +Inf or are all -Inf (``valid_score_rows``: -Inf alone is
            a masked logit, ranked last; a -Inf target score gives an
            infinite NLL). Bad rows change nothing else.
    """
    C = num_classes
    target = target.reshape(-1).to(torch.int64)
    n = target.shape[0]
    valid = _valid((n,), target.device, mask).reshape(-1)
    scores = preds.is_floating_point()
    preds = preds.reshape(n, C) if scores else preds.reshape(-1).to(torch.int64)
    ok = _class_scores_valid(preds, target, valid, C, ignore_index, bad)
    okf = ok.to(torch.float64)
    tgt = torch.where(ok, target, torch.zeros_like(target))
    one_hot_t = torch.zeros(n, C, dtype=torch.float64, device=target.device)
    one_hot_t.scatter_(1, tgt[:, None], okf[:, None])

    if scores:
        s = _f64(preds)
        kmax = max(top_ks, default=1)
        # stable descending sort: ties keep index order (lower index first)
        order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :kmax]
        argmax = order[:, 0]
    else:
        order = torch.where(ok, preds, torch.zeros_like(preds))[:, None]
        argmax = order[:, 0]

    for i, k in enumerate(top_ks):
        in_top = torch.zeros(n, C, dtype=torch.float64, device=target.device)
        in_top.scatter_(1, order[:, :k], okf[:, None].expand(n, k).contiguous())
        stats[i, 0].add_((in_top * one_hot_t).sum(0))
        stats[i, 1].add_(in_top.sum(0))
        stats[i, 2].add_(one_hot_t.sum(0))

    if confmat is not None:
        am = torch.where(ok, argmax, torch.zeros_like(argmax))
        confmat.view(-1).index_add_(0, tgt * C + am, okf)

    e = torch.zeros(2, dtype=torch.float64, device=target.device)
    e[0] = okf.sum()
    if nll and scores:
        s_ok = torch.where(ok[:, None], s, torch.zeros_like(s))
        lse = torch.logsumexp(s_ok, dim=1)
        st = s_ok.gather(1, tgt[:, None])[:, 0]
        e[1] = torch.where(ok, lse - st, torch.zeros_like(lse)).sum()
    extras.add_(e)


def _to_probs(p: torch.Tensor, keep: torch.Tensor, input_kind: int, softmax_dim: int | None):
    """Probabilities from preds per input_kind. ``keep`` marks valid entries."""
    p = _f64(p)
    if input_kind == INPUT_PROBS:
        return p
    if input_kind == INPUT_AUTO:
        outside = ((p < 0) | (p > 1)) & keep
        is_logit = outside.any()
    else:
        is_logit = torch.ones((), dtype=torch.bool, device=p.device)
    if softmax_dim is None:
        conv = torch.sigmoid(p)
    else:
        conv = torch.softmax(p, dim=softmax_dim)
    return torch.where(is_logit, conv, p)


def binary_stats(
    preds: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None,
    threshold: float,
    ignore_index: int | None,
    input_kind: int,
    state: torch.Tensor,
    bad: torch.Tensor,
) -> None:
    """Per-label confusion counts for binary / multilabel tasks.

    Args:
        preds: ``[N, L]`` floating probabilities/logits, or integer/bool 0/1.
        target: ``[N, L]`` integer/bool/floating, values 0 or 1.
        mask: ``[N, L]`` bool or ``None``.
        threshold: a probability ``p`` is positive iff ``p > threshold``
            (torchmetrics' rule). Logits are compared after the sigmoid.
        ignore_index: entries whose target equals it are dropped (not bad).
        input_kind: ``INPUT_PROBS``, ``INPUT_LOGITS`` or ``INPUT_AUTO`` (logits
            iff any valid pred of this call is outside [0, 1]); integer preds
            are always probabilities.
        state: float64 ``[L, 4]``: per label ``tp, fp, tn, fn``; added to.
        bad: float64 ``[2]``, valid entries left out, by cause: ``[0]`` +=
            entries whose target is not 0/1; ``[1]`` += the other entries
            whose pred is NaN/Inf (after ``input_kind`` inference for
            INPUT_AUTO, an Inf logit counts as bad too). Bad entries change
            nothing else.
    """
    n_lab = state.shape[0]
    preds = preds.reshape(-1, n_lab)
    target = target.reshape(-1, n_lab)
    valid = _valid(target.shape, target.device, mask).reshape(target.shape)
    keep = valid
    if ignore_index is not None:
        keep = keep & (target != ignore_index)
    t = _f64(target)
    p = _f64(preds)
    ok = add_bad(bad, keep, (t == 0) | (t == 1), torch.isfinite(p))
    kind = input_kind if preds.is_floating_point() else INPUT_PROBS
    prob = _to_probs(p, ok, kind, None)
    pos = prob > threshold
    tpos = t == 1
    okf = ok.to(torch.float64)
    s = torch.stack(
        [
            (okf * (pos & tpos)).sum(0),
            (okf * (pos & ~tpos)).sum(0),
            (okf * (~pos & ~tpos)).sum(0),
            (okf * (~pos & tpos)).sum(0),
        ],
        dim=1,
    )
    state.add_(s)


def score_histogram(
    preds: torch.Tensor,
    target: torch.Tensor,
    mask: torch.Tensor | None,
    ignore_index: int | None,
    input_kind: int,
    multiclass: bool,
    hist: torch.Tensor,
    bad: torch.Tensor,
) -> None:
    """Binned score histograms of positives and negatives (AUROC / AP).

    Args:
        preds: ``[N, L]`` floating scores (probabilities or logits).
        target: ``[N, L]`` 0/1 labels, or ``[N]`` class indices when
            ``multiclass`` (label c of a row is positive iff target == c).
        mask: bool ``[N, L]`` (``[N]`` when multiclass) or ``None``.
        ignore_index: entries (rows when multiclass) whose target equals it
            are dropped.
        input_kind: as in ``binary_stats``; for multiclass, logits get a
            softmax over the row instead of a sigmoid.
        multiclass: see above.
        hist: float64 ``[2, L, B]``; ``hist[0, l, b]`` += positives of label l
            whose probability falls in bin b, ``hist[1, l, b]`` += negatives.
            Bin of p is ``clamp(floor(p * B), 0, B - 1)``.
        bad: float64 ``[2]``, valid entries (rows when multiclass) left out,
            by cause: ``[0]`` += those with a target outside {0, 1} (outside
            [0, L) when multiclass); ``[1]`` += the other ones with a NaN/Inf
            pred. Bad entries change nothing else.
    """
    n_lab, n_bins = hist.shape[1], hist.shape[2]
    preds = preds.reshape(-1, n_lab)
    n = preds.shape[0]
    p = _f64(preds)
    if multiclass:
        target = target.reshape(-1).to(torch.int64)
        valid = _valid((n,), target.device, mask).reshape(-1)
        keep = valid if ignore_index is None else valid & (target != ignore_index)
        ok = add_bad(bad, keep, (target >= 0) & (target < n_lab), torch.isfinite(p).all(1) if n else keep)
        prob = _to_probs(p, ok[:, None].expand_as(p), input_kind, 1)
        tgt = torch.where(ok, target, torch.zeros_like(target))
        pos = torch.zeros(n, n_lab, dtype=torch.bool, device=p.device)
        pos.scatter_(1, tgt[:, None], torch.ones(n, 1, dtype=torch.bool, device=p.device))
        okm = ok[:, None].expand(n, n_lab)
    else:
        target = target.reshape(-1, n_lab)
        valid = _valid(target.shape, target.device, mask).reshape(target.shape)
        keep = valid if ignore_index is None else valid & (target != ignore_index)
        t = _f64(target)
        okm = add_bad(bad, keep, (t == 0) | (t == 1), torch.isfinite(p))
        prob = _to_probs(p, okm, input_kind, None)
        pos = t == 1
    b = torch.clamp(torch.floor(torch.nan_to_num(prob) * n_bins), 0, n_bins - 1).to(torch.int64)
    lab = torch.arange(n_lab, device=p.device).expand(n, n_lab)
    idx = (~pos).to(torch.int64) * (n_lab * n_bins) + lab * n_bins + b
    hist.view(-1).index_add_(0, idx.reshape(-1), okm.reshape(-1).to(torch.float64))


def running_extrema(
    x: torch.Tensor,
    mask: torch.Tensor | None,
    skip_bad: bool,
    state: torch.Tensor,
    bad: torch.Tensor,
) -> None:
    """Running maximum and minimum.

    Args:
        x: ``[N]`` floating.
        mask: ``[N]`` bool or ``None``.
        skip_bad: if True, NaN values are left out; if False a NaN makes both
            extrema NaN (``torch.maximum`` semantics). ±Inf are ordinary values
            for max/min but are counted as bad.
        state: float64 ``[2]`` = ``(max, -min)``; both start at ``-inf``; this
            op sets ``state = maximum(state, (max x, -min x))``. The min is
            stored negated so both reduce with one MAX all_reduce.
        bad: float64 ``[1]``; += valid elements that are NaN or ±Inf.
    """
    x = _f64(x.reshape(-1))
    valid = _valid(x.shape, x.device, mask).reshape(-1)
    bad.add_((valid & ~torch.isfinite(x)).sum(dtype=torch.float64).reshape(1))
    use = valid & ~torch.isnan(x) if skip_bad else valid
    ninf = torch.full((), float("-inf"), dtype=torch.float64, device=x.device)
    mx = torch.where(use, x, ninf).amax() if x.numel() else ninf
    mn = torch.where(use, -x, ninf).amax() if x.numel() else ninf
    state.copy_(torch.maximum(state, torch.stack([mx, mn])))


def expert_histogram(
    indices: torch.Tensor,
    layers: list[int],
    probs: torch.Tensor | None,
    load: torch.Tensor,
    gate: torch.Tensor | None,
    bad: torch.Tensor,
) -> None:
    """Per-layer expert histogram of MoE routing decisions (and gate mass).

    Args:
        indices: ``[L', N]`` int32 or int64: row ``i`` holds the expert of each
            routed slot (``N = T * top_k``) of layer ``layers[i]``; ``-1`` is a
            dropped slot (left out, not bad); any other value outside
            ``[0, E)`` is counted in ``bad``.
        layers: ``L'`` layer ids in ``[0, L)`` (host ints: the layers a pipeline
            stage owns); repeats add twice.
        probs: ``[L', T, E]`` floating gate probabilities, or ``None``.
        load: float64 ``[L, E]``; ``load[layers[i], e] +=`` the slots of row
            ``i`` routed to ``e``.
        gate: float64 ``[L, E + 1]`` (needed with ``probs``):
            ``gate[layers[i], e] += Σ_t probs[i, t, e]`` (float64 sums; NaN
            propagates) and ``gate[layers[i], E] += T``.
        bad: float64 ``[1]``; += slots with an expert index outside ``[0, E)``
            other than ``-1``.
    """
    E = load.shape[1]
    if indices.numel():
        idx = indices.to(torch.int64)
        ok = (idx >= 0) & (idx < E)
        bad.add_(((idx != -1) & ~ok).sum(dtype=torch.float64).reshape(1))
        rows = torch.arange(idx.shape[0], device=idx.device)[:, None].expand_as(idx)
        flat = (rows * E + torch.where(ok, idx, 0)).reshape(-1)
        counts = torch.zeros(idx.shape[0] * E, dtype=torch.float64, device=idx.device)
        counts = counts.index_add_(0, flat, ok.reshape(-1).to(torch.float64)).reshape(idx.shape[0], E)
        for i, l in enumerate(layers):
            load[l].add_(counts[i])
    if probs is not None:
        sums = _f64(probs).sum(dim=1)  # [L', E]
        T = probs.shape[1]
        for i, l in enumerate(layers):
            gate[l, :E].add_(sums[i])
            gate[l, E].add_(T)


# Columns of linear_logits' per-row result (float64 [N, LINEAR_ROWS]).
LINEAR_ROWS = 5  # row max, Σ exp(z - max), target logit, entries ahead of the target, argmax


def linear_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    target_logit: torch.Tensor | None,
    start: int,
    softcap: float | None,
    sumexp: bool,
    out: torch.Tensor,
) -> None:
    """Per-row reductions of the logits ``z = hidden @ weight.T (+ bias)`` without keeping them.

    The logits are those eager PyTorch materialises in the inputs' dtype:
    ``z = F.linear(hidden, weight, bias)`` (float32 accumulation for
    16/32-bit inputs, rounded to the dtype), then, with ``softcap``,
    ``z = softcap * tanh(z / softcap)`` in the same dtype. This reference
    materialises them; the kernels do not.

    Args:
        hidden: ``[N, D]`` floating.
        weight: ``[V, D]``, hidden's dtype: the vocabulary columns ``[start,
            start + V)`` (all of them, or a tensor-parallel shard).
        bias: ``[V]`` or ``None``.
        target: ``[N]`` int64 global class ids.
        target_logit: float64 ``[N]`` or ``None``: each row's target logit
            (the tp ranks' combined one, the target may be in another shard);
            ``None``: ``z[target - start]`` where the target is in this shard, else -inf.
        start: the global id of weight's row 0.
        softcap: ``None`` or a float > 0.
        sumexp: compute column 1 (else it is 0: the caller has the logsumexp).
        out: float64 ``[N, LINEAR_ROWS]``, overwritten per row with: ``[0]``
            the row max (NaN if any logit is NaN), ``[1]`` ``Σ exp(z - max)``
            (max taken as 0 when not finite), ``[2]`` the target logit,
            ``[3]`` the number of columns j ranked ahead of the target:
            ``z_j > z_t or (z_j == z_t and j < t)`` (global ids; the target's
            own column never counts), the tie rule of ``class_stats``, so the
            target is in the top-k iff ``[3] < k``; ``[4]`` the global id of
            the first maximum (``torch.max``'s argmax).
    """
    n = target.shape[0]
    V = weight.shape[0]
    z = torch.nn.functional.linear(hidden, weight, bias)
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = _f64(z)
    t = target.reshape(-1).to(torch.int64)
    tl_ = t - start
    here = (tl_ >= 0) & (tl_ < V)
    zt = torch.where(here, z.gather(1, torch.where(here, tl_, 0)[:, None])[:, 0], float("-inf"))
    if target_logit is not None:
        zt = _f64(target_logit.reshape(-1))
    cols = torch.arange(V, device=z.device) + start
    ahead = ((z > zt[:, None]) | ((z == zt[:, None]) & (cols < t[:, None]))) & (cols != t[:, None])
    m = z.amax(1) if V else torch.full((n,), float("-inf"), dtype=torch.float64, device=z.device)
    m = torch.where(torch.isnan(z).any(1), float("nan"), m)
    ms = torch.where(torch.isfinite(m), m, 0.0)
    out[:, 0] = m
    out[:, 1] = torch.exp(z - ms[:, None]).sum(1) if sumexp else 0.0
    out[:, 2] = zt
    out[:, 3] = ahead.sum(1, dtype=torch.float64)
    out[:, 4] = (z.max(1).indices + start).to(torch.float64)


def linear_logits_combine(parts: torch.Tensor, out: torch.Tensor) -> None:
    """Rows ``[S, N, 5]`` of S vocabulary slices (or tp shards) combined into
    ``out`` ``[N, 5]`` (torch ops on the device, no host sync): the max, the
    rescaled sum of exps, the target logit (the max of the slices': -inf
    where a slice does not hold it), the summed counts, the argmax of the
    first slice reaching the max (slices in vocabulary order)."""
    m = parts[:, :, 0]
    M = m.amax(0)
    M = torch.where(torch.isnan(m).any(0), float("nan"), M)
    safe = torch.where(torch.isfinite(M), M, 0.0)
    out[:, 0] = M
    out[:, 1] = (parts[:, :, 1] * torch.exp(m - safe)).sum(0)
    out[:, 2] = parts[:, :, 2].amax(0)
    out[:, 3] = parts[:, :, 3].sum(0)
    first = torch.where(m == M, parts[:, :, 4], float("inf")).amin(0)
    out[:, 4] = torch.where(torch.isfinite(first), first, parts[0, :, 4])
