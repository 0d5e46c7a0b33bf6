"""Triton weighted_moments: Σw, Σw·dx, Σw·dx², Σw·dy, Σw·dy², Σw·dx·dy, Σw|x-y|, Σw(x-y)², n.

Design: a grid-stride loop on at most ``MAX_PROGRAMS`` programs; each
program accumulates its elements in float64 vectors, reduces them at the end
and adds its 9 partial sums (and its bad count) into ``state`` with
``tl.atomic_add``: one pass over the data, ~10 scalar atomics per program.
The order in which programs add is not fixed on GPU (results agree with the
reference to float64 rounding; counts are exact).

Pivots (``pivot`` given): ``_first_good_kernel`` finds the first valid element
whose x, y, w are all finite (``atomic_min`` of its index); its loads are
masked off when the pivot is already set, so in steady state it reads
nothing. ``_moments_kernel`` then sums about ``isnan(p) ? x[first] : p`` and
``_set_pivot_kernel`` (one program) stores the pivot afterwards, so no
program reads a pivot while another writes it. ``first`` is a buffer reused
across calls (``_common.scratch``) and every atomic is relaxed: the values
are read by later launches only.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from d9d_kernels.triton._common import BLOCK, as_u8, finite, launch, programs, register, scratch


@triton.jit
def _load_row(x_ptr, y_ptr, w_ptr, m_ptr, offs, inb, HAS_Y: tl.constexpr, HAS_W: tl.constexpr, HAS_M: tl.constexpr):
    """x, y, w as float64, the mask, and 'x, y, w all finite'. HAS_W == 2: one
    weight for all (a broadcast scalar, read once instead of copied to [N])."""
    valid = inb
    if HAS_M:
        valid = valid & (tl.load(m_ptr + offs, mask=inb, other=0) != 0)
    x = tl.load(x_ptr + offs, mask=inb, other=0).to(tl.float64)
    fin = finite(x)
    if HAS_W == 2:
        w = tl.full(x.shape, 1.0, tl.float64) * tl.load(w_ptr).to(tl.float64)
        fin = fin & finite(w)
    elif HAS_W == 1:
        w = tl.load(w_ptr + offs, mask=inb, other=0).to(tl.float64)
        fin = fin & finite(w)
    else:
        w = tl.full(x.shape, 1.0, tl.float64)
    if HAS_Y:
        y = tl.load(y_ptr + offs, mask=inb, other=0).to(tl.float64)
        fin = fin & finite(y)
    else:
        y = x
    return x, y, w, valid, fin


@triton.jit
def _first_good_kernel(x_ptr, y_ptr, w_ptr, m_ptr, pivot_ptr, first_ptr, n,
                       HAS_Y: tl.constexpr, HAS_W: tl.constexpr, HAS_M: tl.constexpr, BLOCK: tl.constexpr):
    """first = min(first, index of the first good element); ``first`` holds n on entry."""
    px = tl.load(pivot_ptr)
    unset = px != px
    if HAS_Y:
        py = tl.load(pivot_ptr + 1)
        unset = unset | (py != py)
    n_read = tl.where(unset, n, 0)  # nothing is read once the pivots are set
    first = tl.full([BLOCK], n, tl.int64)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, y, w, valid, fin = _load_row(x_ptr, y_ptr, w_ptr, m_ptr, offs, offs < n_read, HAS_Y, HAS_W, HAS_M)
        first = tl.minimum(first, tl.where(valid & fin, offs, n).to(tl.int64))
    tl.atomic_min(first_ptr, tl.min(first, 0), sem="relaxed")


@triton.jit
def _pivot(pivot_ptr, x_ptr, first, has, slot: tl.constexpr):
    """Pivot in force for this call: the stored one, else x[first] (0 if none)."""
    p = tl.load(pivot_ptr + slot)
    x0 = tl.load(x_ptr + first).to(tl.float64)
    return tl.where(p != p, tl.where(has, x0, 0.0), p)


@triton.jit
def _moments_kernel(x_ptr, y_ptr, w_ptr, m_ptr, pivot_ptr, first_ptr, state_ptr, bad_ptr, n,
                    SKIP_BAD: tl.constexpr, HAS_Y: tl.constexpr, HAS_W: tl.constexpr, HAS_M: tl.constexpr,
                    HAS_PIVOT: tl.constexpr, BLOCK: tl.constexpr):
    px = 0.0
    py = 0.0
    if HAS_PIVOT:
        first = tl.minimum(tl.load(first_ptr), n - 1)
        has = tl.load(first_ptr) < n
        px = _pivot(pivot_ptr, x_ptr, first, has, 0)
        if HAS_Y:
            py = _pivot(pivot_ptr, y_ptr, first, has, 1)
    s_w = tl.zeros([BLOCK], tl.float64)
    s_x = tl.zeros([BLOCK], tl.float64)
    s_xx = tl.zeros([BLOCK], tl.float64)
    s_y = tl.zeros([BLOCK], tl.float64)
    s_yy = tl.zeros([BLOCK], tl.float64)
    s_xy = tl.zeros([BLOCK], tl.float64)
    s_ae = tl.zeros([BLOCK], tl.float64)
    s_se = tl.zeros([BLOCK], tl.float64)
    s_n = tl.zeros([BLOCK], tl.float64)
    s_bad = tl.zeros([BLOCK], tl.float64)
    for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x, y, w, valid, fin = _load_row(x_ptr, y_ptr, w_ptr, m_ptr, offs, offs < n, HAS_Y, HAS_W, HAS_M)
        s_bad += (valid & ~fin).to(tl.float64)
        use = valid & fin if SKIP_BAD else valid
        wu = tl.where(use, w, 0.0)
        dx = tl.where(use, x - px, 0.0)
        s_w += wu
        s_x += wu * dx
        s_xx += wu * dx * dx
        if HAS_Y:
            dy = tl.where(use, y - py, 0.0)
            diff = tl.where(use, x - y, 0.0)
            s_y += wu * dy
            s_yy += wu * dy * dy
            s_xy += wu * dx * dy
            s_ae += wu * tl.abs(diff)
            s_se += wu * diff * diff
        s_n += use.to(tl.float64)
    tl.atomic_add(bad_ptr, tl.sum(s_bad, 0), sem="relaxed")
    tl.atomic_add(state_ptr + 0, tl.sum(s_w, 0), sem="relaxed")
    tl.atomic_add(state_ptr + 1, tl.sum(s_x, 0), sem="relaxed")
    tl.atomic_add(state_ptr + 2, tl.sum(s_xx, 0), sem="relaxed")
    if HAS_Y:
        tl.atomic_add(state_ptr + 3, tl.sum(s_y, 0), sem="relaxed")
        tl.atomic_add(state_ptr + 4, tl.sum(s_yy, 0), sem="relaxed")
        tl.atomic_add(state_ptr + 5, tl.sum(s_xy, 0), sem="relaxed")
        tl.atomic_add(state_ptr + 6, tl.sum(s_ae, 0), sem="relaxed")
        tl.atomic_add(state_ptr + 7, tl.sum(s_se, 0), sem="relaxed")
    tl.atomic_add(state_ptr + 8, tl.sum(s_n, 0), sem="relaxed")


@triton.jit
def _set_pivot_kernel(x_ptr, y_ptr, pivot_ptr, first_ptr, n, HAS_Y: tl.constexpr):
    first = tl.minimum(tl.load(first_ptr), n - 1)
    has = tl.load(first_ptr) < n
    px = tl.load(pivot_ptr)
    tl.store(pivot_ptr, tl.where((px != px) & has, tl.load(x_ptr + first).to(tl.float64), px))
    if HAS_Y:
        py = tl.load(pivot_ptr + 1)
        tl.store(pivot_ptr + 1, tl.where((py != py) & has, tl.load(y_ptr + first).to(tl.float64), py))


@register("weighted_moments_triton", mutates_args=("state", "bad", "pivot"))
def _weighted_moments_op(
    x: torch.Tensor,
    y: Optional[torch.Tensor],
    weights: Optional[torch.Tensor],
    mask: Optional[torch.Tensor],
    skip_bad: bool,
    state: torch.Tensor,
    bad: torch.Tensor,
    pivot: Optional[torch.Tensor],
) -> None:
    n = x.numel()
    if n == 0:
        return
    x = x.contiguous()
    y = x if y is None else y.contiguous()
    has_w = 0
    w = x
    if weights is not None:  # stride 0: a broadcast scalar (0-d or number weights), read in place
        has_w = 2 if weights.dim() == 1 and weights.stride(0) == 0 else 1
        w = weights if has_w == 2 else weights.contiguous()
    m = as_u8(mask, x)
    flags = dict(HAS_Y=y is not x, HAS_W=has_w, HAS_M=mask is not None)
    grid = (programs(n, BLOCK),)
    if pivot is not None:
        first = scratch("moments_first", (1,), torch.int64, x.device).fill_(n)
        launch(_first_good_kernel)[grid](x, y, w, m, pivot, first, n, BLOCK=BLOCK, **flags)
    else:
        first = pivot = state  # unused when HAS_PIVOT=False
    launch(_moments_kernel)[grid](
        x, y, w, m, pivot, first, state, bad, n,
        SKIP_BAD=bool(skip_bad), HAS_PIVOT=pivot is not state, BLOCK=BLOCK, **flags,
    )
    if pivot is not state:
        launch(_set_pivot_kernel)[(1,)](x, y, pivot, first, n, HAS_Y=flags["HAS_Y"])


def weighted_moments(x, y, weights, mask, skip_bad, state, bad, pivot=None) -> None:
    """Triton launcher with ``reference.weighted_moments``'s arguments (adds into state in place)."""
    torch.ops.d9d_kernels.weighted_moments_triton(x, y, weights, mask, bool(skip_bad), state, bad, pivot)
