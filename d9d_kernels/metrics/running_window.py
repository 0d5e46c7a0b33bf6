"""``Running(metric, window)``: any metric over its last ``window`` updates
(torchmetrics ``wrappers.Running``), and ``RunningSum(window)``
(torchmetrics ``aggregation.RunningSum``).

torchmetrics' wrapper keeps ``window`` copies of the base metric's states
and, per update, copies the base's state (of that update alone) into copy
``seen % window``. Here the copies are a fixed ring in the packed buffers:

* ``ring_sum`` SUM ``[window, S]``: the base's SUM buffer after one update
  from reset, less its reset values; ``ring_max`` MAX ``[window, X]`` (when
  the base has MAX slots): its MAX buffer; ``seen`` MAX ``[1]``: the row is
  chosen on the device (``index_copy_``), no host read.
* ``compute()``: the base's value of ``init + Σ rows`` (SUM) and
  ``max(init, rows)`` (MAX), evaluated by the base's own formula and
  bad-input check. A sync sums (maxes) the rings row by row, as torchmetrics
  reduces its ``state_i`` copies: the synced value is over every rank's last
  ``window`` updates.
* Moment pivots (REPLICA slots) cannot differ between rows that are added:
  the base's pivots are held at 0, so its moments are raw sums (exact in
  float64 except for data with a huge offset such as ``1e9 + noise``, whose
  variance-based values — R², Pearson — lose the precision the pivot gives).

The base metric is owned by the wrapper (do not update it yourself); it must
be a standalone metric (not a group or a group member) whose update does not
read its own state (RunningMean, ExponentialMovingAverage are refused:
torchmetrics refuses ``full_state_update`` metrics the same way).
"""

from __future__ import annotations

import inspect

import torch

from d9d_kernels.core.metric import Metric, _GroupBase
from d9d_kernels.core.statistic import MAX, REPLICA, SUM
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.running import RunningMean

__all__ = ["Running", "RunningSum"]


class _RoutedUpdate:
    """``Running``'s ``_update``: takes the base metric's update arguments
    (its signature, for group routing and positional names) and writes one
    ring row. An object, not a closure, so ``clone()`` (a deepcopy) points
    the copy's update at the copy."""

    def __init__(self, owner: "Running", signature: inspect.Signature):
        self.owner = owner
        self.__signature__ = signature

    def __call__(self, *args, **kwargs):
        self.owner._ring_update(args, kwargs)


def _cloned(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    return value


class Running(Metric):
    """The value of ``base_metric`` over its last ``window`` updates
    (torchmetrics ``wrappers.Running``). ``update`` takes the base metric's
    arguments; ``forward`` (``metric(...)``) returns the batch's own value,
    ``compute()`` the value over the window.

    Args:
        base_metric: a d9d_kernels metric (fresh: its state is replaced at
            every update).
        window: number of updates kept (>= 1).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.Running(dk.SumMetric(), window=3)
        >>> for i in range(6):
        ...     _ = m(torch.tensor([float(i)]))
        >>> m.compute().item()
        12.0
    """

    _forward_on_state = True  # the ring row an update writes depends on `seen`

    def __init__(self, base_metric: Metric, window: int = 5):
        super().__init__()
        A.check(isinstance(base_metric, Metric) and not isinstance(base_metric, _GroupBase), "Running",
                "base_metric", f"must be a d9d_kernels metric (not a MetricGroup), got {type(base_metric).__name__}",
                TypeError)
        A.check(base_metric._group is None, "Running", "base_metric",
                "must be a standalone metric, not a member of a MetricGroup")
        A.check(not base_metric._forward_on_state, "Running", "base_metric",
                f"must not read its own state in update ({type(base_metric).__name__} does: a running window of it "
                f"is not the window of its per-update states)")
        A.check_int("Running", "window", window)
        d = self.__dict__
        d["_base"] = base_metric
        A.check(base_metric.__dict__.get("_owner") is None, "Running", "base_metric",
                "already belongs to another Running: give each wrapper its own base metric")
        base_metric.__dict__["_owner"] = self  # a MetricGroup refuses it: its state is this wrapper's
        d["_label"] = f"Running({base_metric._label})"
        self.window = window
        sizes = base_metric._storage.layout.sizes
        d["_n_max"] = sizes[MAX]
        self.add_state("ring_sum", shape=(window, sizes[SUM]))
        if sizes[MAX]:
            self.add_state("ring_max", kind="max", shape=(window, sizes[MAX]))
        self.add_state("seen", kind="max", shape=(1,), init=0.0)
        d["_update"] = _RoutedUpdate(self, inspect.signature(base_metric.update))

    def __repr__(self) -> str:
        return f"Running({self._base!r}, window={self.window})"

    @property
    def base_metric(self) -> Metric:
        return self._base

    def _fresh_base(self):
        """The base's buffers at reset, pivots held at 0; on this metric's device."""
        b = self._base
        st = b._storage
        dev = self.ring_sum.device
        if st.device != dev:
            b.to(dev)
            st = b._storage
        st.local[SUM].copy_(st.init[SUM])
        st.local[MAX].copy_(st.init[MAX])
        st.local[REPLICA].zero_()
        st._set_synced(None)
        return st

    def _ring_update(self, args, kwargs) -> None:
        st = self._fresh_base()
        self._base.update(*args, **kwargs)
        pos = torch.remainder(self.seen, self.window).to(torch.int64)
        self.ring_sum.index_copy_(0, pos, (st.local[SUM] - st.init[SUM])[None])
        if self._n_max:
            self.ring_max.index_copy_(0, pos, st.local[MAX][None])
        self.seen += 1

    def _batch_value(self):
        """The last update's own value (torchmetrics: the base's forward), from the base's state."""
        b = self._base
        return _cloned(b._compute_unchecked(b._states()))

    def _compute(self, state):
        b = self._base
        st = b._storage
        dev = state["ring_sum"].device
        init = {k: v.to(dev) for k, v in st.init.items()}
        bufs = {SUM: init[SUM] + state["ring_sum"].sum(0),
                MAX: torch.maximum(init[MAX], state["ring_max"].amax(0)) if self._n_max else init[MAX].clone(),
                REPLICA: torch.zeros_like(init[REPLICA])}
        views = [st.layout.views(bufs, j) for j in range(len(st.layout.stats))]
        # the window's device decides the bad-input policy: the base moves there at its first update
        return b._checked_compute(b._states(views), device=dev)

    def to(self, device) -> "Running":
        super().to(device)
        self._base.to(device)
        return self


class RunningSum(RunningMean):
    """Sum of the values of the last ``window`` updates (torchmetrics
    ``aggregation.RunningSum``), ``update(value)``; ``nan_strategy`` as the
    aggregation metrics (default ``"warn"``). The same ring as ``RunningMean``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.RunningSum(window=3)
        >>> for i in range(6):
        ...     m.update(torch.tensor([float(i)]))
        >>> m.compute().item()
        12.0
    """

    def __init__(self, window: int = 5, nan_strategy: str = "warn"):
        A.check_int("RunningSum", "window", window)
        super().__init__(window, nan_strategy)

    def __repr__(self) -> str:
        return f"RunningSum(window={self.window})"

    def update(self, value) -> None:
        """Adds one update: ``value`` (number or tensor)."""
        super().update(value)

    def _batch_value(self) -> torch.Tensor:
        row = self.ring.index_select(0, torch.remainder(self.seen - 1, self.window).to(torch.int64))[0]
        return row[0]

    def _compute(self, state):
        return state["ring"][:, 0].sum()
