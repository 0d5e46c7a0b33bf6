"""Forward: an update on a scratch copy of the state, folded in after.

``forward`` must return the batch's own value, the value a fresh metric
gives for that batch: the update runs on a ``Scratch`` copy of the
storage's buffers at their reset values (pivots included: the batch picks
its own), the batch value is computed from it, then the ranges of the
statistics it ran are folded into the state: the batch's pivoted sums
re-expressed about ``storage.chosen_replica`` (the state's pivot where it
has one), SUM added, MAX maxed (the kernels' ``nan_maximum``: NaN wins, a
tie takes the batch's), REPLICA copied.

The scratch is allocated at the first forward of a storage and kept reset
between forwards by re-filling only the ranges the last forward wrote: a
forward allocates nothing, and a small member's forward never touches a
large confusion matrix elsewhere in the group.
"""

from __future__ import annotations

from typing import Callable

import torch

from d9d_kernels.core.statistic import KINDS, MAX, SUM
from d9d_kernels.core.storage import adopt, chosen_replica, numel
from d9d_kernels.memory import format_bytes

__all__ = ["Scratch", "run"]


def run(st, update: Callable[[], None], value: Callable[[list], object]):
    """Runs ``update`` on ``st``'s scratch, returns ``value(scratch views)``
    (the batch's value: fresh tensors, not views of the scratch) and folds
    what the update wrote into the state (nothing when it raises: the state
    stays as it was)."""
    sc = st.scratch
    if sc is None:
        sc = st.scratch = Scratch(st)
    sc.begin(st)
    try:
        update()
    finally:
        ran = sc.end(st)
    try:
        return value(sc.views)
    finally:
        sc.fold(st, ran)


class Scratch:
    """The batch's copy of a storage's buffers: ``bufs`` (per kind), their
    ``views`` (per statistic) and the ranges the last forward wrote (``dirty``)."""

    def __init__(self, st):
        try:
            # normal tensors even inside torch.inference_mode(): a later
            # forward outside it writes them in place
            with torch.inference_mode(False):
                self.bufs = {k: v.clone() for k, v in st.init.items()}
                self.views = [st.layout.views(self.bufs, j) for j in range(len(st.layout.stats))]
        except (MemoryError, torch.OutOfMemoryError, RuntimeError) as e:
            raise ValueError(
                f"{st.label}: forward() needs one more copy of the state ({format_bytes(st.layout.state_bytes())} "
                f"of float64) for the batch, and allocating it on {st.device} failed: {e}; use update() and "
                "compute() instead"
            ) from None
        self._cache: dict = {}  # frozenset of statistics -> their ranges
        self.dirty = self.ranges(st, frozenset())  # a fresh copy of the reset values
        self.saved = None  # the storage's local views while a forward runs

    def begin(self, st) -> None:
        """Resets what the last forward wrote and points the update at the scratch."""
        if self.saved is not None:
            raise RuntimeError(f"{st.label}: forward() called while another forward of the same storage runs")
        for kind, _, scr, init in self.dirty:
            if init is None:
                scr.zero_()
            else:
                scr.copy_(init)
        st.touched = set()
        self.saved, st.local_views = st.local_views, self.views

    def end(self, st) -> frozenset:
        """Restores the local views; returns the statistics the update ran."""
        st.local_views, self.saved = self.saved, None
        ran = frozenset(st.touched)
        st.touched = None
        self.dirty = self.ranges(st, ran)
        return ran

    def fold(self, st, ran: frozenset) -> None:
        """Folds the ranges of the statistics ``ran`` into the state, a pivoted batch re-expressed first;
        the state's sums are about the chosen pivot already, or it has none and they are 0 (or non-finite)."""
        for j in ran:
            if st.layout.has_replica(j):
                stat, batch = st.layout.stats[j], self.views[j]
                adopt(stat, batch, chosen_replica(stat, st.local_views[j], batch))
        for kind, loc, scr, init in self.dirty:
            if kind == SUM:
                loc.add_(scr if init is None else scr - init)  # non-zero reset values: the batch's part only
            elif kind == MAX:
                loc.copy_(torch.where((loc > scr) | loc.isnan(), loc, scr))
            else:
                loc.copy_(scr)
        st.dirty = True

    def ranges(self, st, js: frozenset) -> tuple:
        """``(kind, state view, scratch view, reset values or None)`` per
        contiguous range of the statistics ``js`` (a statistic's slots of one
        kind are adjacent; adjacent statistics merge into one range)."""
        hit = self._cache.get(js)
        if hit is not None:
            return hit
        out = []
        for kind in KINDS:
            spans = []
            for j in sorted(js):
                offs = [(o, numel(s.shape)) for s, o in st.layout.placed[j] if s.kind == kind]
                if offs:
                    a, b = min(o for o, _ in offs), max(o + n for o, n in offs)
                    if spans and spans[-1][1] == a:
                        spans[-1][1] = b
                    else:
                        spans.append([a, b])
            out += [(kind, a, b) for a, b in spans if b > a]
        with torch.inference_mode(False):  # cached views: usable in and outside inference mode
            hit = self._cache[js] = tuple(
                (kind, st.local[kind][a:b], self.bufs[kind][a:b], None if st.layout.zero_init[kind] else st.init[kind][a:b])
                for kind, a, b in out)
        return hit
