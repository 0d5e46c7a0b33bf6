"""Pivots of moment sums: ``moments_recenter`` re-expresses sums about new
pivots, ``moments_center`` gives the centres they are most precise about and
whether they are off-centre. A sync, a merge and forward's fold call them
once per batch of moment statistics, whatever its size.

Internal ops, not in ``OPS``: the compiled kernels (csrc/cpu and csrc/cuda
``moments_pivot``) where the extension has one for the device, else their
specification, ``d9d_kernels.reference.moments_recenter`` / ``moments_center``.
"""

from __future__ import annotations

from typing import Callable

import torch

from d9d_kernels import _extension, reference

__all__ = ["moments_recenter", "moments_center"]

_IMPLS: dict[tuple[str, str], Callable] = {}


def _impl(name: str, device: torch.device) -> Callable:
    key = (name, device.type)
    fn = _IMPLS.get(key)
    if fn is None:
        compiled = _extension.CPP_ERROR is None and _extension._has_kernel(name, device.type.upper())
        fn = _IMPLS[key] = getattr(torch.ops.d9d_kernels, name).default if compiled else getattr(reference, name)
    return fn


def moments_recenter(moments: torch.Tensor, pivot: torch.Tensor, new_pivot: torch.Tensor) -> None:
    """``moments`` ``[..., 9]`` about ``pivot`` ``[..., 2]`` re-expressed about
    ``new_pivot`` in place; ``pivot`` becomes ``new_pivot`` (float64,
    contiguous; ``reference.moments_recenter``)."""
    _impl("moments_recenter", moments.device)(moments, pivot, new_pivot)


def moments_center(moments: torch.Tensor, pivot: torch.Tensor, paired: bool, threshold: float,
                   centre: torch.Tensor, off: torch.Tensor) -> None:
    """Writes the weighted means of ``moments`` into ``centre`` where they have
    data and sets ``off`` (bool ``[1]``) when a component lost more than
    ``threshold`` ulps to its pivot (``reference.moments_center``)."""
    _impl("moments_center", moments.device)(moments, pivot, paired, threshold, centre, off)
