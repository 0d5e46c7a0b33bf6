"""Statistic: the unit of state and kernel sharing inside a MetricGroup.

A metric declares the sufficient statistics it needs (``_statistics()``),
each produced by ONE kernel call per update; in a group, statistics with
equal ``merge_key()`` merge into one (one state slice, one kernel call), e.g.
Accuracy(top_k=1), Accuracy(top_k=5) and F1Score on the same classes become
one ``class_stats`` call with ``top_ks=(1, 5)``. A statistic's configuration
is the fields of a frozen dataclass (``@statistic``); ``merge_key``,
``merge``, ``schema`` and ``repr`` derive from them, so a new field cannot be
forgotten (docs/metrics_core.md, "On statistics").

Contract: ``slots()`` is a pure function of the configuration;
``update(state, **inputs)`` only calls ops / in-place tensor ops on the
``state`` views (no host sync, no data-dependent shapes); ``view(state,
need)`` returns what the statistic ``need`` merged into ``self`` would have
had on its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, Hashable

import torch

SUM = "sum"  # all_reduce SUM across ranks
MAX = "max"  # all_reduce MAX across ranks (a min is stored negated)
REPLICA = "replica"  # identical on every rank after the first sync; never reduced (e.g. pivots)
KINDS = (SUM, MAX, REPLICA)

__all__ = [
    "Slot", "Statistic", "statistic", "param", "union", "either", "optional_int", "SUM", "MAX", "REPLICA", "KINDS",
]


@dataclass(frozen=True)
class Slot:
    """One named state tensor of a statistic.

    Attributes:
        name: unique within the statistic.
        kind: ``SUM``, ``MAX`` or ``REPLICA``: which packed buffer it lives in.
        shape: tensor shape (float64).
        init: value after ``reset()`` (0 for sums, ``-inf`` for maxima, NaN for unset pivots).
    """

    name: str
    kind: str
    shape: tuple[int, ...]
    init: float = 0.0


def union(a: tuple, b: tuple) -> tuple:
    """Merge rule: the sorted union of two tuples (e.g. top-k's)."""
    return tuple(sorted(set(a) | set(b)))


def either(a: bool, b: bool) -> bool:
    """Merge rule: an optional part kept when either statistic wants it."""
    return bool(a or b)


def optional_int(v) -> int | None:
    """Converter: an int, or None."""
    return None if v is None else int(v)


def param(
    default: Any = MISSING,
    *,
    convert: Callable[[Any], Any] | None = None,
    merge: Callable[[Any, Any], Any] | None = None,
    kw_only: bool = False,
) -> Any:
    """A configuration field of a statistic.

    Args:
        default: the default value (immutable: tuples, numbers, None).
        convert: normalises the value at construction (``int``, a sorted
            tuple...), so that equal configurations compare equal in
            ``merge_key`` and print equal in ``schema``.
        merge: how ``merge`` combines this field of two statistics. Without
            it the field is part of ``merge_key`` (it must be equal).
        kw_only: keyword-only in the constructor (fields of shared bases, so
            that the subclass's own fields keep their positions).
    """
    meta = {}
    if convert is not None:
        meta["convert"] = convert
    if merge is not None:
        meta["merge"] = merge
    return field(default=default, metadata=meta, kw_only=kw_only)


def statistic(cls: type) -> type:
    """Declares a ``Statistic`` subclass's fields as its configuration: a
    frozen dataclass whose ``repr``, ``merge_key``, ``merge`` and ``schema``
    come from ``Statistic``. Instances compare by identity; statistics are
    matched by ``merge_key``."""
    return dataclass(frozen=True, eq=False, repr=False)(cls)


@statistic
class Statistic:
    """Sufficient statistics of one kernel call (abstract)."""

    #: names of the ``update`` keyword inputs this statistic consumes, e.g.
    #: ("preds", "target", "mask"); the metric maps its update args onto these.
    #: A class attribute, or a field where it is configurable.
    inputs = ()

    def __post_init__(self) -> None:
        for f in fields(self):
            convert = f.metadata.get("convert")
            if convert is not None:
                object.__setattr__(self, f.name, convert(getattr(self, f.name)))

    # ------------------------------------------------------------------
    # Derived from the fields.
    # ------------------------------------------------------------------

    def _config(self) -> list[tuple[str, Any]]:
        """``(name, value)`` of every field; keyword-only ones last."""
        fs = sorted(fields(self), key=lambda f: bool(f.kw_only))
        return [(f.name, getattr(self, f.name)) for f in fs]

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}(" + ", ".join(f"{k}={v!r}" for k, v in self._config()) + ")"

    def merge_key(self) -> Hashable:
        """Statistics with equal keys are merged into one in a group: the class
        and every field that has no ``merge`` rule."""
        if "__dataclass_fields__" not in vars(type(self)):
            # its configuration would be invisible here: every instance would merge
            raise TypeError(f"{type(self).__qualname__}: declare the class with @statistic or override merge_key")
        return (type(self).__qualname__,) + tuple(
            getattr(self, f.name) for f in fields(self) if "merge" not in f.metadata
        )

    def merge(self, other: "Statistic") -> "Statistic":
        """A statistic that provides everything ``self`` and ``other`` provide:
        the fields with a ``merge`` rule combined, the others (equal) kept."""
        if other.merge_key() != self.merge_key():
            raise ValueError(f"cannot merge {self!r} with {other!r}: their merge keys differ")
        changes = {
            f.name: f.metadata["merge"](getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if "merge" in f.metadata
        }
        if all(getattr(self, k) == v for k, v in changes.items()):
            return self
        return dataclasses.replace(self, **changes)

    def schema(self) -> str:
        """A rank-independent description of the whole configuration (every
        field, every slot), compared across ranks at the first sync; never
        contains ids or addresses."""
        slots = ",".join(f"{s.name}:{s.kind}:{tuple(s.shape)}" for s in self.slots())
        config = self._config()
        args = "(" + ",".join(f"{k}={v!r}" for k, v in config) + ")" if config else ""
        return f"{type(self).__qualname__}{args}[{slots}]"

    # ------------------------------------------------------------------
    # Implemented by every statistic.
    # ------------------------------------------------------------------

    def slots(self) -> list[Slot]:
        raise NotImplementedError

    def update(self, state: dict[str, torch.Tensor], **inputs) -> None:
        """Adds one batch into ``state`` (views into the packed buffers)."""
        raise NotImplementedError

    # ------------------------------------------------------------------
    # Optional hooks.
    # ------------------------------------------------------------------

    def unpack(self, inputs: dict) -> tuple:
        """The values of ``self.inputs`` in ``inputs``, in order (None where absent)."""
        return tuple(inputs.get(name) for name in self.inputs)

    def view(self, state: dict[str, torch.Tensor], need: "Statistic") -> dict[str, torch.Tensor]:
        """The part of ``state`` that ``need`` (merged into self) asked for.
        Default: the slots ``need`` declares, by name (merged statistics keep
        their parts' slot names and shapes, or override this)."""
        return {s.name: state[s.name] for s in need.slots()}

    def pivots(self) -> list[tuple[str, str, bool]]:
        """Its REPLICA slots, each the pivots of moment sums: ``(SUM slot of
        reference.MOMENTS vectors, REPLICA slot of their pivots, whether y is
        data)`` per pair. Merges, loads and forward's fold re-express two states
        about the pivot set first (``storage.align``), a sync about a reference
        every rank holds, with ``ops.moments_pivot`` (docs/metrics_core.md §3).
        Default: none."""
        return []
