"""Packed state storage: the layout of merged statistics and their buffers.

Every metric keeps its state in ONE float64 buffer per reduction kind
(``SUM``, ``MAX``, ``REPLICA``; see ``d9d_kernels.core.statistic``). A
standalone metric owns a private ``Storage`` (it is a group of one); a
``MetricGroup`` owns one for all its members and re-points them at it.
``Layout`` merges statistics with equal ``merge_key`` and places their slots;
``Storage`` holds the buffers, the synced snapshot and the bookkeeping that
``d9d_kernels.core.sync`` (the sync protocol) and ``d9d_kernels.core.plan``
(update plans) work on.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from typing import Any

import torch

from d9d_kernels.core.statistic import KINDS, MAX, REPLICA, SUM, Slot, Statistic

__all__ = ["Layout", "Storage", "numel"]


def numel(shape) -> int:
    return int(math.prod(shape))


class Layout:
    """Merges statistics with equal ``merge_key`` and places their slots."""

    def __init__(self, owners: list[tuple[str, "Metric"]]):
        self.stats: list[Statistic] = []
        # (label, weak ref to the metric): what sync.member_detail describes on a schema mismatch
        self.owners = [(label, weakref.ref(metric)) for label, metric in owners]
        keys: dict[Any, int] = {}
        self.maps: list[dict[str, int]] = []  # per owner: local stat name -> merged index
        for _, metric in owners:
            m = {}
            for name, stat in metric._stats().items():
                k = stat.merge_key()
                if k in keys:
                    j = keys[k]
                    self.stats[j] = self.stats[j].merge(stat)
                else:
                    j = keys[k] = len(self.stats)
                    self.stats.append(stat)
                m[name] = j
            self.maps.append(m)
        self.sizes = {k: 0 for k in KINDS}
        self.placed: list[list[tuple[Slot, int]]] = []
        inits: dict[str, list[float]] = {k: [] for k in KINDS}
        for stat in self.stats:
            placed = []
            for s in stat.slots():
                if s.kind not in KINDS:
                    raise ValueError(f"{type(stat).__name__}: slot {s.name!r} has unknown kind {s.kind!r}")
                n = numel(s.shape)
                placed.append((s, self.sizes[s.kind]))
                self.sizes[s.kind] += n
                inits[s.kind].extend([float(s.init)] * n)
            self.placed.append(placed)
        self.inits = inits
        lines = ["float64"]
        for i, (label, metric) in enumerate(owners):
            m = self.maps[i]
            lines.append(f"{label}:{type(metric).__qualname__}:" + ",".join(f"{n}->{m[n]}" for n in sorted(m)))
        for j, stat in enumerate(self.stats):
            lines.append(f"{j}:{stat.schema()}@" + ",".join(f"{s.name}:{s.kind}:{o}" for s, o in self.placed[j]))
        lines.append(";".join(f"{k}={self.sizes[k]}" for k in KINDS))
        self.schema = "\n".join(lines)
        self.fingerprint = hashlib.sha256(self.schema.encode()).hexdigest()[:16]

    def views(self, bufs: dict[str, torch.Tensor], j: int, kinds=KINDS) -> dict[str, torch.Tensor]:
        return {
            s.name: bufs[s.kind].narrow(0, o, numel(s.shape)).view(s.shape)
            for s, o in self.placed[j]
            if s.kind in kinds
        }

    def has_replica(self, j: int) -> bool:
        return any(s.kind == REPLICA for s, _ in self.placed[j])


class Storage:
    """One packed float64 buffer per kind + sync/flag bookkeeping."""

    def __init__(self, layout: Layout, device: torch.device, label: str):
        self.layout = layout
        self.label = label
        self.device = torch.device(device)
        self._alloc()
        self.synced: dict[str, torch.Tensor] | None = None
        self.synced_views: list[dict[str, torch.Tensor]] | None = None
        self.pending = None  # d9d_kernels.core.sync.Pending while a sync is in flight
        self.dirty = False
        self.handshakes: dict[tuple, str] = {}

    def _alloc(self):
        self.init = {k: torch.tensor(v, dtype=torch.float64, device=self.device) for k, v in self.layout.inits.items()}
        self.local = {k: v.clone() for k, v in self.init.items()}
        self.local_views = [self.layout.views(self.local, j) for j in range(len(self.layout.stats))]
        # Two snapshot buffers, used in turn, with their views built once: a
        # sync fills one while compute() may still read the other, and a wait
        # costs no per-statistic Python.
        self.snaps = [{k: torch.empty_like(v) for k, v in self.local.items()} for _ in range(2)]
        self.snap_views = [[self.layout.views(b, j) for j in range(len(self.layout.stats))] for b in self.snaps]
        self.next_snap = 0
        self.fold_bufs: dict[tuple[int, int, int], list] = {}  # (snapshot, world, rank) -> sync.folded views
        self.world_ranks: dict[tuple, tuple[int, int]] = {}  # ctx.cache_key -> (world size, rank)
        self.plans: dict = {}  # d9d_kernels.core.plan: input signature -> Plan (buffers changed: start afresh)
        self.compiled: dict = {}  # d9d_kernels.core.compiled: owner id -> PlanRunner (same lifetime as plans)
        self.recording: list | None = None

    # -- state ---------------------------------------------------------------
    def current_views(self) -> list[dict[str, torch.Tensor]]:
        if self.synced_views is not None and not self.dirty:
            return self.synced_views
        return self.local_views

    def run(self, items: list[tuple[int, dict]]) -> None:
        done = set()
        for j, kwargs in items:
            if j in done:
                continue
            done.add(j)
            self.layout.stats[j].update(self.local_views[j], **kwargs)
            if self.recording is not None:
                self.recording.append((j, kwargs))
        self.dirty = True

    def reset(self) -> None:
        for k in (SUM, MAX):
            self.local[k].copy_(self.init[k])
        self.synced = None
        self.synced_views = None
        self.dirty = False
        if self.pending is not None:
            self.pending.discard = True

    def reset_stats(self, idxs) -> None:
        for j in idxs:
            for s, _ in self.layout.placed[j]:
                if s.kind != REPLICA:
                    self.local_views[j][s.name].fill_(s.init)
        self.dirty = True

    def to(self, device) -> None:
        if self.pending is not None:
            raise RuntimeError(f"{self.label}: to() while a sync is in flight; call wait_sync() first")
        device = torch.device(device)
        local = {k: v.to(device) for k, v in self.local.items()}
        synced = None if self.synced is None else {k: v.to(device) for k, v in self.synced.items()}
        self.device = device
        self._alloc()
        for k in KINDS:
            self.local[k].copy_(local[k])
        self.synced = synced
        self.synced_views = None if synced is None else [
            self.layout.views(synced, j) for j in range(len(self.layout.stats))
        ]

    # -- checkpoint ----------------------------------------------------------
    def entry(self) -> dict[str, torch.Tensor]:
        return {k: self.local[k].detach().clone() for k in KINDS if self.layout.sizes[k]}

    def template_entry(self) -> dict[str, torch.Tensor]:
        return {k: torch.empty_like(self.local[k]) for k in KINDS if self.layout.sizes[k]}

    def load_entries(self, entries: list[dict[str, torch.Tensor]]) -> None:
        """Replaces the local state by the merge (sum / max) of ``entries``."""
        bufs = [{k: e.get(k, self.init[k]).to(self.device, torch.float64).clone() for k in KINDS} for e in entries]
        for b in bufs:
            for k in KINDS:
                if b[k].shape != self.local[k].shape:
                    raise ValueError(
                        f"{self.label}: saved {k} state has shape {tuple(b[k].shape)}, "
                        f"expected {tuple(self.local[k].shape)}"
                    )
        if not bufs:
            for k in KINDS:
                self.local[k].copy_(self.init[k])
        elif len(bufs) == 1:
            for k in KINDS:
                self.local[k].copy_(bufs[0][k])
        else:
            for j in range(len(self.layout.stats)):
                if not self.layout.has_replica(j):
                    continue
                stat = self.layout.stats[j]
                views = [self.layout.views(b, j) for b in bufs]
                chosen = stat.choose_replica([{k: v[k] for k in self.layout.views(b, j, (REPLICA,))} for b, v in zip(bufs, views)])
                for v in views:
                    stat.adopt_replica(v, chosen)
            self.local[SUM].copy_(torch.stack([b[SUM] for b in bufs]).sum(0))
            self.local[MAX].copy_(torch.stack([b[MAX] for b in bufs]).amax(0) if self.layout.sizes[MAX] else self.init[MAX])
            self.local[REPLICA].copy_(bufs[0][REPLICA])
        self.handshakes.clear()  # loaded pivots must be aligned again at the next sync
        self.synced = None
        self.synced_views = None
        self.dirty = False
