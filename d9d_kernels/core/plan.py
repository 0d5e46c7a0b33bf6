"""Update plans: validate an input signature once, then call the kernels directly.

A metric's ``update`` checks input metadata in Python (shapes, dtypes,
devices; never values: no host syncs), then hands each statistic its kwargs.
At a small batch that Python is most of the cost: in a ``MetricGroup`` of
loss, accuracy, top-5, F1, precision, recall and confusion matrix the member
checks and op wrappers take several times the kernels' time (C = 10,
N = 32, bench/bench_update.py).

So every ``update`` (catalogue metrics and ``MetricGroup``) is wrapped by
``planned``: the first call with a new *input signature* (each input's
shape, dtype and device, or Python type) runs the full checked path and records which statistic got which
input. If every statistic kwarg was an update input passed through as is (or
None), the recording becomes a plan: later calls with the same signature skip
all checks and run ``Statistic.bind`` callables (a raw ``torch.ops`` call for
the hot statistics). Inputs that the metric transformed (a flattened tensor,
a list of strings) leave the signature unplanned: it keeps the checked path.

Plans live in the storage (``Storage.plans``) and die with it: moving a
metric (``to``) or grouping it starts afresh. The contract this relies on,
kept by every metric here: ``update``'s checks depend only on input
metadata and the metric's configuration, never on input values. The
backend (``D9D_KERNELS_BACKEND``) is read when a signature is planned, not
at every call (reading ``os.environ`` costs a tenth of a planned step).
"""

from __future__ import annotations

import functools
import numbers

import torch

from d9d_kernels.core import compiled

__all__ = ["planned", "input_key"]
_compiling = torch.compiler.is_compiling
_fast_update = compiled.fast_update

#: signatures planned per storage; beyond this, new signatures run checked.
MAX_PLANS = 64
_UNPLANNED = object()


def input_key(owner: int, args: tuple, kwargs: dict) -> tuple | None:
    """Hashable signature of one update call, or None when an input is not a
    tensor, None or a real number (lists, strings: never planned)."""
    key = [owner]
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            key.append((v.shape, v.dtype, v.device))
        elif v is None or (isinstance(v, numbers.Real)):
            key.append(type(v))
        else:
            return None
    key.extend(kwargs)
    return tuple(key)


class Plan:
    """Steps ``(stat index, bound call, kwarg sources)`` of one signature."""

    __slots__ = ("steps", "stats")

    def __init__(self, steps):
        self.steps = steps
        self.stats = tuple(j for j, _, _ in steps)

    @staticmethod
    def build(storage, recorded, args: tuple, kwargs: dict) -> "Plan | None":
        sources = {}
        for i, v in enumerate(args):
            if v is not None:
                sources.setdefault(id(v), []).append((False, i))
        for k, v in kwargs.items():
            if v is not None:
                sources.setdefault(id(v), []).append((True, k))
        steps = []
        for j, kw in recorded:
            spec = []
            for name, v in kw.items():
                if v is None:
                    spec.append((name, None, None))
                    continue
                src = sources.get(id(v))
                if src is None or len(src) > 1:  # derived, or ambiguous (one object passed twice)
                    return None
                spec.append((name, *src[0]))
            steps.append((j, storage.layout.stats[j].bind(kw), tuple(spec)))
        return Plan(tuple(steps)) if steps else None

    def run(self, storage, args: tuple, kwargs: dict) -> None:
        if storage.touched is not None:  # inside a forward: the statistics whose scratch it folds
            storage.touched.update(self.stats)
        views = storage.local_views
        for j, fn, spec in self.steps:
            kw = {name: (None if by_name is None else kwargs[src] if by_name else args[src])
                  for name, by_name, src in spec}
            fn(views[j], kw)
        storage.dirty = True


def _checked(update, self, args, kwargs):
    """The metric's own ``update``; a group member's errors name the member."""
    try:
        return update(self, *args, **kwargs)
    except Exception as e:
        if self.__dict__.get("_group") is None:
            raise
        from d9d_kernels.core.metric import routed_error

        err = routed_error(e, self, None)
        if err is e:
            raise
        raise err from e


def planned(update):
    """Wraps a metric's ``update`` with the per-signature plan cache.

    Only the outermost planned ``update`` of a metric's class plans: one
    reached through ``super().update(...)`` from an override runs as
    written, so a plan (and its compiled runner, filed under the metric)
    always maps the arguments of the call the user made."""

    @functools.wraps(update)
    def wrapper(self, *args, **kwargs):
        if type(self)._planned_update is not wrapper:  # set per class by Metric.__init_subclass__
            return update(self, *args, **kwargs)
        compiling = _compiling()
        if not compiling and _fast_update(self, args, kwargs):  # the runner on the local views ran
            return
        d = self.__dict__
        storage = d["_storage"]
        if d["_collector"] is not None or storage is None:  # inside MetricGroup.update: it plans
            return update(self, *args, **kwargs)
        c = storage.compiled.get(id(self))  # d9d_kernels/core/compiled.py: a Runner
        if c is not None and not compiling and c.views is storage.saved_views:
            # inside a forward: the same ops on the scratch copy
            s = compiled.on_scratch(storage, c)
            i = -1 if s is None else s.runner.run(args, kwargs)
            if i >= 0:
                storage.touched.update(s.stats[i])
                storage.dirty = True
                return
        key = input_key(id(self), args, kwargs)
        if key is None:
            return _checked(update, self, args, kwargs)
        plans = storage.plans
        plan = plans.get(key)
        if plan is not None:
            if plan is _UNPLANNED:
                return _checked(update, self, args, kwargs)
            return plan.run(storage, args, kwargs)
        storage.recording = recorded = []
        try:
            _checked(update, self, args, kwargs)
        finally:
            storage.recording = None
        if len(plans) < MAX_PLANS:
            plans[key] = Plan.build(storage, recorded, args, kwargs) or _UNPLANNED
            compiled.attach(storage, id(self), plans[key], recorded, args, kwargs)

    wrapper._d9d_planned = True
    return wrapper
