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

from d9d_kernels import _extension
from d9d_kernels.core.device import resolve_device
from d9d_kernels.core.statistic import KINDS, MAX, REPLICA, SUM, Slot, Statistic

__all__ = ["Layout", "Storage", "StateEntry", "numel", "check_fits", "format_bytes"]


# csrc/cpu/forward_scratch.cpp: a forward's scratch reset and fold, one call each
_SCRATCH_RANGES = _extension.host_function("scratch_ranges")
_KIND_CODES = {SUM: 0, MAX: 1, REPLICA: 2}


class FoldRanges:
    """Forward's scratch ranges of a set of statistics: ``ranges``, per range
    ``(kind, state view, scratch view, reset-value view or None)``; with
    ``native`` (CPU buffers and the extension), the same as the argument lists
    of one ``_C.scratch_ranges`` call each: ``reset`` (every range but
    REPLICA's, then all of REPLICA copied from the state) and ``fold``."""

    __slots__ = ("ranges", "native", "reset", "fold")

    def __init__(self, ranges: tuple, replica: tuple | None, native: bool):
        """``replica``: the whole REPLICA (state, scratch) buffers, or None when empty."""
        self.ranges = ranges
        self.native = native
        coded = [(_KIND_CODES[k], loc, scr, init) for k, loc, scr, init in ranges]
        self.fold = coded
        self.reset = [r for r in coded if r[0] != _KIND_CODES[REPLICA]]
        if replica is not None:
            self.reset.append((_KIND_CODES[REPLICA], *replica, None))


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

    def __getstate__(self) -> dict:
        """Pickle / deepcopy: the owners as strong references (weak ones do not
        pickle; the metrics are pickled with the layout's storage anyway)."""
        state = self.__dict__.copy()
        state["owners"] = [(label, ref()) for label, ref in self.owners]
        return state

    def __setstate__(self, state: dict) -> None:
        owners = state.pop("owners")
        self.__dict__.update(state)
        self.owners = [(label, _dead if m is None else weakref.ref(m)) for label, m in owners]

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


def _dead() -> None:
    """A weak reference whose metric was gone when its layout was pickled."""
    return None


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
    """

    def __init__(self, bufs: dict[str, torch.Tensor]):
        self.bufs = dict(bufs)

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
        self.pending = None  # d9d_kernels.core.sync.Pending while a sync is in flight
        self.dirty = False
        self.handshakes: dict[tuple, str] = {}

    def _alloc(self):
        try:
            self.init = {k: self._filled(k) for k in KINDS}
            self.local = {k: v.clone() for k, v in self.init.items()}
            # Two snapshot buffers, used in turn, with their views built once: a
            # sync fills one while compute() may still read the other, and a wait
            # costs no per-statistic Python.
            self.snaps = [{k: torch.empty_like(v) for k, v in self.local.items()} for _ in range(2)]
        except (MemoryError, torch.OutOfMemoryError, RuntimeError) as e:
            if isinstance(e, RuntimeError) and "alloc" not in str(e).lower() and "memory" not in str(e).lower():
                raise
            raise ValueError(
                f"{self.label}: needs {format_bytes(self.layout.state_bytes())} of float64 state (largest slot: "
                f"{self.layout.largest_slot()}) and allocating its buffers on {self.device} failed: {e}"
            ) from None
        self.local_views = [self.layout.views(self.local, j) for j in range(len(self.layout.stats))]
        self.snap_views = [[self.layout.views(b, j) for j in range(len(self.layout.stats))] for b in self.snaps]
        self.next_snap = 0
        self.fold_bufs: dict[tuple[int, int, int], list] = {}  # (snapshot, world, rank) -> sync.folded views
        self.world_ranks: dict[tuple, tuple[int, int]] = {}  # ctx.cache_key -> (world size, rank)
        self.plans: dict = {}  # d9d_kernels.core.plan: input signature -> Plan (buffers changed: start afresh)
        self.compiled: dict = {}  # d9d_kernels.core.compiled: owner id -> Runner; same lifetime as plans
        self.recording: list | None = None
        self.scratch: dict[str, torch.Tensor] | None = None  # forward's batch state, allocated at the first forward
        self.scratch_views: list[dict[str, torch.Tensor]] | None = None
        self.scratch_bufs: tuple = ()  # the scratch buffers (core.metric.detach_from)
        self.scratch_states: dict = {}  # metric id -> its states on the scratch views (Metric._states)
        self.scratch_dirty: FoldRanges | None = None  # ranges the last forward wrote (re-filled at the next)
        self.saved_views: list | None = None  # local views while a forward runs on the scratch
        self.touched: set | None = None  # statistics run during a forward
        self.fold_cache: dict = {}  # frozenset of statistics -> _fold_ranges

    def _filled(self, kind: str) -> torch.Tensor:
        n = self.layout.sizes[kind]
        runs = self.layout.init_runs[kind]
        if len(runs) == 1 and runs[0][1] == n:
            return torch.full((n,), runs[0][2], dtype=torch.float64, device=self.device)
        buf = torch.zeros(n, dtype=torch.float64, device=self.device)
        for o, m, v in runs:
            if v != 0.0:
                buf[o : o + m] = v
        return buf

    # -- state ---------------------------------------------------------------
    def current_views(self) -> list[dict[str, torch.Tensor]]:
        if self.synced_views is not None and not self.dirty:
            return self.synced_views
        return self.local_views

    def current_buffers(self) -> dict[str, torch.Tensor]:
        """The flat buffers (per kind) ``current_views()`` point into."""
        if self.synced_views is not None and not self.dirty:
            return self.synced
        return self.local

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
            if self.recording is not None:
                self.recording.append((j, kwargs))
        self.dirty = True

    # -- forward: the batch's state in a scratch copy, then folded in -------------
    def forward_begin(self) -> None:
        """Points the update at the scratch copy of the buffers (reset;
        REPLICA slots: the local values, so batch moments share the state's
        pivots) and starts recording which statistics the update runs.

        The scratch is allocated at the first forward of this storage and
        kept reset between forwards by re-filling only the ranges the last
        forward wrote: a forward allocates nothing, and a small member's
        forward never touches a large confusion matrix elsewhere in the group."""
        if self.saved_views is not None:
            raise RuntimeError(f"{self.label}: forward() called while another forward of the same storage runs")
        sc = self.scratch
        if sc is None:
            try:
                # normal tensors even inside torch.inference_mode(): a later
                # forward outside it writes them in place
                with torch.inference_mode(False):
                    sc = {k: v.clone() for k, v in self.init.items()}
            except (MemoryError, torch.OutOfMemoryError, RuntimeError) as e:
                raise ValueError(
                    f"{self.label}: forward() needs one more copy of the state ({format_bytes(self.layout.state_bytes())}"
                    f" of float64) for the batch, and allocating it on {self.device} failed: {e}; use update() and "
                    "compute() instead"
                ) from None
            self.scratch = sc
            self.scratch_bufs = tuple(sc.values())
            with torch.inference_mode(False):
                self.scratch_views = [self.layout.views(sc, j) for j in range(len(self.layout.stats))]
            dirty = self._fold_ranges(frozenset())  # a fresh copy of the reset values: the REPLICA copy only
        else:
            dirty = self.scratch_dirty
        if dirty.native and not torch.compiler.is_compiling():  # traced: the torch ops below
            _SCRATCH_RANGES(dirty.reset, False)
        else:
            for kind, _, scr, init in dirty.ranges:
                if kind != REPLICA:
                    if init is None:
                        scr.zero_()
                    else:
                        scr.copy_(init)
            if self.layout.sizes[REPLICA]:
                sc[REPLICA].copy_(self.local[REPLICA])
        self.touched = set()
        self.saved_views = self.local_views
        self.local_views = self.scratch_views

    def forward_end(self, fold: bool = True) -> list[dict[str, torch.Tensor]]:
        """Restores the local views and folds the scratch ranges of the
        statistics the update ran into the local state (SUM added, MAX maxed,
        REPLICA copied); returns the scratch views (the batch's state).

        REPLICA: an update only sets *unset* values (a pivot is set from the
        first valid element, then fixed), and a statistic with an unset pivot
        holds sums about 0 (zero, or already non-finite), exactly what the
        kernel would have added to had it run on the state: so copying the
        scratch's pivots over is the direct update's result. ``fold=False``
        (the update raised) leaves the state as it was."""
        self.local_views = self.saved_views
        self.saved_views = None
        ranges = self.scratch_dirty = self._fold_ranges(frozenset(self.touched))
        self.touched = None
        if not fold:
            return self.scratch_views
        if ranges.native and not torch.compiler.is_compiling():
            _SCRATCH_RANGES(ranges.fold, True)
        else:
            for kind, loc, scr, init in ranges.ranges:
                if kind == SUM:
                    loc.add_(scr if init is None else scr - init)  # non-zero reset values: the batch's part only
                elif kind == MAX:  # the kernels' nan_maximum: NaN wins, a tie (+-0) takes the batch's
                    loc.copy_(torch.where((loc > scr) | loc.isnan(), loc, scr))
                else:
                    loc.copy_(scr)
        self.dirty = True
        return self.scratch_views

    def _fold_ranges(self, js: frozenset) -> "FoldRanges":
        """The contiguous ranges of the statistics ``js`` in the state and
        the scratch (a statistic's slots of one kind are adjacent; adjacent
        statistics merge into one range)."""
        hit = self.fold_cache.get(js)
        if hit is not None:
            return hit
        with torch.inference_mode(False):  # cached views: usable in and outside inference mode
            hit = self.fold_cache[js] = self._make_fold_ranges(js)
        return hit

    def _make_fold_ranges(self, js: frozenset) -> "FoldRanges":
        out = []
        for kind in KINDS:
            spans = []
            for j in sorted(js):
                offs = [(o, numel(s.shape)) for s, o in self.layout.placed[j] if s.kind == kind]
                if offs:
                    a = min(o for o, _ in offs)
                    b = max(o + n for o, n in offs)
                    if spans and spans[-1][1] == a:
                        spans[-1][1] = b
                    else:
                        spans.append([a, b])
            zero = self.layout.zero_init[kind]
            for a, b in spans:
                if b > a:
                    init = None if zero else self.init[kind][a:b]
                    out.append((kind, self.local[kind][a:b], self.scratch[kind][a:b], init))
        replica = (self.local[REPLICA], self.scratch[REPLICA]) if self.layout.sizes[REPLICA] else None
        return FoldRanges(tuple(out), replica, native=_SCRATCH_RANGES is not None and self.device.type == "cpu")

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

        if self.pending is not None:
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
        new.pending = None
        new.dirty = self.dirty
        new.handshakes = dict(self.handshakes)
        return new

    def __getstate__(self) -> dict:
        """Pickle: the layout, the local state and the synced snapshot. What
        refers to this process (compiled runners, update plans, forward
        scratch, sync handshakes with its process groups) is left out and
        rebuilt lazily; REPLICA pivots are aligned again at the next sync."""
        if self.pending is not None:
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
        self.pending = None
        self.dirty = state["dirty"]
        self.handshakes = {}

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
        return (SUM, MAX) if "done" in self.handshakes.values() else KINDS

    def reset(self) -> None:
        for k in self._reset_kinds():
            self.local[k].copy_(self.init[k])
        self._set_synced(None)
        self.dirty = False
        self.discard_pending()

    def discard_pending(self) -> None:
        """The sync in flight, if any, publishes nothing at its wait: the local state was replaced."""
        if self.pending is not None:
            self.pending.discard = True

    def reset_stats(self, idxs) -> None:
        kinds = self._reset_kinds()
        for j in idxs:
            for s, _ in self.layout.placed[j]:
                if s.kind in kinds:
                    self.local_views[j][s.name].fill_(s.init)
        self.dirty = True

    def to(self, device) -> None:
        if self.pending is not None:
            raise RuntimeError(f"{self.label}: to() while a sync is in flight; call wait_sync() first")
        device = resolve_device(device)
        local = {k: v.to(device) for k, v in self.local.items()}
        synced = None if self.synced is None else {k: v.to(device) for k, v in self.synced.items()}
        self.device = device
        self._alloc()
        for k in KINDS:
            self.local[k].copy_(local[k])
        self._set_synced(synced)

    # -- checkpoint ----------------------------------------------------------
    def entry(self) -> StateEntry:
        return StateEntry({k: self.local[k].detach().clone() for k in KINDS if self.layout.sizes[k]})

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
        self.handshakes.clear()  # loaded pivots must be aligned again at the next sync
        self._set_synced(None)
        self.dirty = False
        self.discard_pending()
