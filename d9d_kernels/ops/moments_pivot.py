"""Pivots of moment sums: ``moments_recenter`` re-expresses sums about new
pivots, ``moments_center`` gives the centres they are most precise about and
whether they are off-centre. Both address their entries in flat buffers
through a table (``[B, 3]``: sums offset, pivots offset, y is data), so a
sync handles every moment statistic of a storage in one call each; a
statistic's own views use ``consecutive``'s table.

Internal ops, not in ``OPS``: the compiled kernels (csrc/cpu and csrc/cuda
``moments_pivot``) where the extension has one for the device, else their
specification, ``d9d_kernels.reference.moments_recenter`` / ``moments_center``.
"""

from __future__ import annotations

from typing import Callable

import torch

from d9d_kernels import _extension, reference

__all__ = ["moments_recenter", "moments_center", "consecutive"]

_IMPLS: dict[tuple[str, str], Callable] = {}
_TABLES: dict[tuple, torch.Tensor] = {}


def _impl(name: str, device: torch.device) -> Callable:
    key = (name, device.type)
    fn = _IMPLS.get(key)
    if fn is None:
        compiled = _extension.CPP_ERROR is None and _extension._has_kernel(name, device.type.upper())
        fn = _IMPLS[key] = getattr(torch.ops.d9d_kernels, name).default if compiled else getattr(reference, name)
    return fn


def consecutive(entries: int, paired: bool, device: torch.device) -> torch.Tensor:
    """The table of ``entries`` vectors stored one after another (``[..., 9]``
    sums, ``[..., 2]`` pivots), made once per (size, paired, device)."""
    key = (entries, paired, device)
    table = _TABLES.get(key)
    if table is None:
        e = torch.arange(entries, dtype=torch.int64)
        rows = torch.stack([reference.MOMENTS_SIZE * e, 2 * e, torch.full_like(e, int(paired))], dim=1)
        table = _TABLES[key] = rows.to(device)
    return table


def moments_recenter(sums: torch.Tensor, pivots: torch.Tensor, new_pivots: torch.Tensor, table: torch.Tensor) -> None:
    """The entries ``table`` addresses in the flat float64 ``sums`` re-expressed
    about ``new_pivots`` in place; ``pivots`` takes their values
    (``reference.moments_recenter``)."""
    _impl("moments_recenter", sums.device)(sums, pivots, new_pivots, table)


def moments_center(sums: torch.Tensor, pivots: torch.Tensor, table: torch.Tensor, threshold: float,
                   centre: torch.Tensor, off: torch.Tensor) -> None:
    """Writes the entries' weighted means into ``centre`` where they have data
    and sets ``off`` (bool ``[1]``) when a component lost more than
    ``threshold`` ulps to its pivot (``reference.moments_center``)."""
    _impl("moments_center", sums.device)(sums, pivots, table, threshold, centre, off)
