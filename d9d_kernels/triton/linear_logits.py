"""Triton linear_logits: per-row reductions of ``hidden @ weight.T`` in the matmul's epilogue.

A program owns ``BLOCK_N`` rows and one slice of the vocabulary (``SPLIT``
slices when the row blocks alone would not fill the GPU). Per ``BLOCK_V``
tile it accumulates ``tl.dot`` over ``BLOCK_D`` steps of D in float32
(``input_precision="ieee"`` for float32: no TF32, as torch.mm by default),
adds the bias, rounds to the inputs' dtype (what ``torch.mm`` stores), applies
the soft-cap (rounded after each op, as eager torch in that dtype; tanh as
``1 - 2 / (exp(2x) + 1)``), and folds the tile into per-row registers: max
and first argmax (``tl.max(..., return_indices_tie_break_left=True)``), a
NaN flag, the online log-sum-exp (tile sums of ``exp2`` in float32 folded
into float64) and the count of columns ranked ahead of the target
(``z_j > z_t`` or ``z_j == z_t and j < t``, the target's own column
excluded). The target logit comes first, from the gathered weight rows
(an elementwise dot in float32, rounded likewise), or is given (tensor
parallelism). Nothing is materialised but the ``[SPLIT, N, 5]`` partials;
slices are combined with torch ops on the device (``combine``). No atomics,
no host sync: the launch is graph-capturable.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from d9d_kernels.reference import linear_logits_combine as combine
from d9d_kernels.triton._common import INTERPRETED, launch, pow2, register, scratch

#: programs in flight that keep an H100 busy (132 SMs, a few programs each)
TARGET_PROGRAMS = 264


@triton.jit
def _round(x, DT: tl.constexpr):
    """x (float32) rounded to the inputs' dtype and back (to nearest even).
    bfloat16 by its bits: the interpreter's conversion truncates."""
    if DT == tl.bfloat16:
        b = x.to(tl.int32, bitcast=True)
        b = (b + (0x7FFF + ((b >> 16) & 1))) & -65536
        return b.to(tl.float32, bitcast=True)
    elif DT == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    return x


@triton.jit
def _cap(z, softcap, SOFTCAP: tl.constexpr, DT: tl.constexpr):
    if SOFTCAP:
        u = _round(z / softcap, DT)
        th = _round(1.0 - 2.0 / (tl.exp(2.0 * u) + 1.0), DT)
        z = _round(th * softcap, DT)
    return z


@triton.jit
def _linear_logits_kernel(h_ptr, w_ptr, b_ptr, t_ptr, zt_ptr, out_ptr, N, V, D, start, span, softcap,
                          HAS_B: tl.constexpr, HAS_ZT: tl.constexpr, SOFTCAP: tl.constexpr, SUMEXP: tl.constexpr,
                          DT: tl.constexpr, PREC: tl.constexpr, UPCAST: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr):
    LOG2E: tl.constexpr = 1.4426950408889634
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    t = tl.load(t_ptr + rows, mask=rmask, other=0)
    tloc = t - start
    here = rmask & (tloc >= 0) & (tloc < V)
    tidx = tl.where(here, tloc, 0)
    dr = tl.arange(0, BLOCK_D)
    if HAS_ZT:
        zt = tl.load(zt_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    else:
        acc_t = tl.zeros([BLOCK_N], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + dr
            dm = d < D
            hv = tl.load(h_ptr + rows[:, None] * D + d[None, :], mask=rmask[:, None] & dm[None, :], other=0.0)
            wv = tl.load(w_ptr + tidx[:, None] * D + d[None, :], mask=here[:, None] & dm[None, :], other=0.0)
            acc_t += tl.sum(hv.to(tl.float32) * wv.to(tl.float32), 1)
        if HAS_B:
            acc_t += tl.load(b_ptr + tidx, mask=here, other=0.0).to(tl.float32)
        zt = _cap(_round(acc_t, DT), softcap, SOFTCAP, DT)
        zt = tl.where(here, zt, -float("inf"))
    m = tl.full([BLOCK_N], -float("inf"), tl.float32)
    am = tl.zeros([BLOCK_N], tl.int64)
    nan = tl.zeros([BLOCK_N], tl.int32)
    se = tl.zeros([BLOCK_N], tl.float64)
    cnt = tl.zeros([BLOCK_N], tl.int32)
    v_lo = split.to(tl.int64) * span
    v_hi = tl.minimum(v_lo + span, V)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        cm = cols < v_hi
        acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + dr
            dm = d < D
            hv = tl.load(h_ptr + rows[:, None] * D + d[None, :], mask=rmask[:, None] & dm[None, :], other=0.0)
            wv = tl.load(w_ptr + cols[None, :] * D + d[:, None], mask=cm[None, :] & dm[:, None], other=0.0)
            if UPCAST:  # the interpreter's tl.dot mishandles 16-bit inputs: exact float32 copies
                hv = hv.to(tl.float32)
                wv = wv.to(tl.float32)
            acc = tl.dot(hv, wv, acc, input_precision=PREC)
        if HAS_B:
            acc += tl.load(b_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
        z = _cap(_round(acc, DT), softcap, SOFTCAP, DT)
        nan += tl.sum(((z != z) & cm[None, :]).to(tl.int32), 1)
        z = tl.where(cm[None, :], z, -float("inf"))
        zc = tl.where(z != z, -float("inf"), z)  # NaN flagged apart: the max / argmax of the rest
        tm, ti = tl.max(zc, 1, return_indices=True, return_indices_tie_break_left=True)
        am = tl.where(tm > m, ti.to(tl.int64) + v0, am)  # strict: an earlier tile keeps a tie
        new_m = tl.maximum(m, tm)
        if SUMEXP:
            safe = tl.where((new_m > -float("inf")) & (new_m < float("inf")), new_m, 0.0)
            tile = tl.sum(tl.exp2((zc - safe[:, None]) * LOG2E), 1).to(tl.float64)
            se = se * tl.exp((m - safe).to(tl.float64)) + tile
        m = new_m
        c2 = cols[None, :]
        t2 = tloc[:, None]
        ahead = (z > zt[:, None]) | ((z == zt[:, None]) & (c2 < t2))
        cnt += tl.sum((ahead & (c2 != t2) & cm[None, :]).to(tl.int32), 1)
    m = tl.where(nan > 0, float("nan"), m)
    o = out_ptr + (split.to(tl.int64) * N + rows) * 5
    tl.store(o, m.to(tl.float64), mask=rmask)
    tl.store(o + 1, se, mask=rmask)
    tl.store(o + 2, zt.to(tl.float64), mask=rmask)
    tl.store(o + 3, cnt.to(tl.float64), mask=rmask)
    tl.store(o + 4, (am + start).to(tl.float64), mask=rmask)


# Compiled Triton tunes the tiles once per (D, dtype): the kernel only
# overwrites its partials, so the trial launches need no state restore.
_kernel = _linear_logits_kernel if INTERPRETED else triton.autotune(
    configs=[
        triton.Config({"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_D": 64}, num_warps=4, num_stages=3),
        triton.Config({"BLOCK_N": 128, "BLOCK_V": 128, "BLOCK_D": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 64, "BLOCK_V": 256, "BLOCK_D": 64}, num_warps=8, num_stages=3),
        triton.Config({"BLOCK_N": 128, "BLOCK_V": 64, "BLOCK_D": 64}, num_warps=4, num_stages=4),
    ],
    key=["D", "DT", "HAS_ZT", "SUMEXP"],
)(_linear_logits_kernel)

#: compiled launches split the vocabulary for this BLOCK_N (the smallest of
#: the configs: enough programs whichever the tuner picks)
_SPLIT_BLOCK_N = 64


@register("linear_logits_triton", mutates_args=("out",))
def _linear_logits_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    target: torch.Tensor,
    target_logit: Optional[torch.Tensor],
    start: int,
    softcap: Optional[float],
    sumexp: bool,
    out: torch.Tensor,
) -> None:
    N, D = hidden.shape
    V = weight.shape[0]
    if N == 0:
        return
    hidden, weight, target = hidden.contiguous(), weight.contiguous(), target.contiguous()
    dt = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[hidden.dtype]
    prec = "ieee" if hidden.dtype == torch.float32 else "tf32"  # 16-bit inputs: the dot is exact in float32 anyway
    if INTERPRETED:
        tiles = dict(BLOCK_N=min(pow2(N), 32), BLOCK_V=min(pow2(V), 128), BLOCK_D=min(pow2(D), 64))
        row_blocks = triton.cdiv(N, tiles["BLOCK_N"])
        split = 1
    else:
        tiles = {}
        row_blocks = triton.cdiv(N, _SPLIT_BLOCK_N)
        split = max(1, min(TARGET_PROGRAMS // row_blocks, triton.cdiv(V, 1024)))
    span = triton.cdiv(triton.cdiv(V, split), 256) * 256  # whole tiles per slice
    split = triton.cdiv(V, span)
    parts = out if split == 1 else scratch("linear_logits", (split, N, 5), torch.float64, out.device)
    b = hidden if bias is None else bias.contiguous()
    zt = hidden if target_logit is None else target_logit.contiguous()
    grid = lambda meta: (triton.cdiv(N, meta["BLOCK_N"]), split)  # noqa: E731
    launch(_kernel)[grid](
        hidden, weight, b, target, zt, parts, N, V, D, start, span, 1.0 if softcap is None else float(softcap),
        HAS_B=bias is not None, HAS_ZT=target_logit is not None, SOFTCAP=softcap is not None, SUMEXP=bool(sumexp),
        DT=dt, PREC="ieee" if INTERPRETED else prec, UPCAST=INTERPRETED and hidden.dtype != torch.float32, **tiles,
    )
    if split > 1:
        combine(parts.view(split, N, 5), out)


def linear_logits(hidden, weight, bias, target, target_logit, start, softcap, sumexp, out) -> None:
    """Triton launcher with ``reference.linear_logits``'s arguments (overwrites ``out``)."""
    torch.ops.d9d_kernels.linear_logits_triton(
        hidden, weight, bias, target, target_logit, int(start), None if softcap is None else float(softcap),
        bool(sumexp), out,
    )
