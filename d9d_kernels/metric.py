"""Metric: the lifecycle, the packed state storage and the sync protocol.

Every metric keeps its state in ONE float64 buffer per reduction kind
(``SUM``, ``MAX``, ``REPLICA``; see ``d9d_kernels.metrics.statistic``). A
standalone metric owns a private storage (it is a group of one); a
``MetricGroup`` owns one storage for all its members and re-points them at it.

Writing a metric on top of statistics (how the catalogue is built)::

    class MyMetric(dk.Metric):
        def __init__(self, nan_strategy="propagate"):
            super().__init__(nan_strategy=nan_strategy)      # first
            self.skip_bad = nan_strategy == "ignore"

        def _statistics(self) -> dict[str, Statistic]:       # called once, cached
            return {"m": MomentsStatistic(paired=True, skip_bad=self.skip_bad)}

        def update(self, preds, target, weights=None, mask=None) -> None:
            # metadata checks here (raise before any state is touched), then
            # map the update arguments onto each statistic's update kwargs:
            self._feed({"m": dict(x=preds, y=target, weights=weights, mask=mask)})

        def _compute(self, states) -> torch.Tensor:
            m = states["m"]                # {slot name: tensor} of that statistic
            ...

* ``update`` must have an explicit signature: ``MetricGroup.update(**inputs)``
  feeds a member iff the names given cover the required parameters of its
  ``update`` and are all parameters of it.
* ``_feed`` runs each statistic once (in a group: each *merged* statistic once
  per ``g.update`` call, with the inputs of the first member that uses it).
* A statistic's ``bad`` slot (SUM, ``[1]``) counts bad inputs on the device;
  ``compute()`` raises ``ValueError`` with the count when ``_raise_on_bad()``
  (default: ``nan_strategy == "error"``; override for errors that always raise,
  e.g. out-of-range class indices).

Custom metrics with raw slots (no statistic): see ``Metric.add_state``.

Sync protocol: ``trigger_sync`` copies the local buffers into a snapshot
buffer (two, used in turn, allocated once) and
launches ONE async ``all_reduce`` ("sum") of the SUM buffer; a small MAX
buffer (x world size <= ``FOLD_MAX_ELEMS``) rides in it, one row per rank,
and is maxed locally after the wait; a larger one gets its own "max"
all_reduce (at most one collective per kind; REPLICA is never reduced); local state keeps accumulating (cumulative:
a sync is the sum over ranks of each rank's state since ``reset``, so nothing
is counted twice). ``wait_sync`` waits; ``compute`` then uses the synced
snapshot until the next update (a host-side flag, no device sync). The first
sync on a (storage, context) pair compares a schema fingerprint across ranks
(``ctx.check_same``, host-side through the store: not a collective) and aligns
REPLICA slots such as moment pivots (``ctx.exchange``); see docs/metrics_core.md.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
from typing import Any, Callable

import torch

from d9d_kernels.plan import planned
from d9d_kernels.metrics.statistic import KINDS, MAX, REPLICA, SUM, Slot, Statistic

__all__ = ["Metric", "NAN_STRATEGIES", "HostValues"]

NAN_STRATEGIES = ("propagate", "ignore", "error")
#: MAX state x world size (elements) up to which a sync folds the MAX buffer
#: into the one "sum" all_reduce (one row per rank) instead of a second
#: collective: 8192 doubles = 64 KiB extra.
FOLD_MAX_ELEMS = 8192
_CUSTOM = "_custom"


def _numel(shape) -> int:
    return int(math.prod(shape))


# ----------------------------------------------------------------------------
# Layout: merged statistics and where every slot lives in the packed buffers.
# ----------------------------------------------------------------------------


class _Layout:
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
        inits: dict[str, list[float]] = {k: [] for k in KINDS}
        for stat in self.stats:
            placed = []
            for s in stat.slots():
                if s.kind not in KINDS:
                    raise ValueError(f"{type(stat).__name__}: slot {s.name!r} has unknown kind {s.kind!r}")
                n = _numel(s.shape)
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
            s.name: bufs[s.kind].narrow(0, o, _numel(s.shape)).view(s.shape)
            for s, o in self.placed[j]
            if s.kind in kinds
        }

    def has_replica(self, j: int) -> bool:
        return any(s.kind == REPLICA for s, _ in self.placed[j])


class _Pending:
    __slots__ = ("handles", "snapshot", "folded", "discard")

    def __init__(self, handles, snapshot, folded=None):
        self.handles = handles
        self.snapshot = snapshot
        self.folded = folded  # _Storage._folded views when MAX rode in the sum
        self.discard = False


class _Storage:
    """One packed float64 buffer per kind + sync/flag bookkeeping."""

    def __init__(self, layout: _Layout, device: torch.device, label: str):
        self.layout = layout
        self.label = label
        self.device = torch.device(device)
        self._alloc()
        self.synced: dict[str, torch.Tensor] | None = None
        self.synced_views: list[dict[str, torch.Tensor]] | None = None
        self.pending: _Pending | None = None
        self.dirty = False
        self.handshakes: dict[tuple, str] = {}

    def _alloc(self):
        self.init = {k: torch.tensor(v, dtype=torch.float64, device=self.device) for k, v in self.layout.inits.items()}
        self.local = {k: v.clone() for k, v in self.init.items()}
        self.local_views = [self.layout.views(self.local, j) for j in range(len(self.layout.stats))]
        # Two snapshot buffers, used in turn, with their views built once: a
        # sync fills one while compute() may still read the other. Building
        # per-statistic views at every wait_sync was O(K) Python (bench_sync:
        # trigger+wait 4.4x slower at K=64 than at K=1).
        self.snaps = [{k: torch.empty_like(v) for k, v in self.local.items()} for _ in range(2)]
        self.snap_views = [[self.layout.views(b, j) for j in range(len(self.layout.stats))] for b in self.snaps]
        self.next_snap = 0
        self.fold_bufs: dict[tuple[int, int, int], list] = {}  # (snapshot, world, rank) -> _folded views
        self.world_ranks: dict[tuple, tuple[int, int]] = {}  # ctx.cache_key -> (world size, rank)
        self.plans: dict = {}  # d9d_kernels.plan: input signature -> Plan (buffers changed: start afresh)
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

    # -- sync ----------------------------------------------------------------
    def trigger(self, ctx) -> None:
        if self.pending is not None:
            raise RuntimeError(f"{self.label}: trigger_sync() called twice without wait_sync()")
        ctx = _resolve_ctx(ctx)
        if ctx is not None:
            self._handshake(ctx)
        i = self.next_snap
        self.next_snap = 1 - i
        snapshot = self.snaps[i]
        # Launch first, copy the rest after: every op between the ranks'
        # arrival and the launch delays all of them (bench_sync, world 2: the
        # ops before the launch took 40-60 us right after a barrier).
        handles, folded, done = [], None, ()
        if ctx is not None:
            n_max = self.layout.sizes[MAX]
            world, rank = self._world_rank(ctx) if n_max else (1, 0)
            if n_max and n_max * world <= FOLD_MAX_ELEMS:
                folded = self._folded(i, world, rank)
                buf, sums, rows, mine, clean = folded
                if not clean:  # normally zeroed by the last wait, after its collective
                    rows.zero_()
                folded[4] = False
                sums.copy_(self.local[SUM])
                mine.copy_(self.local[MAX])
                handles.append(ctx.all_reduce(buf, "sum"))  # SUM, MAX filled from it at wait
            else:
                for kind, op in ((SUM, "sum"), (MAX, "max")):
                    if snapshot[kind].numel():
                        snapshot[kind].copy_(self.local[kind])
                        handles.append(ctx.all_reduce(snapshot[kind], op))
            done = (SUM, MAX)
        for k, v in self.local.items():
            if k not in done:
                snapshot[k].copy_(v)
        self.pending = _Pending(handles, i, folded)

    def _world_rank(self, ctx) -> tuple[int, int]:
        """(world size, rank) of ``ctx``'s group, asked once per group."""
        key = ctx.cache_key
        wr = self.world_ranks.get(key)
        if wr is None:
            wr = self.world_ranks[key] = (ctx.world_size, ctx.rank)
        return wr

    def _folded(self, i: int, world: int, rank: int) -> list:
        """``[buf, its SUM part, its [world, MAX] rows, this rank's row, rows are zero]``.

        ``buf = [SUM | world x MAX]`` goes through ONE "sum" all_reduce with
        this rank's MAX values in its own row and zeros in the others (x + 0
        is exact, NaN and +-inf included), so the reduced rows hold every
        rank's MAX values. A second gloo collective cost ~0.2 ms at world 2
        and ~4 ms at world 4 here (bench/analysis.md), far more than these
        extra bytes. Allocated once per (snapshot, world, rank); the rows are
        zeroed after each wait (one op less before the launch)."""
        key = (i, world, rank)
        views = self.fold_bufs.get(key)
        if views is None:
            n_sum, n_max = self.layout.sizes[SUM], self.layout.sizes[MAX]
            buf = torch.zeros(n_sum + world * n_max, dtype=torch.float64, device=self.device)
            rows = buf[n_sum:].view(world, n_max)
            views = self.fold_bufs[key] = [buf, buf[:n_sum], rows, rows[rank], True]
        return views

    def wait(self) -> None:
        p = self.pending
        if p is None:
            raise RuntimeError(f"{self.label}: wait_sync() without a pending trigger_sync()")
        self.pending = None
        for h in p.handles:
            h.wait()
        f = p.folded
        if p.discard:  # reset() between trigger and wait: the result is stale
            if f is not None:
                f[2].zero_()
                f[4] = True
            return
        snapshot = self.snaps[p.snapshot]
        if f is not None:
            snapshot[SUM].copy_(f[1])
            torch.amax(f[2], dim=0, out=snapshot[MAX])
            f[2].zero_()
            f[4] = True
        self.synced = snapshot
        self.synced_views = self.snap_views[p.snapshot]
        self.dirty = False

    def _handshake(self, ctx) -> None:
        key = ctx.cache_key
        state = self.handshakes.get(key)
        if state == "done":
            return
        if state is None:
            # the full schema text (not a hash) so the error shows the first difference
            ctx.check_same(
                "d9d_kernels.metric.schema",
                self.layout.schema,
                f"metric schema of {self.label} (members, order, statistics, slot shapes)",
            )
        settled = True
        rep_idx = [j for j in range(len(self.layout.stats)) if self.layout.has_replica(j)]
        if rep_idx:
            # host read of the (small) REPLICA buffer: handshake only, not per step
            mine = json.dumps(self.local[REPLICA].tolist())
            reps = [json.loads(r) for r in ctx.exchange("d9d_kernels.metric.replica", mine)]
            bufs = [{REPLICA: torch.tensor(r, dtype=torch.float64, device=self.device)} for r in reps]
            for j in rep_idx:
                stat = self.layout.stats[j]
                chosen = stat.choose_replica([self.layout.views(b, j, (REPLICA,)) for b in bufs])
                stat.adopt_replica(self.local_views[j], chosen)
                settled = settled and stat.replica_settled(chosen)
        self.handshakes[key] = "done" if settled else "schema"

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


_world_ctx: list = [None, None]  # (world ProcessGroup, its DistributedContext)


def _resolve_ctx(ctx):
    """None = the world group when torch.distributed is initialised, else local."""
    if ctx is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.group.WORLD
        if _world_ctx[0] is not world:  # one context per world group (re-initialised: a new one)
            from d9d_kernels.distributed import DistributedContext

            _world_ctx[:] = world, DistributedContext()
        ctx = _world_ctx[1]
    if ctx.is_local:
        return None
    return ctx


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ----------------------------------------------------------------------------
# Custom metrics: raw slots wrapped in a private statistic.
# ----------------------------------------------------------------------------


class _CustomStatistic(Statistic):
    """The raw slots of one custom metric; never merges with anything."""

    def __init__(self, metric: "Metric"):
        self._metric = metric
        self._slots = list(metric.__dict__["_custom_slots"].values())

    def merge_key(self):
        return ("custom", id(self))

    def merge(self, other):
        return self

    def slots(self):
        return self._slots

    def schema(self) -> str:
        return f"custom:{type(self._metric).__qualname__}:" + super().schema()

    def update(self, state, args=(), kwargs=None):
        self._metric._update(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------
# Host read handle (part 10).
# ----------------------------------------------------------------------------


class HostValues:
    """Results packed into one tensor copied device->host without blocking.

    ``result()`` waits for the copy and returns ``{name: float}`` (a nested
    list for non-scalar results), or a single value for a standalone metric;
    it raises the ``ValueError`` that ``compute()`` would have raised for
    bad-input counts.
    """

    def __init__(self, host, names, shapes, checks, event, single):
        self._host, self._names, self._shapes = host, names, shapes
        self._checks, self._event, self._single = checks, event, single

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def result(self):
        if self._event is not None:
            self._event.synchronize()
        flat = self._host.tolist()
        pos = 0
        out = {}
        for name, shape in zip(self._names, self._shapes):
            n = _numel(shape)
            vals = flat[pos : pos + n]
            pos += n
            out[name] = vals[0] if len(shape) == 0 else torch.tensor(vals, dtype=torch.float64).reshape(shape).tolist()
        for metric in self._checks:
            metric._raise_if_bad(flat[pos])
            pos += 1
        return out[None] if self._single else out


# ----------------------------------------------------------------------------
# Metric
# ----------------------------------------------------------------------------


class _MetricMeta(type):
    """Allocates the storage once the outermost ``__init__`` has run."""

    def __call__(cls, *args, **kwargs):
        obj = super().__call__(*args, **kwargs)
        if obj.__dict__.get("_storage") is None:
            obj._finalize()
        return obj


class Metric(metaclass=_MetricMeta):
    """Base class of every metric and of ``MetricGroup`` (API.md §1).

    Lifecycle: ``update(...)`` -> ``trigger_sync(ctx)`` -> ``wait_sync(ctx)`` ->
    ``compute()``; ``reset()``; ``state_dict()``/``load_state_dict()``
    (``torch.distributed.checkpoint`` Stateful); ``to(device)``;
    ``compute_to_host()`` for logging.

    Custom metric from raw slots (a runnable example; slots are float64 views
    into the packed buffers, read/written as attributes):

    Example:
        >>> import torch, d9d_kernels as dk
        >>> class RootMeanSquare(dk.Metric):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.add_state("sum_sq", kind="sum", shape=())
        ...         self.add_state("count", kind="sum", shape=())
        ...     def _update(self, values):
        ...         self.sum_sq += values.double().square().sum()
        ...         self.count += values.numel()
        ...     def _compute(self, state):
        ...         return (state["sum_sq"] / state["count"]).sqrt()
        >>> m = RootMeanSquare()
        >>> m.update(torch.tensor([3.0, 4.0]))
        >>> m.update(values=torch.tensor([0.0, 0.0, 5.0, 5.0]))
        >>> m.trigger_sync(); m.wait_sync()     # no process group: local
        >>> round(m.compute().item(), 6)
        3.535534
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # every update gets the per-signature plan cache (d9d_kernels/plan.py)
        fn = cls.__dict__.get("update")
        if fn is not None and not getattr(fn, "_d9d_planned", False):
            cls.update = planned(fn)

    def __init__(self, nan_strategy: str = "propagate"):
        if nan_strategy not in NAN_STRATEGIES:
            raise ValueError(
                f"{type(self).__name__}: argument 'nan_strategy' must be one of {NAN_STRATEGIES}, got {nan_strategy!r}"
            )
        d = self.__dict__
        d["nan_strategy"] = nan_strategy
        d["_custom_slots"] = {}
        d["_storage"] = None
        d["_stat_map"] = {}
        d["_stat_cache"] = None
        d["_collector"] = None
        d["_group"] = None
        d["_label"] = type(self).__name__
        d["_device"] = torch.device("cpu")

    # -- declaration API --------------------------------------------------------
    def add_state(self, name: str, kind: str = SUM, shape: tuple[int, ...] = (), init: float | None = None) -> None:
        """Declares a raw state slot of a custom metric (call in ``__init__``).

        Args:
            name: attribute name; ``self.<name>`` is a float64 view of ``shape``.
            kind: ``"sum"`` (all_reduce sum) or ``"max"`` (all_reduce max; store
                a minimum negated).
            shape: tensor shape.
            init: value after ``reset()``; default 0 for sums, -inf for maxima.

        Then write ``_update(self, ...)`` (in-place on ``self.<name>``, or
        ``self.<name> = expr`` which copies into the slot; no host reads) and
        ``_compute(self, state)`` where ``state`` maps names to tensors (the
        synced ones after ``wait_sync``). ``update`` takes ``_update``'s
        arguments.
        """
        if self.__dict__.get("_storage") is not None:
            raise RuntimeError(f"{self._label}: add_state() must be called in __init__")
        if kind not in (SUM, MAX):
            raise ValueError(f"{self._label}: add_state kind must be 'sum' or 'max', got {kind!r}")
        if init is None:
            init = 0.0 if kind == SUM else float("-inf")
        self.__dict__["_custom_slots"][name] = Slot(name, kind, tuple(int(s) for s in shape), float(init))

    def _statistics(self) -> dict[str, Statistic]:
        """The statistics this metric needs, by local name (called once)."""
        if self.__dict__["_custom_slots"]:
            return {_CUSTOM: _CustomStatistic(self)}
        raise NotImplementedError(f"{type(self).__name__} declares neither statistics nor add_state slots")

    def _compute(self, states):
        raise NotImplementedError

    def _update(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__}: custom metrics implement _update")

    def _raise_on_bad(self) -> bool:
        """Whether a non-zero ``bad`` count makes ``compute()`` raise."""
        return self.nan_strategy == "error"

    def _bad_message(self, count: int) -> str:
        return (
            f"{self._label}: {count} invalid input element(s) (NaN/Inf values or out-of-range "
            f"class indices) were counted since the last reset (nan_strategy={self.nan_strategy!r})"
        )

    # -- internals --------------------------------------------------------------
    def _stats(self) -> dict[str, Statistic]:
        if self.__dict__["_stat_cache"] is None:
            self.__dict__["_stat_cache"] = dict(self._statistics())
        return self.__dict__["_stat_cache"]

    def _finalize(self) -> None:
        layout = _Layout([(self._label, self)])
        self.__dict__["_storage"] = _Storage(layout, self._device, self._label)
        self.__dict__["_stat_map"] = layout.maps[0]

    def _feed(self, prepared: dict[str, dict]) -> None:
        """Runs each statistic of this metric on its kwargs (or, inside
        ``MetricGroup.update``, hands them to the group)."""
        collector = self._collector
        if collector is not None:
            collector.append((self, prepared))
            return
        m = self._stat_map
        self._storage.run([(m[name], kw) for name, kw in prepared.items()])

    def _states(self):
        st = self._storage
        views = st.current_views()
        out = {}
        for name, stat in self._stats().items():
            j = self._stat_map[name]
            out[name] = st.layout.stats[j].view(views[j], stat)
        return out

    def _bad_count(self, states) -> torch.Tensor | None:
        if not self._raise_on_bad():
            return None
        bads = [s["bad"].reshape(-1).sum() for s in states.values() if "bad" in s]
        if not bads:
            return None
        return torch.stack(bads).sum()

    def _raise_if_bad(self, count: float) -> None:
        if count != 0:  # NaN counts (impossible) also raise
            raise ValueError(self._bad_message(int(count) if math.isfinite(count) else count))

    def _compute_unchecked(self, states):
        if _CUSTOM in states and len(states) == 1 and self.__dict__["_custom_slots"]:
            return self._compute(states[_CUSTOM])
        return self._compute(states)

    def __getattr__(self, name):
        slots = self.__dict__.get("_custom_slots")
        if slots and name in slots and self.__dict__.get("_storage") is not None:
            j = self.__dict__["_stat_map"][_CUSTOM]
            return self.__dict__["_storage"].local_views[j][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name, value):
        slots = self.__dict__.get("_custom_slots")
        if slots and name in slots:
            view = self.__getattr__(name)
            if value is not view:
                view.copy_(value)
            return
        object.__setattr__(self, name, value)

    # -- lifecycle ----------------------------------------------------------------
    def update(self, *args, **kwargs) -> None:
        """Adds a batch (custom metrics: the arguments of ``_update``)."""
        if not self.__dict__["_custom_slots"]:
            raise NotImplementedError(f"{type(self).__name__} must implement update()")
        self._feed({_CUSTOM: {"args": args, "kwargs": kwargs}})

    def trigger_sync(self, ctx=None) -> None:
        """Snapshots the local state and launches the async collective(s)."""
        self._storage.trigger(ctx)

    def wait_sync(self, ctx=None) -> None:
        """Waits for the collectives of the last ``trigger_sync``."""
        self._storage.wait()

    def compute(self) -> torch.Tensor:
        """Synced value after ``wait_sync`` (until the next update), else local."""
        states = self._states()
        bad = self._bad_count(states)
        if bad is not None:
            self._raise_if_bad(bad.item())
        return self._compute_unchecked(states)

    def reset(self) -> None:
        """Clears local and synced state (device-side fills, no host sync).

        On a member of a group, resets the slots of this member's statistics
        (shared with members that merged into them)."""
        if self._group is not None:
            self._storage.reset_stats(set(self._stat_map.values()))
        else:
            self._storage.reset()

    def to(self, device) -> "Metric":
        if self._group is not None:
            raise RuntimeError(f"{self._label} lives in a MetricGroup's buffers: move the group instead")
        self._storage.to(device)
        self.__dict__["_device"] = torch.device(device)
        return self

    @property
    def device(self) -> torch.device:
        return self._storage.device

    def compute_to_host(self) -> HostValues:
        """Computes and starts ONE non-blocking device->host copy of all values.

        Returns a ``HostValues`` handle; ``.result()`` waits and returns the
        float(s). Bad-input errors are raised by ``.result()``.
        """
        items, checks = self._host_items()
        flat = [v.detach().to(torch.float64).reshape(-1) for _, v in items]
        for _, c in checks:
            flat.append(c.reshape(1))
        packed = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
        event = None
        if packed.is_cuda:
            host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
            host.copy_(packed, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = packed.to("cpu")
        return HostValues(host, [n for n, _ in items], [tuple(v.shape) for _, v in items],
                          [m for m, _ in checks], event, single=not isinstance(self, _GroupBase))

    def _host_items(self):
        states = self._states()
        bad = self._bad_count(states)
        return [(None, self._compute_unchecked(states))], ([] if bad is None else [(self, bad)])

    # -- checkpoint -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's LOCAL state under a rank-specific key (``rank_<r>``),
        plus ``world_size`` and the schema fingerprint (see
        ``d9d_kernels.checkpoint`` for resuming on another world size)."""
        rank, world = _rank_world()
        st = self._storage
        return {"world_size": world, "schema": st.layout.fingerprint, f"rank_{rank}": st.entry()}

    def load_state_dict(self, state_dict: dict[str, Any], *, resharding: bool = False) -> None:
        """Restores local state: the sum (max for MAX slots) of every
        ``rank_<s>`` entry present, re-centred to one pivot; none -> reset.

        A checkpoint saved on another world size must be loaded through
        ``d9d_kernels.checkpoint.for_resume`` (which passes ``resharding=True``):
        loading it directly would silently drop the other saved ranks."""
        st = self._storage
        saved_world = state_dict.get("world_size")
        world = _rank_world()[1]
        if saved_world is not None and int(saved_world) != world and not resharding:
            raise ValueError(
                f"{self._label}: checkpoint saved on {int(saved_world)} ranks, loading on {world}; load it with "
                f"dcp.load({{key: dk.checkpoint.for_resume(metric, {int(saved_world)})}}, ...) so every saved "
                "rank's state is loaded exactly once"
            )
        schema = state_dict.get("schema")
        if schema is not None and schema != st.layout.fingerprint:
            raise ValueError(
                f"{self._label}: checkpoint schema {schema} does not match this metric's "
                f"{st.layout.fingerprint} (different members, order or configuration)"
            )
        keys = sorted((k for k in state_dict if k.startswith("rank_")), key=lambda k: int(k[5:]))
        st.load_entries([state_dict[k] for k in keys])

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _GroupBase(Metric):
    """Marker base for MetricGroup (defined in d9d_kernels.group)."""


def update_signature(metric: Metric) -> tuple[frozenset, frozenset, bool]:
    """(required names, all names, takes **kwargs) of a metric's update."""
    fn: Callable = metric.update
    if type(metric).update is Metric.update:
        fn = metric._update
    req, allp, var = set(), set(), False
    for p in inspect.signature(fn).parameters.values():
        if p.kind == p.VAR_KEYWORD:
            var = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            allp.add(p.name)
            if p.default is p.empty:
                req.add(p.name)
    return frozenset(req), frozenset(allp), var
