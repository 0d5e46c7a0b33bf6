"""LastInputs: a value derived from the last inputs seen, shared by group members.

``MetricGroup.update(preds=..., target=...)`` offers the same tensors to
every member. Members whose state differs but whose expensive pass over the
inputs is the same (Dice / GeneralizedDiceScore / MeanIoU counting pixels;
CalibrationError's l1 / l2 / max binning the same confidences) look the
pass up here, so a group runs it once per update. Weak references: a batch
is never kept alive by the memo, and the value is dropped when an input
dies (it may be as large as the batch); a new tensor or an in-place change
of an input (``_version``) misses; inference tensors (no version counter)
are never memoised.
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["LastInputs"]


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
        # traced code (torch.compile) cannot guard on _version / object identity: no memo there
        if torch.compiler.is_compiling():
            return None
        if self._key != key or len(self._refs) != len(tensors):
            return None
        if all(_same(r, t) for r, t in zip(self._refs, tensors)):
            return self._value
        return None

    def put(self, tensors: tuple, key, value) -> None:
        # inference tensors have no version counter, so an in-place change could not be seen: no memo
        if torch.compiler.is_compiling() or any(t is not None and t.is_inference() for t in tensors):
            self._key, self._refs, self._value = None, (), None
            return
        self._key, self._value = key, value
        self._refs = tuple(None if t is None else (weakref.ref(t, self._drop), t._version) for t in tensors)

    def _drop(self, dead) -> None:
        if any(r is not None and r[0] is dead for r in self._refs):
            self._key, self._refs, self._value = None, (), None
