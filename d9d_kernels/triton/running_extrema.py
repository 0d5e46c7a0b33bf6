"""Triton running_extrema: ``state = maximum(state, (max x, -min x))``.

Design: a two-stage reduction, so NaN propagation follows ``torch.maximum``
exactly on every device (a float ``atomic_max`` would depend on NaN bit
patterns). ``_partial_kernel`` (grid-stride loop, at most ``MAX_PROGRAMS``
programs) writes one row ``(max, -min, saw_nan, bad)`` per program;
``_combine_kernel`` (one program) folds the rows into the state. The rows
live in a buffer reused across calls (``_common.scratch``).
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from d9d_kernels.triton._common import BLOCK, MAX_PROGRAMS, as_u8, finite, launch, pow2, programs, register, scratch


@triton.jit
def _partial_kernel(x_ptr, m_ptr, part_ptr, n, SKIP_BAD: tl.constexpr, HAS_M: tl.constexpr, BLOCK: tl.constexpr):
    mx = tl.full([BLOCK], -float("inf"), tl.float64)
    mn = tl.full([BLOCK], -float("inf"), tl.float64)
    nan = tl.zeros([BLOCK], tl.float64)
    bad = tl.zeros([BLOCK], tl.float64)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        valid = offs < n
        if HAS_M:
            valid = valid & (tl.load(m_ptr + offs, mask=valid, other=0) != 0)
        x = tl.load(x_ptr + offs, mask=valid, other=0).to(tl.float64)
        isnan = x != x
        use = valid & ~isnan
        mx = tl.maximum(mx, tl.where(use, x, -float("inf")))
        mn = tl.maximum(mn, tl.where(use, -x, -float("inf")))
        nan = tl.maximum(nan, (valid & isnan).to(tl.float64))
        bad += (valid & ~finite(x)).to(tl.float64)
    if SKIP_BAD:
        nan = nan * 0.0  # NaN left out
    out = part_ptr + tl.program_id(0) * 4
    tl.store(out + 0, tl.max(mx, 0))
    tl.store(out + 1, tl.max(mn, 0))
    tl.store(out + 2, tl.max(nan, 0))
    tl.store(out + 3, tl.sum(bad, 0))


@triton.jit
def _combine_kernel(part_ptr, state_ptr, bad_ptr, n_part, BLOCK_P: tl.constexpr):
    rows = tl.arange(0, BLOCK_P)
    ok = rows < n_part
    mx = tl.max(tl.load(part_ptr + rows * 4 + 0, mask=ok, other=-float("inf")), 0)
    mn = tl.max(tl.load(part_ptr + rows * 4 + 1, mask=ok, other=-float("inf")), 0)
    saw_nan = tl.max(tl.load(part_ptr + rows * 4 + 2, mask=ok, other=0.0), 0) > 0
    s0 = tl.load(state_ptr)
    s1 = tl.load(state_ptr + 1)
    # torch.maximum: NaN on either side gives NaN
    tl.store(state_ptr, tl.where(saw_nan | (s0 != s0), float("nan"), tl.maximum(s0, mx)))
    tl.store(state_ptr + 1, tl.where(saw_nan | (s1 != s1), float("nan"), tl.maximum(s1, mn)))
    tl.store(bad_ptr, tl.load(bad_ptr) + tl.sum(tl.load(part_ptr + rows * 4 + 3, mask=ok, other=0.0), 0))


@register("running_extrema_triton", mutates_args=("state", "bad"))
def _running_extrema_op(
    x: torch.Tensor, mask: Optional[torch.Tensor], skip_bad: bool, state: torch.Tensor, bad: torch.Tensor
) -> None:
    n = x.numel()
    if n == 0:
        return
    x = x.contiguous()
    n_part = programs(n, BLOCK)
    part = scratch("extrema_part", (MAX_PROGRAMS, 4), torch.float64, x.device)  # rows < n_part are written
    launch(_partial_kernel)[(n_part,)](x, as_u8(mask, x), part, n, SKIP_BAD=bool(skip_bad), HAS_M=mask is not None, BLOCK=BLOCK)
    launch(_combine_kernel)[(1,)](part, state, bad, n_part, BLOCK_P=pow2(MAX_PROGRAMS))


def running_extrema(x, mask, skip_bad, state, bad) -> None:
    """Triton launcher with ``reference.running_extrema``'s arguments (updates state in place)."""
    torch.ops.d9d_kernels.running_extrema_triton(x, mask, bool(skip_bad), state, bad)
