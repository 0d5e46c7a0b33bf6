"""Triton class_stats: multiclass tp / predicted / target counts, confmat, NLL.

Two kernels:

* ``_index_kernel`` (preds are class indices ``[N]``): elementwise, one
  ``tl.atomic_add`` per row and slot.
* ``_scores_kernel`` (preds are scores ``[N, C]``): one program per
  ``BLOCK_N`` rows reads each row once, in ``BLOCK_C`` tiles, and carries per
  row: the top-``KMAX`` (value, index) pairs in rank order, the
  count of NaN/+Inf scores (a row of them, or of only -Inf, is bad; -Inf is a
  masked logit, ranked last) and, for the NLL, an online log-sum-exp (running max and
  rescaled sum of exp; no softmax tensor). Ranks follow the reference's total
  order: j ranks ahead of i iff ``s_j > s_i or (s_j == s_i and j < i)``; the
  top-k merge picks, ``KMAX`` times, the best (tile + carried) candidate
  strictly behind the previous pick, so ties go to the lower index and
  ``argmax`` is pick 0. Counts then go to ``stats`` / ``confmat`` with
  per-row atomics (per k: target slot, the k predicted slots, the hit).

Bad rows go to ``bad`` [2] by cause, the target judged first: ``bad[0]``
rows whose target (or index pred) is outside ``[0, C)``, ``bad[1]`` the
other bad rows (their scores).

Cost per tile is O(KMAX * (BLOCK_C + KP)): meant for small k (top-1/5/10).
``top_ks`` is a constexpr tuple (no per-call device tensor, so no host sync
and nothing allocated: the launch is graph-capturable); scores compare in
float32 unless they are float64; the log-sum-exp sums ``exp2`` terms per
tile in that type and folds them into float64; every atomic is relaxed.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from d9d_kernels.triton._common import (
    BLOCK, INTERPRETED, MAX_PROGRAMS, TILE, add_histogram, as_u8, finite, launch, pow2, programs, register,
    rows_kept,
)

#: index preds: per-program histograms of the counts up to this many classes
#: (and of the confusion matrix up to this many cells)
INDEX_BINS = 1024


@triton.jit
def _index_kernel(p_ptr, t_ptr, m_ptr, stats_ptr, confmat_ptr, extras_ptr, bad_ptr, n, C, ignore,
                  HAS_M: tl.constexpr, HAS_IGNORE: tl.constexpr, HAS_CONFMAT: tl.constexpr, BLOCK: tl.constexpr,
                  NB: tl.constexpr, CM_NB: tl.constexpr):
    # Grid-stride over row tiles. NB > 0 (C <= NB): the class counts go to
    # per-program histograms and the state gets one atomic per bin at the end,
    # so few classes do not put every row's atomic on the same few addresses;
    # CM_NB > 0 does the same for the confusion matrix (C * C <= CM_NB).
    n_ok = tl.zeros([BLOCK], tl.float64)
    n_bad = tl.zeros([BLOCK], tl.float64)
    if NB > 0:
        h_tp = tl.zeros([NB], tl.int32)
        h_p = tl.zeros([NB], tl.int32)
        h_t = tl.zeros([NB], tl.int32)
    if CM_NB > 0:
        h_cm = tl.zeros([CM_NB], tl.int32)
    for start in range(tl.program_id(0).to(tl.int64) * BLOCK, n, tl.num_programs(0) * BLOCK):
        rows = start + tl.arange(0, BLOCK)
        t, keep, t_in = rows_kept(t_ptr, m_ptr, rows, n, C, ignore, HAS_M, HAS_IGNORE)
        p = tl.load(p_ptr + rows, mask=rows < n, other=0)
        ok = keep & t_in & (p >= 0) & (p < C)
        # an index pred out of range is a label mistake too: every bad row goes to
        # bad[0] (target cause); index preds have no NaN/Inf, so bad[1] gets nothing
        n_bad += (keep & ~ok).to(tl.float64)
        n_ok += ok.to(tl.float64)
        ti = tl.where(ok, t, 0)
        pi = tl.where(ok, p, 0)
        if NB > 0:  # histogram bins are int32 (the kept classes are < C <= NB)
            h_tp += tl.histogram(ti.to(tl.int32), NB, mask=ok & (p == t))
            h_p += tl.histogram(pi.to(tl.int32), NB, mask=ok)
            h_t += tl.histogram(ti.to(tl.int32), NB, mask=ok)
        else:
            tl.atomic_add(stats_ptr + ti, 1.0, mask=ok & (p == t), sem="relaxed")
            tl.atomic_add(stats_ptr + C + pi, 1.0, mask=ok, sem="relaxed")
            tl.atomic_add(stats_ptr + 2 * C + ti, 1.0, mask=ok, sem="relaxed")
        if HAS_CONFMAT:
            if CM_NB > 0:
                h_cm += tl.histogram((ti * C + pi).to(tl.int32), CM_NB, mask=ok)
            else:
                tl.atomic_add(confmat_ptr + ti * C + pi, 1.0, mask=ok, sem="relaxed")
    tl.atomic_add(bad_ptr, tl.sum(n_bad, 0), sem="relaxed")
    tl.atomic_add(extras_ptr, tl.sum(n_ok, 0), sem="relaxed")
    if NB > 0:
        add_histogram(stats_ptr, h_tp, C, NB)
        add_histogram(stats_ptr + C, h_p, C, NB)
        add_histogram(stats_ptr + 2 * C, h_t, C, NB)
    if CM_NB > 0:
        add_histogram(confmat_ptr, h_cm, C * C, CM_NB)


@triton.jit
def _merge_topk(bv, bi, x, cols, KMAX: tl.constexpr, KP: tl.constexpr, BIG: tl.constexpr):
    """Top-KMAX (value, index) of the carried pairs (bv, bi) and the tile (x, cols), in rank order."""
    kcol = tl.arange(0, KP)[None, :]
    nv = tl.full(bv.shape, -float("inf"), bv.dtype)
    ni = tl.full(bi.shape, BIG, tl.int64)
    prev_v = tl.full([bv.shape[0]], float("inf"), bv.dtype)
    prev_i = tl.full([bv.shape[0]], -1, tl.int64)
    for m in range(KMAX):
        # candidates ranked strictly behind the previous pick
        cb = (bv < prev_v[:, None]) | ((bv == prev_v[:, None]) & (bi > prev_i[:, None]))
        ct = (x < prev_v[:, None]) | ((x == prev_v[:, None]) & (cols > prev_i[:, None]))
        v = tl.maximum(tl.max(tl.where(cb, bv, -float("inf")), 1), tl.max(tl.where(ct, x, -float("inf")), 1))
        i = tl.minimum(tl.min(tl.where(cb & (bv == v[:, None]), bi, BIG), 1),
                       tl.min(tl.where(ct & (x == v[:, None]), cols, BIG), 1))
        nv = tl.where(kcol == m, v[:, None], nv)
        ni = tl.where(kcol == m, i[:, None], ni)
        prev_v = v
        prev_i = i
    return nv, ni


@triton.jit
def _scores_kernel(s_ptr, t_ptr, m_ptr, stats_ptr, confmat_ptr, extras_ptr, bad_ptr, n, C, RS, CS, ignore,
                   HAS_M: tl.constexpr, HAS_IGNORE: tl.constexpr, HAS_CONFMAT: tl.constexpr, NLL: tl.constexpr,
                   KS: tl.constexpr, K: tl.constexpr, KMAX: tl.constexpr, KP: tl.constexpr, CT: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    BIG: tl.constexpr = 2**62
    LOG2E: tl.constexpr = 1.4426950408889634
    kcol = tl.arange(0, KP)[None, :]
    n_bad_t = tl.zeros([BLOCK_N], tl.int32)
    n_bad_p = tl.zeros([BLOCK_N], tl.int32)
    n_ok = tl.zeros([BLOCK_N], tl.int32)
    nll_sum = tl.zeros([BLOCK_N], tl.float64)
    # A capped grid: each program walks row tiles, so the scalar counters get
    # one atomic per program, not one per tile.
    for tile in range(tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.num_programs(0)):
        rows = tl.arange(0, BLOCK_N).to(tl.int64) + tile * BLOCK_N
        inb = rows < n
        t, keep, t_in = rows_kept(t_ptr, m_ptr, rows, n, C, ignore, HAS_M, HAS_IGNORE)
        bv = tl.full([BLOCK_N, KP], -float("inf"), CT)
        bi = tl.full([BLOCK_N, KP], BIG, tl.int64)
        n_bad = tl.zeros([BLOCK_N], tl.int32)
        mx = tl.full([BLOCK_N], -float("inf"), CT)
        se = tl.zeros([BLOCK_N], tl.float64)
        for c0 in range(0, C, BLOCK_C):
            cols = (c0 + tl.arange(0, BLOCK_C)).to(tl.int64)[None, :]
            ld = inb[:, None] & (cols < C)
            # compares in CT (float32 for <= 32-bit scores: exact, same order)
            x = tl.load(s_ptr + rows[:, None] * RS + cols * CS, mask=ld, other=0).to(CT)
            n_bad += tl.sum((ld & ~(x < float("inf"))).to(tl.int32), 1)  # NaN, +Inf
            # padding (and a bad row's NaN/+Inf) as -Inf; a real -Inf keeps its lower index
            x = tl.where(ld & finite(x), x, -float("inf"))
            cols = tl.where(ld, cols, BIG)
            bv, bi = _merge_topk(bv, bi, x, cols, KMAX, KP, BIG)
            if NLL:  # online log-sum-exp: tile sums of exp2 in CT, folded into float64
                new_mx = tl.maximum(mx, tl.max(x, 1))
                safe = tl.where(new_mx == -float("inf"), 0.0, new_mx)
                tile_se = tl.sum(tl.exp2((x - safe[:, None]) * LOG2E), 1).to(tl.float64)
                se = se * tl.exp((mx - safe).to(tl.float64)) + tile_se
                mx = new_mx
        ok = keep & t_in & (n_bad == 0) & (tl.max(bv, 1) > -float("inf"))  # not all -Inf
        t = tl.where(ok, t, 0)
        # the target is judged first: a row with a bad target counts there whatever its scores hold
        n_bad_t += (keep & ~t_in).to(tl.int32)
        n_bad_p += (keep & t_in & ~ok).to(tl.int32)
        n_ok += ok.to(tl.int32)
        if NLL:
            s_t = tl.load(s_ptr + rows * RS + t * CS, mask=ok, other=0).to(tl.float64)
            lse = mx.to(tl.float64) + tl.log(tl.where(ok, se, 1.0))
            nll_sum += tl.where(ok, lse - s_t, 0.0)
        bi = tl.where(ok[:, None] & (kcol < KMAX), bi, 0)
        for j in tl.static_range(K):
            top = ok[:, None] & (kcol < KS[j])
            hit = tl.max((top & (bi == t[:, None])).to(tl.int32), 1) > 0
            base = stats_ptr + j * 3 * C
            tl.atomic_add(base + t, 1.0, mask=ok & hit, sem="relaxed")
            tl.atomic_add(base + C + bi, 1.0, mask=top, sem="relaxed")
            tl.atomic_add(base + 2 * C + t, 1.0, mask=ok, sem="relaxed")
        if HAS_CONFMAT:
            argmax = tl.sum(tl.where(kcol == 0, bi, 0), 1)
            tl.atomic_add(confmat_ptr + t * C + argmax, 1.0, mask=ok, sem="relaxed")
    tl.atomic_add(bad_ptr, tl.sum(n_bad_t, 0).to(tl.float64), sem="relaxed")
    tl.atomic_add(bad_ptr + 1, tl.sum(n_bad_p, 0).to(tl.float64), sem="relaxed")
    tl.atomic_add(extras_ptr, tl.sum(n_ok, 0).to(tl.float64), sem="relaxed")
    if NLL:
        tl.atomic_add(extras_ptr + 1, tl.sum(nll_sum, 0), sem="relaxed")


# Compiled Triton tunes the warps per program once per (C, dtype); the state
# pointers are restored after the trial launches, which add into them.
_scores = _scores_kernel if INTERPRETED else triton.autotune(
    configs=[triton.Config({}, num_warps=w) for w in (4, 8, 16, 32)],
    key=["C", "CT", "BLOCK_C"],
    restore_value=["stats_ptr", "confmat_ptr", "extras_ptr", "bad_ptr"],
)(_scores_kernel)


def scores_tiles(C: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_C) of the scores kernel: a program per row for
    vocabulary-sized rows (whole-row tiles, as Liger-Kernel's), else several
    short rows a program."""
    if not INTERPRETED and C >= 2048:
        return 1, min(pow2(C), 4 * TILE)
    block_c = min(pow2(C), max(TILE // 16, 16))
    return max(TILE // block_c, 1), block_c


@register("class_stats_triton", mutates_args=("stats", "confmat", "extras", "bad"))
def _class_stats_op(
    preds: torch.Tensor,
    target: torch.Tensor,
    mask: Optional[torch.Tensor],
    num_classes: int,
    ignore_index: Optional[int],
    top_ks: list[int],
    nll: bool,
    stats: torch.Tensor,
    confmat: Optional[torch.Tensor],
    extras: torch.Tensor,
    bad: torch.Tensor,
) -> None:
    C = num_classes
    target = target.reshape(-1).contiguous()
    n = target.shape[0]
    if n == 0:
        return
    m = as_u8(None if mask is None else mask.reshape(-1), target)
    cm = stats if confmat is None else confmat
    ignore = 0 if ignore_index is None else int(ignore_index)
    common = dict(HAS_M=mask is not None, HAS_IGNORE=ignore_index is not None, HAS_CONFMAT=confmat is not None)
    if not preds.is_floating_point():
        preds = preds.reshape(-1).contiguous()
        nb = pow2(C) if C <= INDEX_BINS else 0
        cm_nb = pow2(C * C) if confmat is not None and C * C <= INDEX_BINS else 0
        launch(_index_kernel)[(programs(n, BLOCK),)](
            preds, target, m, stats, cm, extras, bad, n, C, ignore, BLOCK=BLOCK, NB=nb, CM_NB=cm_nb, **common
        )
        return
    # scores read in place with their strides: class-strided rows (a channel-first
    # [N, C, H, W] sample seen as [H*W, C]) need no contiguous copy; CS == 1
    # (contiguous rows) is specialised by Triton, so those loads stay vectorised
    preds = preds.reshape(n, C)
    rs, cs = preds.stride()
    kmax = max(top_ks, default=1)  # no top_ks (nll only): the argmax still finds bad rows
    block_n, block_c = scores_tiles(C)
    ct = tl.float64 if preds.dtype == torch.float64 else tl.float32
    grid = (min(triton.cdiv(n, block_n), MAX_PROGRAMS * 16),)
    launch(_scores)[grid](
        preds, target, m, stats, cm, extras, bad, n, C, rs, cs, ignore,
        NLL=bool(nll), KS=tuple(top_ks), K=len(top_ks), KMAX=kmax, KP=pow2(kmax), CT=ct,
        BLOCK_N=block_n, BLOCK_C=block_c, **common,
    )


def class_stats(preds, target, mask, num_classes, ignore_index, top_ks, nll, stats, confmat, extras, bad) -> None:
    """Triton launcher with ``reference.class_stats``'s arguments (adds into the state in place)."""
    torch.ops.d9d_kernels.class_stats_triton(
        preds, target, mask, int(num_classes), ignore_index, [int(k) for k in top_ks], bool(nll),
        stats, confmat, extras, bad,
    )
