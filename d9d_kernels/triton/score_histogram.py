"""Triton score_histogram: binned positive / negative score counts per label.

Design: histograms are scattered with per-element relaxed ``tl.atomic_add`` into
``hist`` (float64 ``[2, L, B]``), or, binary / multilabel with 2 * L * B <=
``HIST_BINS``, counted in a per-program ``tl.histogram`` first (one atomic per
bin per program); bin = ``clamp(floor(p * B), 0, B - 1)``
computed in float64 before the integer cast, so +-huge probabilities clamp.

* binary / multilabel (``[N, L]`` 0/1 targets): the 2-D tiles of
  ``binary_stats`` (same ``load_tile``, same ``outside_kernel`` prepass for
  ``INPUT_AUTO``).
* multiclass (``[N]`` class targets, softmax for logits): one program per
  ``BLOCK_N`` rows, looping over the classes in ``BLOCK_C`` tiles twice: first
  the row's finiteness and online softmax max / sum-of-exp, then the bins
  (a row only counts once it is known to be free of NaN/Inf).
  ``INPUT_AUTO`` runs the first loop alone first to set the logits flag.

Both loop over row tiles on at most ``MAX_PROGRAMS`` programs (per label
tile); the flag is a reused buffer, so a call allocates nothing. ``bad`` [2]
gets, by cause, the kept entries (rows when multiclass) with a bad target
(``[0]``) and the other ones with a NaN/Inf pred (``[1]``).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from d9d_kernels.reference import INPUT_AUTO
from d9d_kernels.triton._common import (
    MAX_PROGRAMS, TILE, add_histogram, as_u8, finite, launch, loadable, pow2, register, rows_kept,
)
from d9d_kernels.triton.binary_stats import grid_2d, load_tile, logit_flag, outside_kernel, tile_2d, to_prob

#: binary / multilabel: per-program histograms up to this many [2, L, B] cells
HIST_BINS = 2048


@triton.jit
def _binary_hist_kernel(p_ptr, t_ptr, m_ptr, flag_ptr, hist_ptr, bad_ptr, n, L, B, ignore,
                        KIND: tl.constexpr, HAS_M: tl.constexpr, HAS_IGNORE: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr, NB: tl.constexpr):
    # NB > 0 (one label tile, 2 * L * B <= NB): counts in a per-program
    # histogram, one atomic per bin at the end; else an atomic per entry
    n_bad_t = tl.zeros([BLOCK_L], tl.int64)
    n_bad_p = tl.zeros([BLOCK_L], tl.int64)
    if NB > 0:
        h = tl.zeros([NB], tl.int32)
    for rt in range(tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.num_programs(0)):
        p, t, keep, good_t, ok, cols = load_tile(p_ptr, t_ptr, m_ptr, rt, n, L, ignore, HAS_M, HAS_IGNORE,
                                                 BLOCK_N, BLOCK_L)
        # the target is judged first: a bad target counts there whatever the pred holds
        n_bad_t += tl.sum((keep & ~good_t).to(tl.int64), 0)
        n_bad_p += tl.sum((good_t & ~ok).to(tl.int64), 0)
        prob = tl.where(ok, to_prob(p, flag_ptr, KIND), 0.0)
        b = tl.minimum(tl.maximum(tl.floor(prob * B), 0.0), B - 1.0).to(tl.int64)
        neg = (t != 1).to(tl.int64)
        idx = neg * L * B + cols[None, :].to(tl.int64) * B + b
        if NB > 0:
            flat = tl.reshape(tl.where(ok, idx, 0).to(tl.int32), [BLOCK_N * BLOCK_L])
            h += tl.histogram(flat, NB, mask=tl.reshape(ok, [BLOCK_N * BLOCK_L]))
        else:
            tl.atomic_add(hist_ptr + idx, 1.0, mask=ok, sem="relaxed")
    tl.atomic_add(bad_ptr, tl.sum(n_bad_t, 0).to(tl.float64), sem="relaxed")
    tl.atomic_add(bad_ptr + 1, tl.sum(n_bad_p, 0).to(tl.float64), sem="relaxed")
    if NB > 0:
        add_histogram(hist_ptr, h, 2 * L * B, NB)


@triton.jit
def _row_scan(p_ptr, t_ptr, m_ptr, rt, n, C, ignore, HAS_M: tl.constexpr, HAS_IGNORE: tl.constexpr,
              SOFTMAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    """Per row of row tile ``rt``: target, kept, kept with a target in [0, C), ok (those with
    all preds finite), any pred outside [0, 1], and the softmax max / sum of exp (when SOFTMAX)."""
    rows = tl.arange(0, BLOCK_N).to(tl.int64) + rt * BLOCK_N
    inb = rows < n
    t, keep, t_in = rows_kept(t_ptr, m_ptr, rows, n, C, ignore, HAS_M, HAS_IGNORE)
    n_bad = tl.zeros([BLOCK_N], tl.int32)
    n_out = tl.zeros([BLOCK_N], tl.int32)
    mx = tl.full([BLOCK_N], -float("inf"), tl.float64)
    se = tl.zeros([BLOCK_N], tl.float64)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        ld = inb[:, None] & (cols[None, :] < C)
        x = tl.load(p_ptr + rows[:, None] * C + cols[None, :], mask=ld, other=0).to(tl.float64)
        n_bad += tl.sum((ld & ~finite(x)).to(tl.int32), 1)
        n_out += tl.sum((ld & ((x < 0) | (x > 1))).to(tl.int32), 1)
        if SOFTMAX:
            x = tl.where(ld & finite(x), x, -float("inf"))
            new_mx = tl.maximum(mx, tl.max(x, 1))
            safe = tl.where(new_mx == -float("inf"), 0.0, new_mx)
            se = se * tl.exp(mx - safe) + tl.sum(tl.exp(x - safe[:, None]), 1)
            mx = new_mx
    good_t = keep & t_in
    ok = good_t & (n_bad == 0)
    return rows, t, keep, good_t, ok, n_out > 0, mx, se


@triton.jit
def _multiclass_outside_kernel(p_ptr, t_ptr, m_ptr, flag_ptr, n, C, ignore, HAS_M: tl.constexpr,
                               HAS_IGNORE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    out = tl.zeros([BLOCK_N], tl.int32)
    for rt in range(tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.num_programs(0)):
        rows, t, keep, good_t, ok, outside, mx, se = _row_scan(p_ptr, t_ptr, m_ptr, rt, n, C, ignore, HAS_M,
                                                               HAS_IGNORE, False, BLOCK_N, BLOCK_C)
        out = tl.maximum(out, (ok & outside).to(tl.int32))
    tl.atomic_max(flag_ptr, tl.max(out, 0), sem="relaxed")


@triton.jit
def _multiclass_hist_kernel(p_ptr, t_ptr, m_ptr, flag_ptr, hist_ptr, bad_ptr, n, C, B, ignore,
                            KIND: tl.constexpr, HAS_M: tl.constexpr, HAS_IGNORE: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
    n_bad_t = tl.zeros([BLOCK_N], tl.int64)
    n_bad_p = tl.zeros([BLOCK_N], tl.int64)
    for rt in range(tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.num_programs(0)):
        rows, t, keep, good_t, ok, outside, mx, se = _row_scan(p_ptr, t_ptr, m_ptr, rt, n, C, ignore, HAS_M,
                                                               HAS_IGNORE, KIND != 0, BLOCK_N, BLOCK_C)
        # the target is judged first: a row with a bad target counts there whatever its preds hold
        n_bad_t += (keep & ~good_t).to(tl.int64)
        n_bad_p += (good_t & ~ok).to(tl.int64)
        for c0 in range(0, C, BLOCK_C):
            cols = c0 + tl.arange(0, BLOCK_C)
            use = ok[:, None] & (cols[None, :] < C)
            x = tl.load(p_ptr + rows[:, None] * C + cols[None, :], mask=use, other=0).to(tl.float64)
            if KIND == 1:
                x = tl.exp(x - mx[:, None]) / se[:, None]
            elif KIND == 2:
                x = tl.where(tl.load(flag_ptr) != 0, tl.exp(x - mx[:, None]) / se[:, None], x)
            prob = tl.where(use, x, 0.0)
            b = tl.minimum(tl.maximum(tl.floor(prob * B), 0.0), B - 1.0).to(tl.int64)
            neg = (cols[None, :] != t[:, None]).to(tl.int64)
            idx = neg * C * B + cols[None, :].to(tl.int64) * B + b
            tl.atomic_add(hist_ptr + idx, 1.0, mask=use, sem="relaxed")
    tl.atomic_add(bad_ptr, tl.sum(n_bad_t, 0).to(tl.float64), sem="relaxed")
    tl.atomic_add(bad_ptr + 1, tl.sum(n_bad_p, 0).to(tl.float64), sem="relaxed")


@register("score_histogram_triton", mutates_args=("hist", "bad"))
def _score_histogram_op(
    preds: torch.Tensor,
    target: torch.Tensor,
    mask: Optional[torch.Tensor],
    ignore_index: Optional[int],
    input_kind: int,
    multiclass: bool,
    hist: torch.Tensor,
    bad: torch.Tensor,
) -> None:
    L, B = hist.shape[1], hist.shape[2]
    preds = loadable(preds.reshape(-1, L))
    n = preds.shape[0]
    if n == 0:
        return
    kind = int(input_kind)
    ignore = 0 if ignore_index is None else int(ignore_index)
    common = dict(HAS_M=mask is not None, HAS_IGNORE=ignore_index is not None)
    flag = logit_flag(kind, preds.device, bad)
    if multiclass:
        target = loadable(target.reshape(-1))
        m = as_u8(None if mask is None else mask.reshape(-1), target)
        block_c = min(pow2(L), TILE)
        block_n = max(TILE // block_c, 1)
        grid = (min(triton.cdiv(n, block_n), MAX_PROGRAMS),)
        common.update(BLOCK_N=block_n, BLOCK_C=block_c)
        if kind == INPUT_AUTO:
            launch(_multiclass_outside_kernel)[grid](preds, target, m, flag, n, L, ignore, **common)
        launch(_multiclass_hist_kernel)[grid](preds, target, m, flag, hist, bad, n, L, B, ignore, KIND=kind, **common)
    else:
        target = loadable(target.reshape(-1, L))
        m = as_u8(None if mask is None else mask.reshape(-1, L), target)
        block_n, block_l = tile_2d(L)
        grid = grid_2d(n, L, block_n, block_l)
        common.update(BLOCK_N=block_n, BLOCK_L=block_l)
        if kind == INPUT_AUTO:
            launch(outside_kernel)[grid](preds, target, m, flag, n, L, ignore, **common)
        nb = pow2(2 * L * B) if grid[1] == 1 and 2 * L * B <= HIST_BINS else 0
        launch(_binary_hist_kernel)[grid](preds, target, m, flag, hist, bad, n, L, B, ignore, KIND=kind, NB=nb,
                                          **common)


def score_histogram(preds, target, mask, ignore_index, input_kind, multiclass, hist, bad) -> None:
    """Triton launcher with ``reference.score_histogram``'s arguments (adds into hist in place)."""
    torch.ops.d9d_kernels.score_histogram_triton(
        preds, target, mask, ignore_index, int(input_kind), bool(multiclass), hist, bad
    )
