"""Triton running_extrema: ``state = maximum(state, (max x, -min x))``.

Design: a two-stage reduction, so NaN propagation follows ``torch.maximum``
exactly on every device (float ``atomic_max`` would depend on NaN bit
patterns). ``_partial_kernel`` writes one row ``(max, -min, saw_nan, bad)``
per program; ``_combine_kernel`` (one program) folds the rows into the state.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from d9d_kernels.triton._common import BLOCK, as_u8, finite, launch, register

_BLOCK_P = 1024  # partial rows folded per step by the combine kernel


@triton.jit
def _partial_kernel(x_ptr, m_ptr, part_ptr, n, SKIP_BAD: tl.constexpr, HAS_M: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    if HAS_M:
        valid = valid & (tl.load(m_ptr + offs, mask=valid, other=0) != 0)
    x = tl.load(x_ptr + offs, mask=valid, other=0).to(tl.float64)
    isnan = x != x
    use = valid & ~isnan
    saw_nan = tl.max((valid & isnan).to(tl.float64), 0)
    if SKIP_BAD:
        saw_nan = saw_nan * 0.0  # NaN left out; stays a float64 tensor
    out = part_ptr + pid.to(tl.int64) * 4
    tl.store(out + 0, tl.max(tl.where(use, x, -float("inf")), 0))
    tl.store(out + 1, tl.max(tl.where(use, -x, -float("inf")), 0))
    tl.store(out + 2, saw_nan)
    tl.store(out + 3, tl.sum((valid & ~finite(x)).to(tl.float64), 0))


@triton.jit
def _combine_kernel(part_ptr, state_ptr, bad_ptr, n_part, BLOCK_P: tl.constexpr):
    mx = tl.full([BLOCK_P], -float("inf"), tl.float64)
    mn = tl.full([BLOCK_P], -float("inf"), tl.float64)
    nan = tl.zeros([BLOCK_P], tl.float64)
    cnt = tl.zeros([BLOCK_P], tl.float64)
    for start in range(0, n_part, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        ok = rows < n_part
        mx = tl.maximum(mx, tl.load(part_ptr + rows * 4 + 0, mask=ok, other=-float("inf")))
        mn = tl.maximum(mn, tl.load(part_ptr + rows * 4 + 1, mask=ok, other=-float("inf")))
        nan = tl.maximum(nan, tl.load(part_ptr + rows * 4 + 2, mask=ok, other=0.0))
        cnt += tl.load(part_ptr + rows * 4 + 3, mask=ok, other=0.0)
    s0 = tl.load(state_ptr)
    s1 = tl.load(state_ptr + 1)
    saw_nan = tl.max(nan, 0) > 0
    # torch.maximum: NaN on either side gives NaN
    tl.store(state_ptr, tl.where(saw_nan | (s0 != s0), float("nan"), tl.maximum(s0, tl.max(mx, 0))))
    tl.store(state_ptr + 1, tl.where(saw_nan | (s1 != s1), float("nan"), tl.maximum(s1, tl.max(mn, 0))))
    tl.store(bad_ptr, tl.load(bad_ptr) + tl.sum(cnt, 0))


@register("running_extrema_triton", mutates_args=("state", "bad"))
def _running_extrema_op(
    x: torch.Tensor, mask: Optional[torch.Tensor], skip_bad: bool, state: torch.Tensor, bad: torch.Tensor
) -> None:
    n = x.numel()
    if n == 0:
        return
    x = x.contiguous()
    n_part = triton.cdiv(n, BLOCK)
    part = torch.empty((n_part, 4), dtype=torch.float64, device=x.device)
    launch(_partial_kernel)[(n_part,)](x, as_u8(mask, x), part, n, SKIP_BAD=bool(skip_bad), HAS_M=mask is not None, BLOCK=BLOCK)
    launch(_combine_kernel)[(1,)](part, state, bad, n_part, BLOCK_P=_BLOCK_P)


def running_extrema(x, mask, skip_bad, state, bad) -> None:
    """Triton launcher with ``reference.running_extrema``'s arguments (updates state in place)."""
    torch.ops.d9d_kernels.running_extrema_triton(x, mask, bool(skip_bad), state, bad)
