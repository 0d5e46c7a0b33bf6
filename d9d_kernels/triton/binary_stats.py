"""Triton binary_stats: per-label tp / fp / tn / fn over ``[N, L]``.

Design: a grid of at most ``MAX_PROGRAMS`` x (label tiles) programs; each
loops over ``[BLOCK_N, BLOCK_L]`` row tiles, counts in int64 and adds the 4
per-label counts with one relaxed vector ``tl.atomic_add`` each at the end
(not one atomic per element: with L = 1 every element would hit the same 4
addresses). ``threshold`` travels as the int64 of its float64 bits (a Python
float argument would be rounded to float32 by Triton; a tensor would cost an
allocation and a copy per call). ``bad`` [2] gets, by cause, the kept
entries whose target is not 0/1 (``[0]``) and the other ones whose pred is
NaN/Inf (``[1]``), with one atomic each per program.

``INPUT_AUTO`` needs "any valid pred of the call lies outside [0, 1]" before
anything is counted: ``outside_kernel`` computes it into an int32 flag first
(one extra read of preds/target/mask, like the reference's ``any()``), in a
buffer reused across calls (``_common.scratch``): no allocation, no host sync.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from d9d_kernels.reference import INPUT_AUTO, INPUT_LOGITS
from d9d_kernels.triton._common import (
    MAX_PROGRAMS, TILE, as_u8, f64_bits, finite, from_bits, launch, loadable, pow2, register, scratch, sigmoid,
)


@triton.jit
def load_tile(p_ptr, t_ptr, m_ptr, rt, n, L, ignore, HAS_M: tl.constexpr, HAS_IGNORE: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    """Row tile ``rt``: preds (float64), targets, kept entries, kept with a 0/1 target, and ok
    (those with a finite pred)."""
    rows = tl.arange(0, BLOCK_N).to(tl.int64) + rt * BLOCK_N
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs = rows[:, None] * L + cols[None, :]
    keep = (rows[:, None] < n) & (cols[None, :] < L)
    p = tl.load(p_ptr + offs, mask=keep, other=0).to(tl.float64)
    t = tl.load(t_ptr + offs, mask=keep, other=0)
    if HAS_M:
        keep = keep & (tl.load(m_ptr + offs, mask=keep, other=0) != 0)
    if HAS_IGNORE:
        keep = keep & (t != ignore)
    good_t = keep & ((t == 0) | (t == 1))
    ok = good_t & finite(p)
    return p, t, keep, good_t, ok, cols


@triton.jit
def outside_kernel(p_ptr, t_ptr, m_ptr, flag_ptr, n, L, ignore, HAS_M: tl.constexpr, HAS_IGNORE: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    """flag = 1 if an ok entry's pred lies outside [0, 1] (INPUT_AUTO -> logits)."""
    out = tl.zeros([BLOCK_N, BLOCK_L], tl.int32)
    for rt in range(tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.num_programs(0)):
        p, t, keep, good_t, ok, cols = load_tile(p_ptr, t_ptr, m_ptr, rt, n, L, ignore, HAS_M, HAS_IGNORE,
                                                 BLOCK_N, BLOCK_L)
        out = tl.maximum(out, (ok & ((p < 0) | (p > 1))).to(tl.int32))
    tl.atomic_max(flag_ptr, tl.max(tl.max(out, 1), 0), sem="relaxed")


@triton.jit
def to_prob(p, flag_ptr, KIND: tl.constexpr):
    """Probability per input_kind (0 probs, 1 logits, 2 auto from the flag)."""
    if KIND == 1:
        p = sigmoid(p)
    elif KIND == 2:
        p = tl.where(tl.load(flag_ptr) != 0, sigmoid(p), p)
    return p


@triton.jit
def _binary_stats_kernel(p_ptr, t_ptr, m_ptr, flag_ptr, thr_bits, state_ptr, bad_ptr, n, L, ignore,
                         KIND: tl.constexpr, HAS_M: tl.constexpr, HAS_IGNORE: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr):
    thr = from_bits(thr_bits)
    n_bad_t = tl.zeros([BLOCK_L], tl.int64)
    n_bad_p = tl.zeros([BLOCK_L], tl.int64)
    tp = tl.zeros([BLOCK_L], tl.int64)
    fp = tl.zeros([BLOCK_L], tl.int64)
    tn = tl.zeros([BLOCK_L], tl.int64)
    fn = tl.zeros([BLOCK_L], tl.int64)
    for rt in range(tl.program_id(0), tl.cdiv(n, BLOCK_N), tl.num_programs(0)):
        p, t, keep, good_t, ok, cols = load_tile(p_ptr, t_ptr, m_ptr, rt, n, L, ignore, HAS_M, HAS_IGNORE,
                                                 BLOCK_N, BLOCK_L)
        # the target is judged first: a bad target counts there whatever the pred holds
        n_bad_t += tl.sum((keep & ~good_t).to(tl.int64), 0)
        n_bad_p += tl.sum((good_t & ~ok).to(tl.int64), 0)
        pos = to_prob(p, flag_ptr, KIND) > thr
        tpos = t == 1
        tp += tl.sum((ok & pos & tpos).to(tl.int64), 0)
        fp += tl.sum((ok & pos & ~tpos).to(tl.int64), 0)
        tn += tl.sum((ok & ~pos & ~tpos).to(tl.int64), 0)
        fn += tl.sum((ok & ~pos & tpos).to(tl.int64), 0)
    cols = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    lab = cols < L
    out = state_ptr + cols * 4
    tl.atomic_add(bad_ptr, tl.sum(n_bad_t, 0).to(tl.float64), sem="relaxed")
    tl.atomic_add(bad_ptr + 1, tl.sum(n_bad_p, 0).to(tl.float64), sem="relaxed")
    tl.atomic_add(out + 0, tp.to(tl.float64), mask=lab, sem="relaxed")
    tl.atomic_add(out + 1, fp.to(tl.float64), mask=lab, sem="relaxed")
    tl.atomic_add(out + 2, tn.to(tl.float64), mask=lab, sem="relaxed")
    tl.atomic_add(out + 3, fn.to(tl.float64), mask=lab, sem="relaxed")


def tile_2d(L: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_L) for an [N, L] elementwise kernel."""
    block_l = min(pow2(L), TILE)
    return max(TILE // block_l, 1), block_l


def grid_2d(n: int, L: int, block_n: int, block_l: int) -> tuple[int, int]:
    """Row tiles are looped over by at most MAX_PROGRAMS programs per label tile."""
    return min(triton.cdiv(n, block_n), MAX_PROGRAMS), triton.cdiv(L, block_l)


def logit_flag(kind: int, device: torch.device, stand_in: torch.Tensor) -> torch.Tensor:
    """The zeroed INPUT_AUTO flag (a reused buffer), else a stand-in never read."""
    if kind != INPUT_AUTO:
        return stand_in
    return scratch("logit_flag", (1,), torch.int32, device).zero_()


@register("binary_stats_triton", mutates_args=("state", "bad"))
def _binary_stats_op(
    preds: torch.Tensor,
    target: torch.Tensor,
    mask: Optional[torch.Tensor],
    threshold: float,
    ignore_index: Optional[int],
    input_kind: int,
    state: torch.Tensor,
    bad: torch.Tensor,
) -> None:
    L = state.shape[0]
    kind = input_kind if preds.is_floating_point() else 0
    preds = loadable(preds.reshape(-1, L))
    n = preds.shape[0]
    if n == 0:
        return
    target = loadable(target.reshape(-1, L))
    m = as_u8(None if mask is None else mask.reshape(-1, L), target)
    block_n, block_l = tile_2d(L)
    grid = grid_2d(n, L, block_n, block_l)
    common = dict(HAS_M=mask is not None, HAS_IGNORE=ignore_index is not None, BLOCK_N=block_n, BLOCK_L=block_l)
    ignore = 0 if ignore_index is None else int(ignore_index)
    flag = logit_flag(kind, preds.device, bad)
    if kind == INPUT_AUTO:
        launch(outside_kernel)[grid](preds, target, m, flag, n, L, ignore, **common)
    launch(_binary_stats_kernel)[grid](
        preds, target, m, flag, f64_bits(threshold), state, bad, n, L, ignore, KIND=kind, **common
    )


def binary_stats(preds, target, mask, threshold, ignore_index, input_kind, state, bad) -> None:
    """Triton launcher with ``reference.binary_stats``'s arguments (adds into state in place)."""
    torch.ops.d9d_kernels.binary_stats_triton(
        preds, target, mask, float(threshold), ignore_index, int(input_kind), state, bad
    )


assert INPUT_LOGITS == 1 and INPUT_AUTO == 2  # the KIND constants in to_prob
