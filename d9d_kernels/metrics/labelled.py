"""Base of the statistics fed ``(preds, target, mask)`` by the classification,
ranking and language-model metrics.

Their kernels count what they leave out in a ``bad`` slot of two counts, by
cause (d9d_kernels/reference.py): ``[0]`` rows/entries whose target (or
class index) is invalid, ``[1]`` the others whose prediction is NaN/Inf.
``nan_strategy`` applies to the second only, and the error names both.
"""

from __future__ import annotations

from d9d_kernels.core.statistic import SUM, Slot, Statistic, param, statistic

__all__ = ["LabelledStatistic", "BAD", "INPUTS"]

INPUTS = ("preds", "target", "mask")

#: the bad slot by cause: [target out of range, NaN/Inf prediction]
BAD = Slot("bad", SUM, (2,))


@statistic
class LabelledStatistic(Statistic):
    """Fields (keyword-only): ``inputs``, the update keyword names of preds,
    target and mask."""

    inputs: tuple[str, ...] = param(INPUTS, convert=tuple, kw_only=True)
