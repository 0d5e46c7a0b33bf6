"""Packed state storage: the layout of merged statistics and their buffers.

Every metric keeps its state in ONE float64 buffer per reduction kind
(``SUM``, ``MAX``, ``REPLICA``; see ``d9d_kernels.core.statistic``). A
standalone metric owns a private ``Storage`` (it is a group of one); a
``MetricGroup`` owns one for all its members and re-points them at it.
``Layout`` merges statistics with equal ``merge_key`` and places their slots;
``Storage`` holds the buffers (local, reset values, two sync snapshots) and
the synced snapshot; the sync protocol's bookkeeping is its ``SyncState``
(``d9d_kernels.core.sync``), forward's scratch copy a ``Scratch``
(``d9d_kernels.core.forward``), the update plans ``plans``
(``d9d_kernels.core.plan``).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

from d9d_kernels.core.device import resolve_device
from d9d_kernels.core.statistic import KINDS, MAX, REPLICA, SUM, Slot, Statistic
from d9d_kernels.core.sync import SyncState
from d9d_kernels.memory import check_fits, format_bytes
from d9d_kernels.ops.moments_pivot import consecutive, moments_recenter

__all__ = ["Layout", "Storage", "StateEntry", "numel", "chosen_replica", "align", "combine"]


def numel(shape) -> int:
    return int(math.prod(shape))


class Layout:
    """Merges statistics with equal ``merge_key`` and places their slots."""

    def __init__(self, owners: list[tuple[str, "Metric"]]):
        self.stats: list[Statistic] = []
        keys: dict[Any, int] = {}
        self.maps: list[dict[str, int]] = []  # per owner: local stat name -> merged index
        for _, metric in owners:
            m = {}
            feed = feed_key(metric)
            for name, stat in metric._stats().items():
                k = (stat.merge_key(), feed)
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
        # reset values as runs (offset, length, value), not one float per
        # element: a [200000, 200000] confusion matrix must fail with a clear
        # message, not build a Python list of 4e10 floats first
        runs: dict[str, list[list]] = {k: [] for k in KINDS}
        for stat in self.stats:
            placed = []
            for s in stat.slots():
                if s.kind not in KINDS:
                    raise ValueError(f"{type(stat).__name__}: slot {s.name!r} has unknown kind {s.kind!r}")
                n, o, v = numel(s.shape), self.sizes[s.kind], float(s.init)
                placed.append((s, o))
                self.sizes[s.kind] += n
                r = runs[s.kind]
                if r and (r[-1][2] == v or (math.isnan(v) and math.isnan(r[-1][2]))):
                    r[-1][1] += n
                elif n:
                    r.append([o, n, v])
            self.placed.append(placed)
        self.init_runs = {k: [tuple(r) for r in v] for k, v in runs.items()}
        self.zero_init = {k: all(v == 0.0 for _, _, v in self.init_runs[k]) for k in KINDS}
        lines = ["float64"]
        for i, (label, metric) in enumerate(owners):
            m = self.maps[i]
            lines.append(f"{label}:{type(metric).__qualname__}:" + ",".join(f"{n}->{m[n]}" for n in sorted(m)))
        for j, stat in enumerate(self.stats):
            lines.append(f"{j}:{stat.schema()}@" + ",".join(f"{s.name}:{s.kind}:{o}" for s, o in self.placed[j]))
        lines.append(";".join(f"{k}={self.sizes[k]}" for k in KINDS))
        self.schema = "\n".join(lines)
        self.fingerprint = hashlib.sha256(self.schema.encode()).hexdigest()[:16]
        from d9d_kernels.distributed import member_detail
        self.detail = member_detail(owners, self)  # what a schema mismatch across ranks describes
        # what ranks must agree on to sync: the state schema and every member's configuration
        # (formula-only settings such as average= change no slot but change the value)
        self.sync_schema = self.schema + "\n" + self.detail
        self.pivoted = [j for j in range(len(self.stats)) if self.has_replica(j)]
        for j in self.pivoted:  # a sync moves REPLICA slots as pivots of moment sums (sync.table)
            stat, named = self.stats[j], {p for _, p, _ in self.stats[j].pivots()}
            if {s.name for s, _ in self.placed[j] if s.kind == REPLICA} != named:
                raise ValueError(f"{type(stat).__name__}: every REPLICA slot must be a pivot named by pivots()")

    def views(self, bufs: dict[str, torch.Tensor], j: int, kinds=KINDS) -> dict[str, torch.Tensor]:
        return {
            s.name: bufs[s.kind].narrow(0, o, numel(s.shape)).view(s.shape)
            for s, o in self.placed[j]
            if s.kind in kinds
        }

    def has_replica(self, j: int) -> bool:
        return any(s.kind == REPLICA for s, _ in self.placed[j])

    def state_bytes(self) -> int:
        """Bytes of one copy of the state (all kinds, float64)."""
        return 8 * sum(self.sizes.values())

    def largest_slot(self) -> str:
        """``"<statistic>.<slot> [shape]"`` of the largest slot (for messages)."""
        best = max(((numel(s.shape), j, s) for j, p in enumerate(self.placed) for s, _ in p), default=None,
                   key=lambda t: t[0])
        if best is None:
            return "no slots"
        _, j, s = best
        return f"{type(self.stats[j]).__name__}.{s.name} {list(s.shape)}"


def feed_key(metric) -> str:
    """What computes the inputs ``metric`` feeds its statistics (merged only when equal and fed
    alike): the library's updates feed shared statistics the same inputs, any other ``update`` is its own."""
    fn = type(metric).update
    fn = getattr(fn, "__wrapped__", fn)
    module = getattr(fn, "__module__", "") or ""
    return "d9d_kernels" if module.startswith("d9d_kernels.") else f"{module}.{fn.__qualname__}"


def chosen_replica(stat: Statistic, mine: dict, theirs: dict) -> dict:
    """The pivots two states of ``stat`` are re-expressed about: per component, ``mine``'s where set, else ``theirs``."""
    return {p: torch.where(torch.isnan(mine[p]), theirs[p], mine[p]) for _, p, _ in stat.pivots()}


def adopt(stat: Statistic, state: dict, pivots: dict) -> None:
    """Re-expresses ``state`` (views of ``stat``) about ``pivots`` (by slot name), which its REPLICA slots then hold."""
    for m, p, _ in stat.pivots():
        piv = state[p]
        moments_recenter(state[m].view(-1), piv.view(-1), pivots[p].reshape(-1),
                         consecutive(piv.numel() // 2, False, piv.device))


def align(stat: Statistic, mine: dict, theirs: dict) -> None:
    """Re-expresses two states of ``stat`` (views, all kinds) about their ``chosen_replica``."""
    chosen = chosen_replica(stat, mine, theirs)
    adopt(stat, mine, chosen)
    adopt(stat, theirs, chosen)


def combine(layout: Layout, j: int, mine: dict, theirs: dict) -> None:
    """Adds ``theirs`` into ``mine`` (statistic ``j``'s views): REPLICA
    aligned first (``align``), SUM added, MAX maxed: the rule of merges and
    loads of several entries (forward's fold takes the same choice)."""
    if layout.has_replica(j):
        align(layout.stats[j], mine, theirs)
    for s, _ in layout.placed[j]:
        if s.kind == SUM:
            mine[s.name].add_(theirs[s.name])
        elif s.kind == MAX:
            torch.maximum(mine[s.name], theirs[s.name], out=mine[s.name])


class StateEntry:
    """One rank's local buffers in a checkpoint: ``entry["sum"]`` etc.

    Not a ``dict`` on purpose: ``torch.distributed.checkpoint`` saves it as
    one pickled object rather than as shaped tensors, so loading it into a
    metric of another schema reaches ``Metric.load_state_dict`` (and its
    ``ValueError``) instead of failing in DCP's planner on a size mismatch.
    ``duplicate``: a copy of another rank's data (``DistributedContext.duplicate``); resharding skips it.
    """

    duplicate = False  # entries pickled before the flag existed

    def __init__(self, bufs: dict[str, torch.Tensor], duplicate: bool = False):
        self.bufs = dict(bufs)
        self.duplicate = duplicate

    def __getitem__(self, kind: str) -> torch.Tensor:
        return self.bufs[kind]

    def get(self, kind: str, default=None):
        return self.bufs.get(kind, default)

    def keys(self):
        return self.bufs.keys()

    def items(self):
        return self.bufs.items()

    def __contains__(self, kind) -> bool:
        return kind in self.bufs

    def __repr__(self) -> str:
        return "StateEntry({" + ", ".join(f"{k!r}: f64{list(v.shape)}" for k, v in self.bufs.items()) + "})"


class Storage:
    """One packed float64 buffer per kind + sync/flag bookkeeping."""

    def __init__(self, layout: Layout, device: torch.device, label: str):
        self.layout = layout
        self.label = label
        self.device = resolve_device(device)
        check_fits(layout, self.device, label)
        self._alloc()
        self.synced: dict[str, torch.Tensor] | None = None
        self.synced_views: list[dict[str, torch.Tensor]] | None = None
        self.dirty = False
        self.sync = SyncState()
        self.duplicate = False  # set by each sync (its context's ``duplicate``) and by loads; saved with the state

    def _alloc(self):
        try:
            self.init = {k: self._filled(k) for k in KINDS}
            self.local = {k: v.clone() for k, v in self.init.items()}
            snaps = [{k: torch.empty_like(v) for k, v in self.local.items()} for _ in range(2)]
        except (MemoryError, torch.OutOfMemoryError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and "alloc" not in str(e).lower() and "memory" not in str(e).lower():
                raise
            raise ValueError(
                f"{self.label}: needs {format_bytes(self.layout.state_bytes())} of float64 state (largest slot: "
                f"{self.layout.largest_slot()}) and allocating its buffers on {self.device} failed: {e}"
            ) from None
        self.local_views = [self.layout.views(self.local, j) for j in range(len(self.layout.stats))]
        self.snapshots = [(b, [self.layout.views(b, j) for j in range(len(self.layout.stats))]) for b in snaps]
        self.plans: dict = {}  # d9d_kernels.core.plan: input signature -> Plan (buffers changed: start afresh)
        self.paths: dict = {}  # name -> how its update ran at each recording (Metric.explain)
        self.scratch = None  # d9d_kernels.core.forward.Scratch, made at the first forward
        self.touched: set | None = None  # inside a forward: the statistics the update ran

    def _filled(self, kind: str) -> torch.Tensor:
        buf = torch.zeros(self.layout.sizes[kind], dtype=torch.float64, device=self.device)
        for o, m, v in self.layout.init_runs[kind]:
            if v != 0.0:
                buf[o : o + m] = v
        return buf

    # -- state ---------------------------------------------------------------
    def current_views(self) -> list[dict[str, torch.Tensor]]:
        if self.synced_views is not None and not self.dirty:
            return self.synced_views
        return self.local_views

    def run(self, items: list[tuple[int, dict]]) -> None:
        done = set()
        touched = self.touched
        for j, kwargs in items:
            if j in done:
                continue
            done.add(j)
            if touched is not None:
                touched.add(j)
            self.layout.stats[j].update(self.local_views[j], **kwargs)
        self.dirty = True

    # -- merge: another storage's state added into this one ------------------------
    def merge_stat(self, j: int, other: "Storage", jo: int) -> None:
        """Adds statistic ``jo`` of ``other`` (same schema) into statistic ``j``
        (``combine``). ``other`` is not modified."""
        theirs = {k: v.to(self.device, copy=True) for k, v in other.local_views[jo].items()}
        combine(self.layout, j, self.local_views[j], theirs)
        self.dirty = True

    def __deepcopy__(self, memo) -> "Storage":
        """An independent copy (``Metric.clone``): same layout (its statistics
        copied with ``memo``, so custom statistics point at the cloned metric),
        fresh buffers with this state; plans and sync handles are not copied."""
        import copy

        if self.sync.pending is not None:
            raise RuntimeError(f"{self.label}: clone() while a sync is in flight; call wait_sync() first")
        new = Storage.__new__(Storage)
        memo[id(self)] = new
        new.layout = copy.deepcopy(self.layout, memo)
        new.label = self.label
        new.device = self.device
        new._alloc()
        for k in KINDS:
            new.local[k].copy_(self.local[k])
        new._set_synced(None if self.synced is None else {k: v.clone() for k, v in self.synced.items()})
        new.dirty = self.dirty
        new.sync = self.sync.copied(self.device)
        new.duplicate = self.duplicate
        return new

    def __getstate__(self) -> dict:
        """Pickle: the layout, the local state and the synced snapshot. What
        refers to this process (compiled runners, update plans, forward
        scratch, sync handshakes with its process groups) is left out and
        rebuilt lazily; REPLICA pivots are aligned again at the next sync."""
        if self.sync.pending is not None:
            raise RuntimeError(f"{self.label}: pickled while a sync is in flight; call wait_sync() first")
        return {"layout": self.layout, "label": self.label, "device": self.device,
                "local": {k: v.detach() for k, v in self.local.items()},
                "synced": None if self.synced is None else {k: v.detach() for k, v in self.synced.items()},
                "dirty": self.dirty}

    def __setstate__(self, state: dict) -> None:
        self.layout, self.label, self.device = state["layout"], state["label"], state["device"]
        self._alloc()
        for k in KINDS:
            self.local[k].copy_(state["local"][k])
        synced = state["synced"]
        self._set_synced(None if synced is None else {k: v.to(self.device, copy=True) for k, v in synced.items()})
        self.dirty = state["dirty"]
        self.sync = SyncState()
        self.duplicate = False  # this process' role: the next sync records it

    def _set_synced(self, synced: dict[str, torch.Tensor] | None) -> None:
        """``synced`` (buffers per kind, or None) as the synced snapshot, with its views."""
        self.synced = synced
        self.synced_views = None if synced is None else [
            self.layout.views(synced, j) for j in range(len(self.layout.stats))
        ]

    def reset(self) -> None:
        """Every slot to its reset value, pivots included (the next data picks
        them afresh: a result never depends on what came before a reset)."""
        for k in KINDS:
            self.local[k].copy_(self.init[k])
        self._set_synced(None)
        self.dirty = False
        self.discard_pending()

    def discard_pending(self) -> None:
        """The sync in flight, if any, publishes nothing at its wait: the local state was replaced."""
        if self.sync.pending is not None:
            self.sync.pending.discard = True

    def fill(self, views: dict[str, torch.Tensor], j: int) -> None:
        """Statistic ``j``'s slots in ``views`` (one buffer set's) to their reset values."""
        for s, _ in self.layout.placed[j]:
            views[s.name].fill_(s.init)

    def reset_stats(self, idxs) -> None:
        """Statistics ``idxs`` to their reset values in the local state and in
        the synced snapshot (the other statistics keep theirs, synced ones
        included); a sync in flight publishes them reset."""
        for j in idxs:
            self.fill(self.local_views[j], j)
            if self.synced_views is not None:
                self.fill(self.synced_views[j], j)
        if self.sync.pending is not None:
            self.sync.pending.cleared.update(idxs)

    def owns(self, t: torch.Tensor) -> bool:
        """Whether ``t`` shares memory with one of this storage's buffers."""
        ptr = t.untyped_storage().data_ptr()
        bufs = [*self.local.values(), *self.init.values()]
        for b, _ in self.snapshots:
            bufs += b.values()
        if self.scratch is not None:
            bufs += self.scratch.bufs.values()
        return any(b.untyped_storage().data_ptr() == ptr for b in bufs if b.numel())

    def to(self, device) -> None:
        if self.sync.pending is not None:
            raise RuntimeError(f"{self.label}: to() while a sync is in flight; call wait_sync() first")
        device = resolve_device(device)
        local = {k: v.to(device) for k, v in self.local.items()}
        synced = None if self.synced is None else {k: v.to(device) for k, v in self.synced.items()}
        self.device = device
        self._alloc()
        self.sync = self.sync.copied(device)  # its buffers were on the old device
        for k in KINDS:
            self.local[k].copy_(local[k])
        self._set_synced(synced)

    # -- checkpoint ----------------------------------------------------------
    def entry(self) -> StateEntry:
        return StateEntry({k: self.local[k].detach().clone() for k in KINDS if self.layout.sizes[k]}, self.duplicate)

    def template_entry(self) -> StateEntry:
        return StateEntry({k: torch.empty_like(self.local[k]) for k in KINDS if self.layout.sizes[k]})

    def load_entries(self, entries: list) -> None:
        """Replaces the local state by the ``combine`` of ``entries`` (checked
        by ``check_entry``; none: reset values)."""
        bufs = [{k: e[k].to(self.device, torch.float64, copy=True) if k in e.keys() else self.init[k].clone()
                 for k in KINDS} for e in entries]
        acc = bufs[0] if bufs else {k: v.clone() for k, v in self.init.items()}
        for b in bufs[1:]:
            for j in range(len(self.layout.stats)):
                combine(self.layout, j, self.layout.views(acc, j), self.layout.views(b, j))
        for k in KINDS:
            self.local[k].copy_(acc[k])
        self._set_synced(None)
        self.dirty = False
        self.discard_pending()
