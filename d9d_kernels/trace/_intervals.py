"""Vectorised interval arithmetic on half-open ``[start, end)`` intervals.

Intervals are two float64 arrays ``(starts, ends)``. ``union`` returns sorted,
disjoint intervals; everything else accepts any intervals and unions first.
"""

from __future__ import annotations

import numpy as np


def union(starts, ends) -> tuple[np.ndarray, np.ndarray]:
    """Merge overlapping or touching intervals; returns sorted disjoint intervals."""
    s = np.asarray(starts, dtype=np.float64)
    e = np.asarray(ends, dtype=np.float64)
    if s.size == 0:
        return s.copy(), e.copy()
    order = np.argsort(s, kind="stable")
    s = s[order]
    e = e[order]
    run_end = np.maximum.accumulate(e)
    # a new group starts where the interval begins after everything before it ended
    new = np.empty(s.size, dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    idx = np.flatnonzero(new)
    last = np.append(idx[1:] - 1, s.size - 1)
    return s[idx], run_end[last]


def total(starts, ends) -> float:
    """Length of the union of the intervals."""
    s, e = union(starts, ends)
    return float((e - s).sum())


def intersect(a: tuple, b: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Intersection of two interval sets (each unioned first)."""
    a_s, a_e = union(*a)
    b_s, b_e = union(*b)
    if a_s.size == 0 or b_s.size == 0:
        return np.empty(0), np.empty(0)
    # for every a-interval, the b-intervals that can overlap it
    lo = np.searchsorted(b_e, a_s, side="right")
    hi = np.searchsorted(b_s, a_e, side="left")
    counts = np.maximum(hi - lo, 0)
    if counts.sum() == 0:
        return np.empty(0), np.empty(0)
    ai = np.repeat(np.arange(a_s.size), counts)
    offs = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
    bi = np.repeat(lo, counts) + offs
    s = np.maximum(a_s[ai], b_s[bi])
    e = np.minimum(a_e[ai], b_e[bi])
    keep = e > s
    return s[keep], e[keep]


def intersection_length(a: tuple, b: tuple) -> float:
    """Length of (union a) ∩ (union b)."""
    s, e = intersect(a, b)
    return float((e - s).sum())


def subtract_length(a: tuple, b: tuple) -> float:
    """Length of (union a) minus (union b)."""
    return total(*a) - intersection_length(a, b)


def clip(starts, ends, lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """Clip intervals to ``[lo, hi)``, dropping empty ones."""
    s = np.maximum(np.asarray(starts, dtype=np.float64), lo)
    e = np.minimum(np.asarray(ends, dtype=np.float64), hi)
    keep = e > s
    return s[keep], e[keep]
