"""Update plans: an update recorded once per input signature, then replayed.

Every ``update`` of the library (catalogue metrics and ``MetricGroup``) is
wrapped by ``planned``. The first call with a new input signature (each
input's shape, dtype and device, or Python type) runs the checked path
under a ``TorchDispatchMode`` that records the ops it dispatches. If all it
did was ``d9d_kernels`` op calls on the state's views, the update's inputs
(or reshapes of them) and fills of its Python-number inputs, the recording
becomes a ``Plan``, which later calls of the signature replay in one call
into C++ (csrc/host/replay.cpp), skipping every check; anything else keeps
the checked path. Contract: ``update``'s checks depend only on input
metadata and configuration, never on values. docs/metrics_core.md, "Update
plans", has the rest (lifetime, forward, torch.compile, CUDA graphs).
"""

from __future__ import annotations

import functools
import math

import torch

from d9d_kernels import _extension
from d9d_kernels._compiling import DispatchMode

__all__ = ["planned", "input_key", "Plan", "GroupPlan", "note", "RECORDED", "MAX_PLANS"]

# csrc/host/replay.cpp; without the extension every update runs checked
_replay_new = getattr(_extension._C, "replay_new", None) if _extension.CPP_ERROR is None else None
_replay_run = getattr(_extension._C, "replay_run", None) if _extension.CPP_ERROR is None else None

#: signatures planned per storage; beyond this, new signatures run checked.
MAX_PLANS = 64
_UNPLANNED = object()
_CONST, _INPUT, _RESHAPE, _STATE, _FILL = range(5)


def input_key(owner: int, args: tuple, kwargs: dict) -> tuple | None:
    """Hashable signature of one update call, or None when an input is not a
    tensor, None or a real number (lists, strings: never planned)."""
    key = [owner]
    for v in (*args, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            key.append((v.shape, v.dtype, v.device))
        elif v is None or isinstance(v, (int, float)):  # concrete types: an ABC isinstance is slow on this per-call path
            key.append(type(v))
        else:
            return None
    key.extend(kwargs)
    return tuple(key)


class _Recorder(DispatchMode):
    """Every op dispatched inside it: ``(op, args, kwargs, result)``."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out


def _writes(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b`` read in row-major order (a reshape of it, or it)."""
    return (a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype
            and a.is_contiguous() and b.is_contiguous())


class Plan:
    """The recorded op calls of one signature: per call the op and where
    each argument comes from (``_CONST`` value, ``_INPUT`` i, ``_RESHAPE``
    (i, shape), ``_STATE`` (statistic, slot), ``_FILL`` k: input
    ``fills[k][0]`` filled as ``fills[k][1:]``: shape, dtype, device).
    ``run`` replays them in one call into C++ (csrc/host/replay.cpp), bound
    once per set of state views (the local ones, forward's scratch)."""

    __slots__ = ("steps", "stats", "fills", "_bound")

    def __init__(self, steps, stats, fills):
        self.steps, self.stats, self.fills = steps, frozenset(stats), fills
        self._bound: dict = {}  # id(views) -> (views, the C++ replay bound to them)

    @staticmethod
    def record(storage, calls: list, args: tuple, kwargs: dict) -> tuple["Plan | None", str | None]:
        """``(plan, None)`` for one checked update's ``calls``; ``(None, why)``
        when it did other work; ``(None, None)`` when it called no op."""
        inputs = (*args, *kwargs.values())
        state = {id(t): (j, name) for j, v in enumerate(storage.local_views) for name, t in v.items()}
        scalars_in = [i for i, v in enumerate(inputs) if isinstance(v, (int, float))]  # bools too
        numbers_in = [i for i in scalars_in if not isinstance(inputs[i], bool)]
        fills, made, steps, stats = [], [], [], set()  # made: (tensor, fill index) of every number fill

        made_by = {id(out): func for func, _, _, out in calls if isinstance(out, torch.Tensor)}

        def why_not(a) -> str:
            if not isinstance(a, torch.Tensor):
                return f"a number argument equal to one of its Python-number inputs ({a!r})"
            f = made_by.get(id(a))
            return f"an op argument made by {f} from its inputs" if f is not None else \
                "an op argument that is neither an input, a reshape of one, nor a state view"

        def source(a):
            if not isinstance(a, torch.Tensor):
                if any(type(a) is type(inputs[i]) and a == inputs[i] for i in scalars_in):
                    return None  # maybe an input's value: the replay could not tell
                return _CONST, a
            if id(a) in state:
                return _STATE, state[id(a)]
            hits = [i for i, v in enumerate(inputs) if isinstance(v, torch.Tensor) and _same_memory(a, v)]
            hits += [("fill", k) for t, k in made if _same_memory(a, t)]
            if len(hits) != 1:  # derived from no input, or ambiguous (one tensor passed twice)
                return None
            if isinstance(hits[0], tuple):
                k = hits[0][1]
                fills[k] = (fills[k][0], a.shape, a.dtype, a.device)
                return _FILL, k
            i = hits[0]
            return (_INPUT, i) if a.shape == inputs[i].shape else (_RESHAPE, (i, a.shape))

        for func, fargs, fkwargs, out in calls:
            if func.namespace == "d9d_kernels":
                if fkwargs:
                    return None, f"{func} called with keyword arguments"
                spec = [source(a) for a in fargs]
                bad = next((a for a, sp in zip(fargs, spec) if sp is None), _UNPLANNED)
                if bad is not _UNPLANNED:
                    return None, f"{func} takes {why_not(bad)}"
                stats.update(s[1][0] for s in spec if s[0] == _STATE)
                steps.append((func, tuple(spec)))
            elif func is torch.ops.aten.full.default and isinstance(out, torch.Tensor):
                v = fargs[1]
                hit = [i for i in numbers_in if float(inputs[i]) == v or (math.isnan(v) and math.isnan(inputs[i]))]
                if len(hit) == 1:
                    made.append((out, len(fills)))
                    fills.append((hit[0], None, None, None))
            elif _writes(func):
                return None, f"it writes with {func} (the replay repeats only d9d_kernels ops)"
            elif isinstance(out, (bool, int, float)) and any(isinstance(a, torch.Tensor) for a in fargs):
                return None, f"it reads a tensor's value on the host ({func})"
        if not steps:
            return None, None
        if _replay_new is None:
            return None, "the C++ extension (csrc/host/replay.cpp) is not built"
        return Plan(steps, stats, fills), None

    def run(self, storage, inputs: tuple) -> None:
        views = storage.local_views
        hit = self._bound.get(id(views))
        if hit is None or hit[0] is not views:
            hit = self._bound[id(views)] = (views, _replay_new([self._bind(f, spec, views) for f, spec in self.steps]))
        _replay_run(hit[1], inputs)
        if storage.touched is not None:  # inside a forward: the statistics whose scratch it folds
            storage.touched.update(self.stats)
        storage.dirty = True

    def _bind(self, func, spec, views) -> tuple:
        """``replay_new``'s step: the op, its constants and state views in
        place, and ``(position, source, shape, input, dtype, device)`` per input."""
        base, dyn = [], []
        for p, (c, a) in enumerate(spec):
            base.append(a if c == _CONST else views[a[0]][a[1]] if c == _STATE else None)
            if c == _INPUT:
                dyn.append((p, c, None, a, None, None))
            elif c == _RESHAPE:
                dyn.append((p, c, list(a[1]), a[0], None, None))
            elif c == _FILL:
                i, shape, dtype, device = self.fills[a]
                dyn.append((p, c, list(shape), i, dtype, device))
        return func._schema.name, func._schema.overload_name, base, dyn


RECORDED = "recorded: later calls of each input signature replay its op calls in C++"


def note(storage, name: str, why: str | None) -> None:
    """Records how ``name``'s update runs for the signature just recorded (``Metric.explain``)."""
    paths = storage.paths.setdefault(name, {})
    paths[RECORDED if why is None else f"checked at every call: {why}"] = None


class GroupPlan:
    """A group update's recording: ``plan`` replays the members that record
    (or None); the ``checked`` members run their update at every call."""

    __slots__ = ("plan", "checked")

    def __init__(self, plan: Plan | None, checked: list):
        self.plan, self.checked = plan, checked


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
    written, so a plan always maps the arguments of the call the user made."""

    @functools.wraps(update)
    def wrapper(self, *args, **kwargs):
        if type(self)._planned_update is not wrapper:  # set per class by Metric.__init_subclass__
            return update(self, *args, **kwargs)
        d = self.__dict__
        storage = d["_storage"]
        if d["_collector"] is not None or storage is None:  # inside MetricGroup.update: it plans
            return update(self, *args, **kwargs)
        key = None if torch.compiler.is_compiling() else input_key(id(self), args, kwargs)  # traced: the checked path
        plans = storage.plans
        plan = None if key is None else plans.get(key)
        if plan is not None and plan is not _UNPLANNED:
            return plan.run(storage, (*args, *kwargs.values()))
        if plan is not None or key is None or len(plans) >= MAX_PLANS:
            return _checked(update, self, args, kwargs)
        with _Recorder() as rec:
            _checked(update, self, args, kwargs)
        plan, why = Plan.record(storage, rec.calls, args, kwargs)
        plans[key] = plan or _UNPLANNED
        note(storage, self.__dict__.get("_name") or self._label, why)

    wrapper._d9d_planned = True
    return wrapper
