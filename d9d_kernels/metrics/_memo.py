"""LastInputs: a value derived from the last inputs seen, shared by group members.

``MetricGroup.update(preds=..., target=...)`` offers the same tensors to
every member. Members whose state differs but whose expensive pass over the
inputs is the same (Dice / GeneralizedDiceScore / MeanIoU counting pixels;
CalibrationError's l1 / l2 / max binning the same confidences) look the
pass up here, so a group runs it once per update. Weak references: a batch
is never kept alive by the memo; a new tensor or an in-place change of an
input (``_version``) misses.
"""

from __future__ import annotations

import weakref

__all__ = ["LastInputs"]


def _ref(t):
    return None if t is None else (weakref.ref(t), t._version)


def _same(ref, t) -> bool:
    if ref is None or t is None:
        return ref is None and t is None
    return ref[0]() is t and ref[1] == t._version


class LastInputs:
    """One entry: ``get(tensors, key)`` returns the value ``put`` with the same
    tensor objects (unchanged since) and an equal ``key``, else None."""

    def __init__(self):
        self._key, self._refs, self._value = None, (), None

    def get(self, tensors: tuple, key):
        if self._key != key or len(self._refs) != len(tensors):
            return None
        if all(_same(r, t) for r, t in zip(self._refs, tensors)):
            return self._value
        return None

    def put(self, tensors: tuple, key, value) -> None:
        self._key, self._refs, self._value = key, tuple(_ref(t) for t in tensors), value
