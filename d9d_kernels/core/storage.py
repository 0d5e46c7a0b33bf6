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
from d9d_kernels.core.sync import SyncState, member_detail

__all__ = ["Layout", "Storage", "StateEntry", "numel", "check_fits", "format_bytes"]


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
        self.detail = member_detail(owners, self)  # what a schema mismatch across ranks describes

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


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


#: buffers a storage holds per state copy: local, reset values, two sync snapshots
STATE_COPIES = 4
#: ceiling on one metric's state when the free memory cannot be read
STATE_CAP_BYTES = 64 * 2**30


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (CPU: MemAvailable; CUDA: mem_get_info), or None."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError):
        return None
    return None


def check_fits(layout: "Layout", device: torch.device, label: str) -> None:
    """Raises ``ValueError`` naming the state size before anything is
    allocated when the buffers could not fit in memory."""
    one = layout.state_bytes()
    need = STATE_COPIES * one
    avail = available_bytes(device)
    limit = STATE_CAP_BYTES * STATE_COPIES if avail is None else avail
    if need <= limit:
        return
    where = f"{format_bytes(avail)} available on {device}" if avail is not None else \
        f"the {format_bytes(limit)} cap (free memory of {device} unknown)"
    raise ValueError(
        f"{label}: needs {format_bytes(one)} of float64 state (largest slot: {layout.largest_slot()}), "
        f"{format_bytes(need)} with its {STATE_COPIES} buffers (local, reset values, 2 sync snapshots); "
        f"that exceeds {where}. Reduce num_classes / num_bins, or use a metric with O(C) state "
        "(e.g. F1Score instead of ConfusionMatrix)"
    )


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
        """Adds statistic ``jo`` of ``other`` (same schema) into statistic ``j``:
        SUM added, MAX maxed, REPLICA aligned first (``choose_replica`` /
        ``adopt_replica``, e.g. moment sums re-centred to one pivot). ``other``
        is not modified."""
        mine = self.local_views[j]
        theirs = {k: v.to(self.device, copy=True) for k, v in other.local_views[jo].items()}
        placed = self.layout.placed[j]
        stat = self.layout.stats[j]
        reps = [s.name for s, _ in placed if s.kind == REPLICA]
        if reps:
            chosen = stat.choose_replica([{n: mine[n] for n in reps}, {n: theirs[n] for n in reps}])
            stat.adopt_replica(mine, chosen)
            stat.adopt_replica(theirs, chosen)
        for s, _ in placed:
            if s.kind == SUM:
                mine[s.name].add_(theirs[s.name])
            elif s.kind == MAX:
                torch.maximum(mine[s.name], theirs[s.name], out=mine[s.name])
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
        new.sync = SyncState(dict(self.sync.handshakes))
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

    def _reset_kinds(self) -> tuple[str, ...]:
        """The kinds ``reset`` fills: REPLICA too (moment pivots re-picked
        from the next data), unless a sync aligned them across ranks: those
        stay, so the next sync needs no new alignment (one collective)."""
        return (SUM, MAX) if "done" in self.sync.handshakes.values() else KINDS

    def reset(self) -> None:
        for k in self._reset_kinds():
            self.local[k].copy_(self.init[k])
        self._set_synced(None)
        self.dirty = False
        self.discard_pending()

    def discard_pending(self) -> None:
        """The sync in flight, if any, publishes nothing at its wait: the local state was replaced."""
        if self.sync.pending is not None:
            self.sync.pending.discard = True

    def reset_stats(self, idxs) -> None:
        kinds = self._reset_kinds()
        for j in idxs:
            for s, _ in self.layout.placed[j]:
                if s.kind in kinds:
                    self.local_views[j][s.name].fill_(s.init)
        self.dirty = True

    def to(self, device) -> None:
        if self.sync.pending is not None:
            raise RuntimeError(f"{self.label}: to() while a sync is in flight; call wait_sync() first")
        device = resolve_device(device)
        local = {k: v.to(device) for k, v in self.local.items()}
        synced = None if self.synced is None else {k: v.to(device) for k, v in self.synced.items()}
        self.device = device
        self._alloc()
        self.sync = SyncState(self.sync.handshakes)  # its buffers were on the old device
        for k in KINDS:
            self.local[k].copy_(local[k])
        self._set_synced(synced)

    # -- checkpoint ----------------------------------------------------------
    def entry(self) -> StateEntry:
        return StateEntry({k: self.local[k].detach().clone() for k in KINDS if self.layout.sizes[k]}, self.duplicate)

    def template_entry(self) -> StateEntry:
        return StateEntry({k: torch.empty_like(self.local[k]) for k in KINDS if self.layout.sizes[k]})

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
        self.sync.handshakes.clear()  # loaded pivots must be aligned again at the next sync
        self._set_synced(None)
        self.dirty = False
        self.discard_pending()
