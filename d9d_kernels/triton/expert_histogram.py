"""Triton expert_histogram: per-layer expert load and gate mass of MoE routing.

Design: ``_load_kernel`` runs on a ``[L', P]`` grid: the ``P`` programs of
row ``i`` stride over its slots in ``BLOCK`` tiles and count them in a
per-program ``tl.histogram`` of ``NB = pow2(E)`` bins (one relaxed atomic per
non-empty bin into ``load[layers[i]]`` at the end); with ``E > HIST_BINS``
every slot is its own atomic. Slots outside ``[0, E)`` other than ``-1`` go
to ``bad``. ``_gate_kernel`` runs on ``[L', E tiles, T programs]``: float64
column sums of ``probs`` over the tokens, one atomic per expert per program;
the first program of a row adds ``T`` to ``gate[l, E]``. The layer ids are a
small int64 tensor made once per (layers, device) and reused, so a call
allocates nothing after the first.
"""

from typing import Optional

import torch
import triton
import triton.language as tl

from d9d_kernels.triton._common import BLOCK, INTERPRETED, MAX_PROGRAMS, TILE, _tracing, launch, pow2, register

#: per-program histograms up to this many experts (more: one atomic per slot)
HIST_BINS = 4096


@triton.jit
def _load_kernel(idx_ptr, lay_ptr, load_ptr, bad_ptr, n, s0, s1, E, NB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    layer = tl.load(lay_ptr + row)
    dst = load_ptr + layer * E
    base = idx_ptr + row.to(tl.int64) * s0
    nbad = tl.zeros([BLOCK], tl.int32)
    if NB > 0:
        h = tl.zeros([NB], tl.int32)
    for start in range(tl.program_id(1) * BLOCK, n, tl.num_programs(1) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inb = offs < n
        v = tl.load(base + offs.to(tl.int64) * s1, mask=inb, other=-1).to(tl.int64)
        ok = inb & (v >= 0) & (v < E)
        nbad += (inb & ~ok & (v != -1)).to(tl.int32)
        if NB > 0:
            h += tl.histogram(tl.where(ok, v, 0).to(tl.int32), NB, mask=ok)
        else:
            tl.atomic_add(dst + tl.where(ok, v, 0), tl.full([BLOCK], 1.0, tl.float64), mask=ok, sem="relaxed")
    if NB > 0:
        bins = tl.arange(0, NB)
        tl.atomic_add(dst + bins, h.to(tl.float64), mask=(bins < E) & (h > 0), sem="relaxed")
    b = tl.sum(nbad, 0)
    if b > 0:
        tl.atomic_add(bad_ptr, b.to(tl.float64), sem="relaxed")


@triton.jit
def _gate_kernel(p_ptr, lay_ptr, gate_ptr, T, E, s0, s1, s2, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0)
    layer = tl.load(lay_ptr + row)
    cols = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    cok = cols < E
    acc = tl.zeros([BLOCK_E], tl.float64)
    base = p_ptr + row.to(tl.int64) * s0
    for start in range(tl.program_id(2) * BLOCK_T, T, tl.num_programs(2) * BLOCK_T):
        t = start + tl.arange(0, BLOCK_T)
        ok = (t < T)[:, None] & cok[None, :]
        p = tl.load(base + t.to(tl.int64)[:, None] * s1 + cols[None, :] * s2, mask=ok, other=0.0).to(tl.float64)
        acc += tl.sum(p, 0)
    dst = gate_ptr + layer * (E + 1)
    tl.atomic_add(dst + cols, acc, mask=cok, sem="relaxed")
    if (tl.program_id(1) == 0) & (tl.program_id(2) == 0):
        tl.atomic_add(dst + E, T.to(tl.float64), sem="relaxed")


_LAYERS: dict = {}


def layer_ids(layers: list[int], device: torch.device) -> torch.Tensor:
    """``layers`` as an int64 tensor on ``device``, made once per (layers, device)."""
    if _tracing():
        return torch.tensor(layers, dtype=torch.int64, device=device)
    key = (tuple(layers), device)
    t = _LAYERS.get(key)
    if t is None:
        t = _LAYERS[key] = torch.tensor(layers, dtype=torch.int64, device=device)
    return t


@register("expert_histogram_triton", mutates_args=("load", "gate", "bad"))
def _expert_histogram_op(
    indices: torch.Tensor,
    layers: list[int],
    probs: Optional[torch.Tensor],
    load: torch.Tensor,
    gate: Optional[torch.Tensor],
    bad: torch.Tensor,
) -> None:
    R, n = indices.shape
    E = load.shape[1]
    if R == 0:
        return
    lay = layer_ids(layers, indices.device)
    if n > 0:
        per_row = max(1, min(triton.cdiv(n, BLOCK), MAX_PROGRAMS // R if not INTERPRETED else MAX_PROGRAMS))
        nb = pow2(E) if E <= HIST_BINS else 0
        launch(_load_kernel)[(R, per_row)](indices, lay, load, bad, n, indices.stride(0), indices.stride(1), E,
                                          NB=nb, BLOCK=BLOCK)
    if probs is not None:
        T = probs.shape[1]
        block_e = min(pow2(E), 128 if not INTERPRETED else TILE)
        block_t = max(TILE // block_e, 1)
        e_tiles = triton.cdiv(E, block_e)
        t_progs = max(1, min(triton.cdiv(T, block_t), MAX_PROGRAMS // max(R * e_tiles, 1)))
        launch(_gate_kernel)[(R, e_tiles, t_progs)](probs, lay, gate, T, E, probs.stride(0), probs.stride(1),
                                                    probs.stride(2), BLOCK_T=block_t, BLOCK_E=block_e)


def expert_histogram(indices, layers, probs, load, gate, bad) -> None:
    """Triton launcher with ``reference.expert_histogram``'s arguments (adds into load in place)."""
    torch.ops.d9d_kernels.expert_histogram_triton(indices, list(layers), probs, load, gate, bad)
