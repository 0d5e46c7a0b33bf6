"""MetricGroup: many metrics, one packed buffer per reduction kind, one sync.

``MetricGroup({name: metric}, device=None)`` gathers every member's
statistics, merges those with equal ``merge_key`` (one state slice and one
kernel call per ``g.update``), allocates ONE float64 buffer per kind and
re-points every member at it (their previous state is discarded): one sync.

Example:
    >>> import torch, d9d_kernels as dk
    >>> g = dk.MetricGroup({"loss": dk.WeightedMeanMetric(), "tokens": dk.SumMetric(),
    ...                     "peak": dk.MaxMetric()})
    >>> g["loss"].update(values=torch.tensor([2.0, 4.0]), weights=torch.tensor([1.0, 3.0]))
    >>> g["tokens"].update(4.0)
    >>> g.update(values=torch.tensor([1.0, 7.0]))   # every member takes `values`
    >>> g.trigger_sync(); g.wait_sync()
    >>> {k: round(v.item(), 4) for k, v in g.compute().items()}
    {'loss': 3.6667, 'tokens': 12.0, 'peak': 7.0}
"""

from __future__ import annotations

import warnings
from typing import Iterator

import torch

from d9d_kernels.core.forward import run as run_forward
from d9d_kernels.core.device import resolve_device
from d9d_kernels.core.metric import (
    HostValues,
    Metric,
    _GroupBase,
    fresh,
    positional_names,
    routed_error,
    update_signature,
)
from d9d_kernels.core import plan as plans_
from d9d_kernels.core.plan import GroupPlan, Plan, _Recorder, input_key, note
from d9d_kernels.core.storage import Layout, Storage

__all__ = ["MetricGroup"]


class MetricGroup(_GroupBase):
    """A ``Metric`` holding named members in one packed storage.

    Args:
        metrics: ``{name: Metric}``; fresh metrics, not in another group.
        device: where the buffers live; default the members' common device
            (CPU if they differ or there are none).
        prefix, postfix: added around the member names in the keys of
            ``compute()``, ``forward`` and ``compute_to_host()`` results
            (torchmetrics' ``MetricCollection(prefix=, postfix=)``); members
            are still looked up by their own names (``g["acc"]``).

    ``update(**inputs)`` feeds every member whose ``update`` takes exactly
    these names (its required parameters ⊆ given ⊆ its parameters) and runs
    each distinct (merged) statistic once. ``g(**inputs)`` (forward) does the
    same and returns those members' values on this batch. ``compute()``
    returns ``{name: tensor}``; ``compute_to_host()`` one handle for all.
    """

    def __init__(self, metrics: dict[str, Metric], device: torch.device | str | None = None,
                 prefix: str | None = None, postfix: str | None = None):
        super().__init__()
        for arg, v in (("prefix", prefix), ("postfix", postfix)):
            if v is not None and not isinstance(v, str):
                raise TypeError(f"MetricGroup: argument {arg!r} must be a str or None, got {type(v).__name__}")
        if not isinstance(metrics, dict) or not metrics:
            raise ValueError("MetricGroup: argument 'metrics' must be a non-empty dict {name: Metric}")
        for name, m in metrics.items():
            if not isinstance(name, str):
                raise TypeError(f"MetricGroup: member names must be str, got {name!r}")
            if not isinstance(m, Metric) or isinstance(m, _GroupBase):
                raise TypeError(f"MetricGroup: member {name!r} must be a (non-group) Metric, got {type(m).__name__}")
            if m._group is not None:
                raise ValueError(f"MetricGroup: member {name!r} already belongs to another MetricGroup")
            owner = m.__dict__.get("_owner")
            if owner is not None:
                raise ValueError(f"MetricGroup: member {name!r} is the base metric of a {type(owner).__name__}, which "
                                 "owns its state; add a separate metric of the same configuration instead")
        if device is None:
            devs = {m.device for m in metrics.values()}
            device = devs.pop() if len(devs) == 1 else torch.device("cpu")
        d = self.__dict__
        d["_members"] = dict(metrics)
        d["_device"] = resolve_device(device)
        d["_label"] = "MetricGroup"
        d["_sig_cache"] = {}
        d["_sigs"] = {name: update_signature(m) for name, m in metrics.items()}
        d["prefix"] = prefix
        d["postfix"] = postfix
        d["_keys"] = {name: f"{prefix or ''}{name}{postfix or ''}" for name in metrics}

    def _statistics(self):
        return {}

    def _finalize(self) -> None:
        members = self._members
        owners = [(f"MetricGroup[{n!r}]", m) for n, m in members.items()]
        layout = Layout(owners)
        storage = Storage(layout, self._device, "MetricGroup")
        self.__dict__["_storage"] = storage
        self.__dict__["_stat_map"] = {}
        for (name, m), (label, _), smap in zip(members.items(), owners, layout.maps):
            d = m.__dict__
            d["_storage"] = storage
            d["_stat_map"] = smap
            d["_group"] = self
            d["_name"] = name
            d["_label"] = f"{label} ({type(m).__name__})"

    # -- mapping protocol -------------------------------------------------------
    def __getitem__(self, name: str) -> Metric:
        return self._members[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, name) -> bool:
        return name in self._members

    def items(self):
        return self._members.items()

    def values(self):
        return self._members.values()

    # -- lifecycle ----------------------------------------------------------------
    def _targets(self, names: frozenset) -> list[Metric]:
        cache = self._sig_cache
        hit = cache.get(names)
        if hit is None:
            hit = []
            for n, (req, allp, var) in self._sigs.items():
                if req <= names and (var or names <= allp):
                    hit.append(self._members[n])
            cache[names] = hit
        return hit

    def _name_positional(self, args: tuple, inputs: dict) -> dict:
        """Positional inputs, as torchmetrics' ``MetricCollection(preds, target)``
        takes them: named by the parameters every member's update has at
        those positions (``preds, target`` for the classification family)."""
        cache = self.__dict__.setdefault("_positional", {})
        names = cache.get(len(args))
        if names is None:
            per_member = {n: positional_names(m)[: len(args)] for n, m in self._members.items()}
            distinct = set(per_member.values())
            if len(distinct) != 1 or len(next(iter(distinct))) < len(args):
                seen = ", ".join(f"{n}: {list(v)}" for n, v in per_member.items())
                raise TypeError(
                    f"MetricGroup: {len(args)} positional input(s) need the same leading update parameters in "
                    f"every member (here {seen}); pass the inputs by name, e.g. g.update(preds=..., target=...)"
                )
            names = cache[len(args)] = next(iter(distinct))
        both = sorted(set(names) & set(inputs))
        if both:
            raise TypeError(f"MetricGroup: input(s) {both} given both by position and by name")
        return {**dict(zip(names, args)), **inputs}

    def update(self, *args, **inputs) -> None:
        """Feeds ``inputs`` to every member whose update takes exactly these names.

        An error raised by a member names it (``MetricGroup['mse']
        (MeanSquaredError)``) and says ``g.update(**inputs)`` routed the
        inputs there; no member's state is written before every routed
        member's checks passed. Each member's update is recorded on its own
        (``_record``): one that cannot be runs checked, alone, and warns once."""
        if args:
            inputs = self._name_positional(args, inputs)
        st = self._storage
        key = None if torch.compiler.is_compiling() else input_key(id(self), (), inputs)  # traced: checked
        entry = None if key is None else st.plans.get(key)
        if entry is None and key is not None and len(st.plans) < plans_.MAX_PLANS:
            st.plans[key] = self._record(inputs)
            return
        if entry is None:
            st.run(self._items(self._collect(inputs, self._targets(frozenset(inputs)))))
            return
        items = self._items(self._collect(inputs, entry.checked)) if entry.checked else ()
        if entry.plan is not None:
            entry.plan.run(st, tuple(inputs.values()))
        if items:
            st.run([(j, kw) for j, kw in items if entry.plan is None or j not in entry.plan.stats])

    update._d9d_planned = True  # plans per member (_record), not as one update

    def _record(self, inputs: dict) -> GroupPlan:
        """Runs the update once, recording each member's checks and statistics
        on their own: one ``Plan`` for the members that record, the others checked."""
        st = self._storage
        targets = self._targets(frozenset(inputs))
        if not targets:
            self._collect(inputs, targets)  # raises: no member takes these inputs
        calls, collected = [], []
        for m in targets:  # every member's checks before any write
            with _Recorder() as rec:
                collected += self._collect(inputs, [m])
            calls.append(rec.calls)
        done: set = set()
        for i, part in enumerate(collected):
            items = [(j, kw) for j, kw in self._items([part]) if j not in done]
            done.update(j for j, _ in items)
            with _Recorder() as rec:
                st.run(items)
            calls[i] = calls[i] + rec.calls
        ok, checked = [], []
        for m, c in zip(targets, calls):
            plan, why = Plan.record(st, c, (), inputs)
            note(st, m._name, why)
            if why is None:
                ok += c
            else:
                checked.append(m)
                self._warn_checked(m, why)
        plan, why = Plan.record(st, ok, (), inputs)
        return GroupPlan(plan, checked) if why is None else GroupPlan(None, targets)

    def _warn_checked(self, m: Metric, why: str) -> None:
        warned = self.__dict__.setdefault("_warned_checked", set())
        if m._name not in warned:
            warned.add(m._name)
            warnings.warn(f"{m._label}.update cannot be recorded ({why}): it runs its checked path at every call; "
                          "the other members replay theirs. g.explain() lists each member's path.", UserWarning,
                          stacklevel=4)

    def explain(self) -> dict[str, str]:  # how each member's update runs, per name (Metric.explain)
        return {n: m.explain()[n] for n, m in self._members.items()}

    def _collect(self, inputs: dict, targets: list) -> list:
        """The checks of the members ``inputs`` are routed to (``targets``), nothing
        written: ``[(member, prepared statistic kwargs)]``."""
        if not targets:
            raise ValueError(f"MetricGroup.update: no member's update takes the inputs {sorted(inputs)}")
        collected: list = []
        try:
            for m in targets:
                m.__dict__["_collector"] = collected
                try:
                    m.update(**inputs)
                except Exception as e:  # noqa: BLE001 (re-raised with the member named)
                    err = routed_error(e, m, f"g.update({', '.join(f'{k}=...' for k in inputs)})")
                    if err is e:
                        raise
                    raise err from e
        finally:
            for m in targets:
                m.__dict__["_collector"] = None
        return collected

    @staticmethod
    def _items(collected: list) -> list:
        items = []
        for m, prepared in collected:
            smap = m._stat_map
            items.extend((smap[name], kw) for name, kw in prepared.items())
        return items

    def forward(self, *args, **inputs) -> dict[str, torch.Tensor]:
        """``g(**inputs)``: updates like ``g.update(**inputs)`` and returns
        ``{key: value on this batch}`` for the members the inputs were routed
        to (keys with prefix/postfix). One kernel call per merged statistic;
        local to this rank (no sync). See ``Metric.forward``."""
        if args:
            inputs = self._name_positional(args, inputs)
        st = self._storage
        key = frozenset(inputs)
        targets = self._targets(key)
        names = [m._name for m in targets if not m._forward_on_state]
        out_keys = [(self._keys[m._name], m._name, m._forward_on_state) for m in targets]
        if any(on for _, _, on in out_keys):
            # every member's checks first, nothing written; the members whose update
            # reads its state (_forward_on_state) run on the state after the fold
            collected = self._collect(inputs, targets)
            on_state = self._items([(m, p) for m, p in collected if m._forward_on_state])
            scratch = self._items([(m, p) for m, p in collected if not m._forward_on_state])
            run = lambda: st.run(scratch)  # noqa: E731
        else:
            on_state = []
            run = lambda: self.update(**inputs)  # noqa: E731 (the planned update, on the scratch)
        members = self._members
        vals = run_forward(st, run, lambda views: {
            n: fresh(members[n]._compute_unchecked(members[n]._states(views)), st) for n in names})
        if on_state:
            st.run(on_state)
        return {k: members[n]._batch_value() if on else vals[n] for k, n, on in out_keys}

    def compute(self) -> dict[str, torch.Tensor]:
        """``{key: tensor}`` (synced after ``wait_sync``, else local); keys
        are the member names with prefix/postfix. A member's bad-input count
        raises (CPU) or makes its value NaN (GPU) as its own ``compute()``."""
        self._warn_unsynced()
        st = self._storage
        return {self._keys[n]: fresh(m._checked_compute(m._states()), st) for n, m in self._members.items()}

    def bad_input_counts(self) -> dict[str, dict[str, int]]:
        """``{key: member.bad_input_counts()}`` for members that count bad inputs."""
        out = {}
        for n, m in self._members.items():
            c = m.bad_input_counts()
            if c:
                out[self._keys[n]] = c
        return out

    def keys(self, keep_base: bool = True):
        """Member names (``keep_base=False``: with prefix/postfix, the keys of results)."""
        return self._members.keys() if keep_base else list(self._keys.values())

    def reset(self) -> None:
        self._storage.reset()

    def _host_items(self):
        self._warn_unsynced()
        items, checks = [], []
        for n, m in self._members.items():
            states = m._states()
            bad = m._bad_count(states)
            items.append((self._keys[n], m._compute_unchecked(states)))
            if bad is not None:
                checks.append((m, bad, m._bad_causes(states)))
        return items, checks

    def __repr__(self) -> str:
        inner = ",\n".join(f"    {n!r}: {m!r}" for n, m in self._members.items())
        extra = "".join(f", {k}={v!r}" for k, v in (("prefix", self.prefix), ("postfix", self.postfix)) if v)
        return f"MetricGroup({{\n{inner},\n}}{extra})"

