"""Metric: the lifecycle over a packed state storage.

Every metric keeps its state in ONE float64 buffer per reduction kind
(``SUM``, ``MAX``, ``REPLICA``; see ``d9d_kernels.core.statistic``) held by
a ``d9d_kernels.core.storage.Storage``. A standalone metric owns a private
storage (it is a group of one); a ``MetricGroup`` owns one storage for all
its members and re-points them at it. The sync protocol lives in
``d9d_kernels.core.sync``.

A metric declares ``_statistics()`` (``{name: Statistic}``), an ``update``
that checks metadata and hands each statistic its inputs (``_feed``), and
``_compute(states)``; CONTRIBUTING.md walks through one.

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

import copy
import inspect
import math
import warnings
from typing import TYPE_CHECKING, Any, Callable

import torch

from d9d_kernels.core import sync
from d9d_kernels.core.forward import run as run_forward
from d9d_kernels.core.device import resolve_device
from d9d_kernels.core.plan import planned
from d9d_kernels.core.statistic import MAX, SUM, Slot, Statistic
from d9d_kernels.core.storage import Layout, Storage, numel
from d9d_kernels.reporting import (BAD_CAUSES, HostValues, bad_causes_hint, copy_to_host, host_checks, poisoned,
                                   raising_count)
from d9d_kernels.torchmetrics_args import take_settings


__all__ = ["Metric", "NAN_STRATEGIES", "HostValues", "host_checks", "poisoned"]

NAN_STRATEGIES = ("propagate", "ignore", "error")
_CUSTOM = "_custom"

# ---- Custom metrics: raw slots wrapped in a private statistic --------------


class SlotAttribute:
    """``metric.<name>`` of an ``add_state`` slot: its float64 view into the
    packed buffers; assigning copies into the view. On an instance without
    that slot, a plain attribute."""

    def __init__(self, name: str):
        self.name = name

    @staticmethod
    def install(cls: type, name: str) -> bool:
        """Puts the attribute on ``cls`` (once); False when ``name`` is taken by something else."""
        attr = getattr(cls, name, None)
        if attr is None:
            setattr(cls, name, SlotAttribute(name))
        return attr is None or isinstance(attr, SlotAttribute)

    def __get__(self, obj, cls=None):
        if obj is None:
            return self
        d = obj.__dict__
        if self.name in d.get("_custom_slots", ()) and d.get("_storage") is not None:
            return d["_storage"].local_views[d["_stat_map"][_CUSTOM]][self.name]
        if self.name in d:
            return d[self.name]
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {self.name!r} (yet: slots are "
                             "reachable once __init__ has returned)")

    def __set__(self, obj, value) -> None:
        if self.name not in obj.__dict__.get("_custom_slots", ()):
            obj.__dict__[self.name] = value
            return
        view = self.__get__(obj)
        if value is not view:
            view.copy_(value)


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


# ---- Metric ----------------------------------------------------------------


class _MetricMeta(type):
    """Takes torchmetrics' ``Metric`` keyword arguments, then allocates the
    storage once the outermost ``__init__`` has run."""

    def __call__(cls, *args, **kwargs):
        take_settings(cls, kwargs)
        obj = super().__call__(*args, **kwargs)
        if obj.__dict__.get("_storage") is None:
            obj._finalize()
        return obj


if TYPE_CHECKING:  # for a type checker, what d9d_kernels.d9d.register makes it at run time: a d9d Metric
    from d9d.metric import Metric as _Base
else:
    _Base = object


class Metric(_Base, metaclass=_MetricMeta):
    """Base class of every metric and of ``MetricGroup``.

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

    #: The update depends on the state it writes (RunningMean's ring slot), so
    #: a scratch copy of reset state cannot stand in for it: ``forward`` (and a
    #: group's forward) runs such an update on the state itself and reads the
    #: batch's value back with ``_batch_value()``.
    _forward_on_state = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # the library's updates get the per-signature plan cache (d9d_kernels/core/plan.py); a user
        # subclass's update runs as written at every call (its super().update(...) is planned)
        fn = cls.__dict__.get("update")
        if fn is not None and not getattr(fn, "_d9d_planned", False) and cls.__module__.startswith("d9d_kernels."):
            cls.update = planned(fn)
        # the planned update the class's instances reach first: the only one that plans (core/plan.py)
        cls._planned_update = next((k.__dict__["update"] for k in cls.__mro__
                                    if getattr(k.__dict__.get("update"), "_d9d_planned", False)), None)
        # metric(...) is the class's forward itself: no second frame that re-packs the keyword inputs
        if "forward" in cls.__dict__ and "__call__" not in cls.__dict__:
            cls.__call__ = cls.__dict__["forward"]

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
        if not SlotAttribute.install(type(self), name):
            raise ValueError(f"{self._label}: add_state name {name!r} is already an attribute of {type(self).__name__}")
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

    #: what a one-count ``bad`` slot counts (a two-count slot is BAD_CAUSES)
    _bad_cause = "nonfinite_inputs"

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

    def _states(self, views=None):
        st = self._storage
        if views is None:
            views = st.current_views()
        return {name: st.layout.stats[self._stat_map[name]].view(views[self._stat_map[name]], stat)
                for name, stat in self._stats().items()}

    def _bad_count(self, states) -> torch.Tensor | None:
        if not self._raise_on_bad():
            return None
        bads = [raising_count(s["bad"], self.nan_strategy) for s in states.values() if "bad" in s]
        if not bads:
            return None
        return bads[0] if len(bads) == 1 else torch.stack(bads).sum()

    def _raise_if_bad(self, count: float, causes: dict[str, float] | None = None) -> None:
        if count != 0:  # NaN counts (impossible) also raise
            msg = self._bad_message(int(count) if math.isfinite(count) else count)
            raise ValueError(msg + bad_causes_hint(causes, self.nan_strategy))

    def _bad_causes(self, states) -> dict[str, torch.Tensor]:
        """Device counts of bad inputs by cause (float64 0-d tensors).

        A ``bad`` slot of two counts (the classification, ranking and
        perplexity statistics, d9d_kernels/reference.py) holds
        ``BAD_CAUSES``: out-of-range targets, then NaN/Inf predictions with a
        good target. A slot of one count (moments, extrema, custom slots)
        holds the metric's ``_bad_cause``."""
        out: dict[str, torch.Tensor] = {}
        for s in states.values():
            if "bad" not in s:
                continue
            bad = s["bad"].reshape(-1)
            for cause, t in zip(BAD_CAUSES if bad.numel() == 2 else (self._bad_cause,), bad.unbind(0)):
                out[cause] = out[cause] + t if cause in out else t
        return out

    def bad_input_counts(self) -> dict[str, int]:
        """Bad inputs counted since the last ``reset()``, by cause; never raises.

        Keys: ``"nonfinite_inputs"`` (NaN/Inf values, preds, targets or
        weights of aggregation / regression metrics), or
        ``"target_out_of_range"`` and ``"nonfinite_preds"`` (classification,
        ranking, perplexity: a row with a bad target counts as that, whatever
        its scores hold). Reads the counts on the host (one small copy): call
        it when logging, not every step.

        Example:
            >>> import torch, d9d_kernels as dk
            >>> m = dk.Accuracy(task="multiclass", num_classes=3, nan_strategy="ignore")
            >>> m.update(torch.tensor([0, 1]), torch.tensor([0, 7]))
            >>> m.bad_input_counts()
            {'target_out_of_range': 1, 'nonfinite_preds': 0}
        """
        causes = self._bad_causes(self._states())
        if not causes:
            return {}
        vals = torch.stack(list(causes.values())).tolist()
        return {k: int(v) if math.isfinite(v) else v for k, v in zip(causes, vals)}

    def _compute_unchecked(self, states):
        if _CUSTOM in states and len(states) == 1 and self.__dict__["_custom_slots"]:
            return self._compute(states[_CUSTOM])
        return self._compute(states)

    #: per-process caches left out of a pickle / deepcopy (rebuilt lazily):
    #: attribute -> its empty value, or None where absence means empty
    _TRANSIENT = {"_positional": None, "_sig_cache": dict}

    def __getstate__(self) -> dict:
        """Pickle / ``copy.deepcopy``: configuration and state (the storage
        pickles its buffers, ``Storage.__getstate__``); routing
        caches are left out and rebuilt at first use. A group member is
        pickled with its group (``_group``), so it keeps the group's storage."""
        state = self.__dict__.copy()
        for name, empty in self._TRANSIENT.items():
            if name in state:
                if empty is None:
                    del state[name]
                else:
                    state[name] = empty()
        state["_collector"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for name in state.get("_custom_slots", ()):  # a new process: the class has not met add_state yet
            SlotAttribute.install(type(self), name)

    # -- lifecycle ----------------------------------------------------------------
    def update(self, *args, **kwargs) -> None:
        """Adds a batch (custom metrics: the arguments of ``_update``)."""
        if not self.__dict__["_custom_slots"]:
            raise NotImplementedError(f"{type(self).__name__} must implement update()")
        self._feed({_CUSTOM: {"args": args, "kwargs": kwargs}})

    def explain(self) -> dict[str, str]:
        """How this metric's update runs: ``{name: path}``, "recorded" (later
        calls of an input signature replay its op calls in C++) or "checked
        at every call" with the reason (e.g. an op argument its update made
        from its inputs), per input signature seen; a group: per member.

        Example:
            >>> import torch, d9d_kernels as dk
            >>> m = dk.SumMetric()
            >>> m.update(torch.tensor([1.0, 2.0]))
            >>> m.explain()
            {'SumMetric': 'recorded: later calls of each input signature replay its op calls in C++'}
        """
        name = self.__dict__.get("_name") or self._label
        paths = self._storage.paths.get(name)
        if paths:
            return {name: "; ".join(paths)}
        if type(self)._planned_update is None:
            return {name: "checked at every call: its update is a class's own, outside the library's planner "
                          "(a MetricGroup's update records it when it can)"}
        return {name: "not updated yet"}

    def trigger_sync(self, ctx=None) -> None:
        """Snapshots the local state and launches the async collective(s)."""
        self._whole_storage("trigger_sync")
        sync.trigger(self._storage, ctx)

    def wait_sync(self, ctx=None) -> None:  # waits for the collectives of the last trigger_sync
        self._whole_storage("wait_sync")
        sync.wait(self._storage)

    def _whole_storage(self, op: str) -> None:  # refuses what would act on a whole group's storage
        if self._group is not None:
            raise RuntimeError(
                f"{self._label}.{op}(): a member shares its group's storage, and {op} acts on all of it; "
                f"call it on the MetricGroup (g.{op}(...)); a member's own operations are update, forward, "
                "compute, reset, merge_state and compute_to_host"
            )

    def sync(self, dist_context=None) -> None:
        """``trigger_sync(dist_context)`` then ``wait_sync(dist_context)``:
        d9d's ``Metric.sync``. Stream-ordered, no host sync: on CUDA the
        wait makes the current stream wait for the collective, so it is
        correct on the side stream d9d's collector runs it on."""
        self._whole_storage("sync")
        self.trigger_sync(dist_context)
        self.wait_sync(dist_context)

    def compute(self) -> torch.Tensor:
        """Synced value after ``wait_sync`` (until the next update), else local.

        In a multi-rank job (torch.distributed initialised, world size > 1)
        a compute() on state updated since the last sync returns this rank's
        local value and warns once per metric: use ``sync_and_compute(ctx)``
        (or trigger_sync / wait_sync) for the global value."""
        self._warn_unsynced()
        return fresh(self._checked_compute(self._states()), self._storage)

    def _checked_compute(self, states, device: torch.device | None = None):
        """``_compute`` of ``states`` with the bad-input policy of ``device``
        (default: the storage's; ``host_checks``): raise, or NaN without a host read."""
        checked = host_checks(self._storage.device if device is None else device)
        bad = self._bad_count(states)
        if bad is not None and checked:
            count = bad.item()
            if count != 0:
                causes = self._bad_causes(states)
                vals = torch.stack(list(causes.values())).tolist() if causes else []
                self._raise_if_bad(count, dict(zip(causes, vals)))
        value = self._compute_unchecked(states)
        return value if bad is None or checked else poisoned(value, bad)

    def _warn_unsynced(self) -> None:
        d = self.__dict__
        if d.get("_warned_unsynced") or not self._storage.dirty:
            return
        world = sync.rank_world()[1]
        if world > 1:
            d["_warned_unsynced"] = True
            warnings.warn(
                f"{self._label}.compute(): this rank's local value (state updated since the last sync, "
                f"world size {world}); call sync_and_compute(ctx) or trigger_sync(ctx)/wait_sync(ctx) first "
                "for the global value. Warned once per metric.",
                UserWarning,
                stacklevel=3,
            )

    def sync_and_compute(self, ctx=None):
        """``trigger_sync(ctx)``, ``wait_sync(ctx)``, ``compute()``: the global value."""
        self._whole_storage("sync_and_compute")
        self.trigger_sync(ctx)
        self.wait_sync(ctx)
        return self.compute()

    # -- forward: update AND this batch's value ---------------------------------
    def forward(self, *args, **kwargs):
        """Accumulates the batch (like ``update``) and returns ITS value (like
        torchmetrics' ``forward`` / ``metric(...)``).

        One kernel call per statistic: the update runs on a scratch copy of
        the state buffers (reset; pivots from the state), which is then
        folded into the state (sums added, maxima maxed); the batch value is
        computed from the scratch as ``compute()`` is from the state. No host
        sync; data errors (NaN under ``nan_strategy="error"``, out-of-range
        classes) are counted and raised by ``compute()``, not here. The value
        is this rank's batch only (torchmetrics' ``dist_sync_on_step=False``).

        Example:
            >>> import torch, d9d_kernels as dk
            >>> m = dk.SumMetric()
            >>> m(torch.tensor([1.0, 2.0])).item(), m(torch.tensor([4.0])).item(), m.compute().item()
            (3.0, 4.0, 7.0)
        """
        if self._forward_on_state:
            self.update(*args, **kwargs)
            return self._batch_value()
        st = self._storage
        return run_forward(st, lambda: self.update(*args, **kwargs),
                           lambda views: fresh(self._compute_unchecked(self._states(views)), st))

    __call__ = forward

    def _batch_value(self) -> torch.Tensor:
        """The last update's own value, read from the state (``_forward_on_state`` metrics)."""
        raise NotImplementedError(f"{self._label} sets _forward_on_state but has no _batch_value()")

    # -- conveniences ---------------------------------------------------------------
    def clone(self) -> "Metric":
        """An independent deep copy (state included). A member of a group is
        copied with its group (the copy's update feeds the members it shares
        statistics with there, as in the original)."""
        if self._group is not None:
            g = self._group
            name = next(n for n, m in g.items() if m is self)
            return copy.deepcopy(g)[name]
        return copy.deepcopy(self)

    def merge_state(self, other) -> None:
        """Adds ``other``'s local state into this one, exactly: counts and
        sums added, maxima maxed, moment sums re-centred to one pivot first.

        Args:
            other: a metric (or group) of the same schema: same class and
                state configuration (a group: same member names, order and
                classes), or this metric's ``state_dict()``.

        Raises ``ValueError`` naming the difference when the schemas differ.
        The result is local state (sync again for a global value)."""
        st = self._storage
        if isinstance(other, dict):
            self._merge_state_dict(other)
            return
        if not isinstance(other, Metric):
            raise TypeError(f"{self._label}.merge_state: argument 'other' must be a Metric or a state_dict, "
                            f"got {type(other).__name__}")
        if other is self or other._storage is st:
            raise ValueError(f"{self._label}.merge_state: 'other' shares this metric's state (it is the same metric "
                             "or in the same group); clone() it first")
        if isinstance(self, _GroupBase) != isinstance(other, _GroupBase):
            raise ValueError(f"{self._label}.merge_state: cannot merge a {type(other).__name__} into a "
                             f"{type(self).__name__}: merge groups with groups and metrics with metrics")
        if isinstance(self, _GroupBase):
            if list(self.keys()) != list(other.keys()):
                raise ValueError(f"{self._label}.merge_state: members differ: {list(self.keys())} vs {list(other.keys())}")
            pairs = [(a, b) for a, b in zip(self.values(), other.values())]
        else:
            pairs = [(self, other)]
        plan = []
        for a, b in pairs:
            if type(a) is not type(b):
                raise ValueError(f"{a._label}.merge_state: expected a {type(a).__name__}, got {type(b).__name__}")
            for name, j in a._stat_map.items():
                jo = b._stat_map.get(name)
                sa = a._storage.layout.stats[j]
                sb = None if jo is None else b._storage.layout.stats[jo]
                if sb is None or sa.schema() != sb.schema():
                    raise ValueError(
                        f"{a._label}.merge_state: state '{name}' differs: {sa.schema()} here vs "
                        f"{None if sb is None else sb.schema()} in {b._label} (different configuration, or "
                        "statistics shared with other members of a group)"
                    )
                plan.append((a._storage, j, b._storage, jo))
        done = set()
        for sa, j, sb, jo in plan:
            if (id(sa), j) not in done:
                done.add((id(sa), j))
                sa.merge_stat(j, sb, jo)

    def _merge_state_dict(self, sd: dict) -> None:
        st = self._storage
        if self._group is not None:
            raise ValueError(f"{self._label}.merge_state: a state_dict merges into the whole group; call it on the group")
        from d9d_kernels.checkpoint import checked_entries

        entries = checked_entries(self, sd, "merge_state")
        st.load_entries([st.entry(), *entries])
        st.dirty = True

    def plot(self, values=None, ax=None):
        """Plots with matplotlib (optional dependency); returns ``(fig, ax)``
        like torchmetrics.

        Args:
            values: ``None`` (plot ``compute()``), one result, or a list of
                results (e.g. the batch values of ``forward``) plotted over
                steps. A 2-d value (confusion matrix) is drawn as a heat map;
                a group's dict results give one line per member.
            ax: an existing ``matplotlib.axes.Axes`` to draw into.
        """
        from d9d_kernels.plot import plot_values

        if values is None:
            values = self.compute()
        return plot_values(values, ax, title=self._label)

    def reset(self) -> None:
        """Clears local and synced state (device-side fills, no host sync).

        On a member of a group, resets its statistics, local and synced (a
        sync in flight publishes them reset); the other members keep theirs.
        A statistic shared with another member (one kernel call for both)
        cannot be reset for one alone: ``RuntimeError`` naming them."""
        if self._group is None:
            return self._storage.reset()
        mine = set(self._stat_map.values())
        sharing = [n for n, m in self._group.items() if m is not self and mine & set(m._stat_map.values())]
        if sharing:
            raise RuntimeError(f"{self._label}.reset(): its state is shared with {sharing} (one kernel call feeds "
                               "them), so resetting it alone would reset them too; reset the MetricGroup")
        self._storage.reset_stats(mine)

    def to(self, device) -> "Metric":
        if self._group is not None:
            raise RuntimeError(f"{self._label} lives in a MetricGroup's buffers: move the group instead")
        self._storage.to(device)
        self.__dict__["_device"] = resolve_device(device)
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
        items = [((name, key), t) for name, v in items
                 for key, t in (v.items() if isinstance(v, dict) else [(None, v)])]
        flat = [v.detach().to(torch.float64).reshape(-1) for _, v in items]
        for _, c, causes in checks:
            flat.append(c.reshape(1))
            flat.extend(t.reshape(1) for t in causes.values())
        packed = torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)
        host, event = copy_to_host(packed)
        return HostValues(host, [n for n, _ in items], [tuple(v.shape) for _, v in items],
                          [(m, list(causes)) for m, _, causes in checks], event,
                          single=not isinstance(self, _GroupBase))

    def _host_items(self):
        self._warn_unsynced()
        states = self._states()
        bad = self._bad_count(states)
        checks = [] if bad is None else [(self, bad, self._bad_causes(states))]
        return [(None, self._compute_unchecked(states))], checks

    # -- checkpoint -----------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's LOCAL state under a rank-specific key (``rank_<r>``),
        plus ``world_size`` and the schema fingerprint (see
        ``d9d_kernels.checkpoint`` for resuming on another world size)."""
        self._whole_storage("state_dict")
        rank, world = sync.rank_world()
        st = self._storage
        return {"world_size": world, "schema": st.layout.fingerprint, f"rank_{rank}": st.entry()}

    def load_state_dict(self, state_dict: dict[str, Any], *, resharding: bool = False) -> None:
        """Restores local state: the ``combine`` (sums added, maxima maxed,
        pivots aligned) of every ``rank_<s>`` entry present; none -> reset.
        ``resharding`` skips entries saved as duplicates (``StateEntry.duplicate``).

        A checkpoint saved on another world size must be loaded through
        ``d9d_kernels.checkpoint.for_resume`` (which passes ``resharding=True``):
        loading it directly would silently drop the other saved ranks.
        Anything malformed raises ``ValueError`` naming the key before the
        state changes."""
        from d9d_kernels.checkpoint import checked_entries

        self._whole_storage("load_state_dict")
        st = self._storage
        entries = checked_entries(self, state_dict, "load_state_dict")
        saved_world = state_dict.get("world_size")
        world = sync.rank_world()[1]
        if saved_world is not None and int(saved_world) != world and not resharding:
            raise ValueError(
                f"{self._label}: checkpoint saved on {int(saved_world)} ranks, loading on {world}; load it with "
                f"dcp.load({{key: dk.checkpoint.for_resume(metric, {int(saved_world)})}}, ...) so every saved "
                "rank's state is loaded exactly once"
            )
        dups = [getattr(e, "duplicate", False) for e in entries]  # another saved rank counts their data
        st.load_entries([e for e, dup in zip(entries, dups) if not (resharding and dup)])
        st.duplicate = not resharding and bool(dups) and all(dups)

    def __repr__(self) -> str:
        """The class with the constructor arguments that differ from their
        defaults (required ones always), e.g. ``Accuracy(task='multiclass',
        num_classes=10, top_k=5)``."""
        return f"{type(self).__name__}({', '.join(config_args(self))})"


class _GroupBase(Metric):
    """Marker base for MetricGroup (defined in d9d_kernels.core.group)."""


def routed_error(e: Exception, member: Metric, how: str | None) -> Exception:
    """``e`` re-made with the group member's label (and how the inputs got
    there: ``how``, or a direct ``.update``) in front of its message (same
    type; other exception types get a note instead)."""
    label = member._label
    msg = str(e)
    if label in msg:  # already named (aggregation messages, routed twice)
        if how is None:
            return e
        if msg.startswith(label):
            msg = msg[len(label):]
            msg = msg[len(".update"):] if msg.startswith(".update") else msg
            msg = msg.lstrip(" .:")
    else:  # catalogue messages start with the class name: the label already says it
        cls = type(member).__name__
        if msg.startswith(cls + ":"):
            msg = msg[len(cls) + 1:].lstrip()
    text = f"{label}.update: {msg}" if how is None else f"{label} (inputs routed there by {how}): {msg}"
    if type(e) in (ValueError, TypeError, RuntimeError, IndexError, KeyError, NotImplementedError):
        return type(e)(text)
    e.add_note(text)
    return e


def config_args(metric: Metric) -> list[str]:
    """``name=value`` for each ``__init__`` parameter stored as an attribute
    of the same name whose value is not the default (required: always)."""
    out = []
    try:
        params = inspect.signature(type(metric).__init__).parameters.values()
    except (TypeError, ValueError):
        return out
    d = metric.__dict__
    for p in params:
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name not in d:
            continue
        v = d[p.name]
        if p.default is p.empty or not _same(v, p.default):
            out.append(f"{p.name}={v!r}")
    return out


def _same(a, b) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 (tensors, arrays: shown)
        return False


def fresh(value, st: Storage):
    """``value`` (a tensor, or a dict / tuple of them) with every tensor that
    shares memory with ``st``'s buffers cloned: what compute() and forward
    hand out never changes with later updates, resets or syncs."""
    if isinstance(value, dict):
        return {k: fresh(v, st) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(fresh(v, st) for v in value)
    if not isinstance(value, torch.Tensor):
        return value
    if torch.compiler.is_compiling():  # a traced value's storage is unknown: always a copy
        return value.clone()
    return value.clone() if st.owns(value) else value


def _update_fn(metric: Metric) -> Callable:
    return metric._update if type(metric).update is Metric.update else metric.update


def positional_names(metric: Metric) -> tuple[str, ...]:
    """The names of a metric's update parameters that can be given by position, in order."""
    return tuple(p.name for p in inspect.signature(_update_fn(metric)).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def update_signature(metric: Metric) -> tuple[frozenset, frozenset, bool]:
    """(required names, all names, takes **kwargs) of a metric's update."""
    fn = _update_fn(metric)
    req, allp, var = set(), set(), False
    for p in inspect.signature(fn).parameters.values():
        if p.kind == p.VAR_KEYWORD:
            var = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            allp.add(p.name)
            if p.default is p.empty:
                req.add(p.name)
    return frozenset(req), frozenset(allp), var
