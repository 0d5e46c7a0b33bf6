"""Counting NaN/Inf predictions apart from the kernels' ``bad`` count.

The kernels count NaN/Inf scores and out-of-range targets in one ``bad``
slot. ``nan_strategy`` "ignore" / "propagate" apply to NaN input only, so
the classification statistics can also count non-finite rows on their own
(``count_nonfinite=True``): ``bad - nonfinite`` is then what still raises.
"""

from __future__ import annotations

import torch

from d9d_kernels.core.statistic import SUM, Slot, Statistic, either, param, statistic

__all__ = ["CountsNonfinite", "nonfinite_rows"]

INPUTS = ("preds", "target", "mask")


def nonfinite_rows(
    preds: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None, ignore_index: int | None, row_dims: int,
    class_rows: bool = False,
) -> torch.Tensor:
    """Float64 ``[1]``: rows (the leading ``row_dims`` dims of ``preds``) with a
    NaN/Inf score, among those kept by ``mask`` and ``ignore_index``.

    With ``class_rows`` (class_stats score rows) the kernels' rule applies
    instead: -Inf is a masked logit, a row is non-finite when it holds a NaN
    or +Inf or only -Inf (``reference.valid_score_rows``), found from the row
    max: no ``[N, C]`` temporary beside a batch of LLM logits.
    """
    keep = None if mask is None else torch.broadcast_to(mask, target.shape)
    if ignore_index is not None:
        ig = target != ignore_index
        keep = ig if keep is None else keep & ig
    if class_rows and preds.dim() > row_dims:
        # reference.valid_score_rows in one read and [N] of memory: the row max
        # is NaN with a NaN, +Inf with a +Inf, -Inf when every score is -Inf
        bad = ~torch.isfinite(preds.flatten(row_dims).amax(-1))
    else:
        bad = ~torch.isfinite(preds)
    if bad.dim() > row_dims:
        bad = bad.flatten(row_dims).any(-1)
    if keep is not None:
        bad = bad & keep
    return bad.sum(dtype=torch.float64).reshape(1)


@statistic
class CountsNonfinite(Statistic):
    """Base of the statistics fed ``(preds, target, mask)`` by a classification
    metric; subclasses have an ``ignore_index`` field.

    Fields (keyword-only):
        count_nonfinite: also keep a ``nonfinite`` SUM ``[1]`` slot; merged by
            ``either`` (a member that does not ask for it ignores it).
        inputs: the update keyword names of preds, target and mask.
    """

    count_nonfinite: bool = param(False, convert=bool, merge=either, kw_only=True)
    inputs: tuple[str, ...] = param(INPUTS, convert=tuple, kw_only=True)

    def nonfinite_slots(self) -> list[Slot]:
        return [Slot("nonfinite", SUM, (1,))] if self.count_nonfinite else []

    def add_nonfinite(self, state, preds, target, mask, row_dims: int, class_rows: bool = False) -> None:
        """Adds ``nonfinite_rows(...)`` of one batch (already in the shapes the op was given)."""
        if self.count_nonfinite and preds.is_floating_point():
            state["nonfinite"].add_(nonfinite_rows(preds, target, mask, self.ignore_index, row_dims, class_rows))
