"""Metric: the lifecycle over a packed state storage.

Every metric keeps its state in ONE float64 buffer per reduction kind
(``SUM``, ``MAX``, ``REPLICA``; see ``d9d_kernels.core.statistic``) held by
a ``d9d_kernels.core.storage.Storage``. A standalone metric owns a private
storage (it is a group of one); a ``MetricGroup`` owns one storage for all
its members and re-points them at it. The sync protocol lives in
``d9d_kernels.core.sync``.

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
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable

import torch

from d9d_kernels.core import sync
from d9d_kernels.core.plan import planned
from d9d_kernels.core.statistic import MAX, SUM, Slot, Statistic
from d9d_kernels.core.storage import Layout, Storage, numel

__all__ = ["Metric", "NAN_STRATEGIES", "HostValues"]

NAN_STRATEGIES = ("propagate", "ignore", "error")
_CUSTOM = "_custom"


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
# Host read handle.
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
            n = numel(shape)
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
        # every update gets the per-signature plan cache (d9d_kernels/core/plan.py)
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
        layout = Layout([(self._label, self)])
        self.__dict__["_storage"] = Storage(layout, self._device, self._label)
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
        sync.trigger(self._storage, ctx)

    def wait_sync(self, ctx=None) -> None:
        """Waits for the collectives of the last ``trigger_sync``."""
        sync.wait(self._storage)

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
        rank, world = sync.rank_world()
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
        world = sync.rank_world()[1]
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
    """Marker base for MetricGroup (defined in d9d_kernels.core.group)."""


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
