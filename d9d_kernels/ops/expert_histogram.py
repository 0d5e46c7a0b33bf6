"""expert_histogram: per-layer expert load (and gate mass) of MoE routing.

The reference in ``d9d_kernels.reference`` is the specification.
"""

from __future__ import annotations

import math
import operator
from typing import Sequence

import torch

from d9d_kernels.ops._common import as_float, as_index, fail
from d9d_kernels.ops._dispatch import run

OP = "expert_histogram"


def layer_list(layers, rows: int, op: str = OP, arg: str = "layers") -> list[int]:
    """``layers`` (None, a sequence of ints, a range or a CPU integer tensor)
    as a list of ``rows`` Python ints; ``None`` is ``range(rows)``. A CUDA
    tensor is refused: reading it would be a host sync."""
    if layers is None:
        return list(range(rows))
    if isinstance(layers, torch.Tensor):
        if layers.device.type != "cpu" or layers.is_floating_point() or layers.is_complex() or layers.dim() > 1:
            fail(op, arg, f"must be host ints (a list, a range or a 1-D CPU integer tensor), got a "
                 f"{layers.dtype} tensor of shape {tuple(layers.shape)} on {layers.device}", TypeError)
        return [int(v) for v in layers.reshape(-1).tolist()]
    try:
        out = [operator.index(v) for v in layers]
    except TypeError:
        fail(op, arg, f"must be a sequence of ints, got {layers!r}", TypeError)
    return out


def expert_histogram(
    indices: torch.Tensor,
    layers: Sequence[int] | torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    *,
    load: torch.Tensor,
    bad: torch.Tensor,
    gate: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Adds one batch of routing decisions of ``L'`` MoE layers into ``load``.

    Args:
        indices: ``[L', ...]`` integer expert indices of layer ``layers[i]`` in
            row ``i`` (e.g. ``[L', T, top_k]``), or ``[N]`` for one layer;
            ``-1`` = dropped slot. int32/int64 are read as they are; floating
            values that are not whole numbers count as bad.
        layers: the ``L'`` layer ids (host ints), default ``range(L')``.
        probs: ``[L', T, E]`` (or ``[T, E]`` for one layer) floating gate
            probabilities, or ``None``.
        load: float64 ``[L, E]``: += slots per (layer, expert).
        bad: float64 ``[1]``: += slots with an index outside ``[0, E)`` and not ``-1``.
        gate: float64 ``[L, E + 1]`` (needed with ``probs``): ``[:, :E]`` +=
            Σ over tokens of the probabilities, ``[:, E]`` += tokens.
        backend: force ``"cpp" | "cuda" | "triton" | "torch"``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> load, bad = torch.zeros(2, 3, dtype=torch.float64), torch.zeros(1, dtype=torch.float64)
        >>> dk.ops.expert_histogram(torch.tensor([[0, 2, -1, 2]]), [1], load=load, bad=bad)
        >>> load.tolist()
        [[0.0, 0.0, 0.0], [1.0, 0.0, 2.0]]
    """
    if not isinstance(indices, torch.Tensor) or indices.is_complex():
        fail(OP, "indices", f"must be a real torch.Tensor, got {getattr(indices, 'dtype', type(indices).__name__)}",
             TypeError)
    if indices.dtype not in (torch.int64, torch.int32):
        indices = as_index(OP, "indices", indices)
    rows = 1 if indices.dim() <= 1 else indices.shape[0]
    indices = indices.reshape(rows, math.prod(indices.shape[1:]) if indices.dim() > 1 else indices.numel())
    if probs is not None:
        probs = as_float(OP, "probs", probs)
        if probs.dim() == 2:
            probs = probs[None]
    run(OP, indices.device, backend, indices, layer_list(layers, indices.shape[0]), probs, load, gate, bad)
