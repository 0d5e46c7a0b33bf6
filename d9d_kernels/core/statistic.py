"""Statistic: the unit of state and kernel sharing inside a MetricGroup.

A metric does not own tensors directly: it declares the sufficient
statistics it needs (``Metric._statistics()``), each produced by ONE kernel
call per update. In a group, statistics with equal ``merge_key()`` are merged
(``merge``) into one statistic that serves every member: one packed state
slice, one kernel call per ``g.update(...)``. E.g. Accuracy(top_k=1),
Accuracy(top_k=5), F1Score(macro) and ConfusionMatrix on the same
``num_classes``/``ignore_index`` become one ``class_stats`` call with
``top_ks=(1, 5)`` and a confusion matrix.

Contract for implementations (see the docstrings below):
* ``slots()`` is a pure function of the statistic's configuration.
* ``update(state, **inputs)`` only calls ops / in-place tensor ops on the
  ``state`` views: no host sync, no data-dependent shapes.
* ``view(state, need)`` returns the tensors that the statistic ``need`` (one
  of the statistics merged into ``self``) would have had on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

import torch

SUM = "sum"  # all_reduce SUM across ranks
MAX = "max"  # all_reduce MAX across ranks (a min is stored negated)
REPLICA = "replica"  # identical on every rank after the first sync; never reduced (e.g. pivots)
KINDS = (SUM, MAX, REPLICA)


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


class Statistic:
    """Sufficient statistics of one kernel call (abstract)."""

    #: names of the ``update`` keyword inputs this statistic consumes, e.g.
    #: ("preds", "target", "mask"); the metric maps its update args onto these.
    inputs: tuple[str, ...] = ()

    def merge_key(self) -> Hashable:
        """Statistics with equal keys are merged into one in a group."""
        raise NotImplementedError

    def merge(self, other: "Statistic") -> "Statistic":
        """A statistic that provides everything ``self`` and ``other`` provide."""
        raise NotImplementedError

    def slots(self) -> list[Slot]:
        raise NotImplementedError

    def update(self, state: dict[str, torch.Tensor], **inputs) -> None:
        """Adds one batch into ``state`` (views into the packed buffers)."""
        raise NotImplementedError

    def bind(self, sample: dict) -> Callable[[dict[str, torch.Tensor], dict], None]:
        """``fn(state, inputs)`` equivalent to ``update(state, **inputs)`` for
        every ``inputs`` whose metadata (shapes, dtypes, devices, Python
        types) equals ``sample``'s, which already passed ``update`` once.
        Override to skip the op wrapper's checks (d9d_kernels/core/plan.py)."""
        update = self.update
        return lambda state, inputs: update(state, **inputs)

    def view(self, state: dict[str, torch.Tensor], need: "Statistic") -> dict[str, torch.Tensor]:
        """The part of ``state`` that ``need`` (merged into self) asked for."""
        return state

    # ------------------------------------------------------------------
    # Optional hooks (defaults fit statistics without REPLICA slots).
    # ------------------------------------------------------------------

    def schema(self) -> str:
        """A rank-independent description of the configuration, compared
        across ranks at the first sync (never contains ids or addresses)."""
        slots = ",".join(f"{s.name}:{s.kind}:{tuple(s.shape)}" for s in self.slots())
        return f"{type(self).__qualname__}[{slots}]"

    def choose_replica(self, replicas: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The REPLICA values every rank adopts, given each rank's (in rank
        order, or each saved state's when merging checkpoints). Default: the
        first one."""
        return {k: v.clone() for k, v in replicas[0].items()}

    def adopt_replica(self, state: dict[str, torch.Tensor], replica: dict[str, torch.Tensor]) -> None:
        """Re-expresses ``state`` (this rank's local views, all kinds) relative
        to ``replica`` and writes ``replica`` into its REPLICA slots. Torch
        ops only. Default: plain copy (no SUM/MAX slot depends on it)."""
        for k, v in replica.items():
            state[k].copy_(v)

    def replica_settled(self, replica: dict[str, torch.Tensor]) -> bool:
        """False while the chosen replica is still undetermined (e.g. no rank
        has seen data to set a pivot): the handshake is repeated at the next
        sync. May read ``replica`` on the host (handshake time only)."""
        return True
