"""RunningMean: the mean over the last ``window`` updates (torchmetrics
``aggregation.RunningMean``: a ``MeanMetric`` state per update kept in a ring);
ExponentialMovingAverage: every update's weighted sums decayed by ``decay``
per update (no torchmetrics counterpart).

State (custom slots in the packed buffers): ``ring`` SUM ``[window, 2]``
(``Σ w·v``, ``Σ w`` of each of the last ``window`` updates; unused rows are
0), ``seen`` MAX ``[1]`` (updates since reset: the next row is
``seen % window``, chosen on the device), ``bad`` SUM ``[1]``. A sync sums
the rings row by row as torchmetrics sums its ``value_i`` states: the synced
mean is over every rank's last ``window`` updates.
"""

from __future__ import annotations

import numbers

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.metrics import _args as A
from d9d_kernels.metrics.aggregation import AggregationNaN

__all__ = ["RunningMean", "ExponentialMovingAverage"]


def _float64(x, device) -> torch.Tensor:
    """A tensor in float64; a number by a fill kernel on ``device`` (no host->device copy)."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64)
    return torch.full((), float(x), dtype=torch.float64, device=device)


def _check_inputs(label: str, dev, value, weight) -> None:
    """``value`` / ``weight``: real tensors on ``dev`` or real numbers, broadcastable together."""
    for arg, v in (("value", value), ("weight", weight)):
        if isinstance(v, torch.Tensor):
            A.check(v.device == dev, label, arg, f"must be on {dev}, got {v.device}")
            A.check(not v.is_complex(), label, arg, f"must be real, got {v.dtype}", TypeError)
        else:
            A.check(isinstance(v, numbers.Real) and not isinstance(v, bool), label, arg,
                    f"must be a tensor or a real number, got {type(v).__name__}", TypeError)
    vs = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
    ws = tuple(weight.shape) if isinstance(weight, torch.Tensor) else ()
    A.check(A.broadcasts_to(ws, vs) or A.broadcasts_to(vs, ws), label, "weight",
            f"of shape {ws} does not broadcast with value {vs}")


def _batch_sums(m, value, weight) -> torch.Tensor:
    """``[Σ w·v, Σ w]`` of one update under ``m``'s nan_strategy: NaN pairs
    counted in ``m.bad`` where checked, then left out, kept or imputed."""
    v, w = _float64(value, m.bad.device), _float64(weight, m.bad.device)
    v, w = torch.broadcast_tensors(v, w)
    nan = torch.isnan(v) | torch.isnan(w)
    if m._counts_nan():
        m.bad += nan.sum().reshape(1)
    if m._impute is not None:
        v = torch.where(nan, torch.full_like(v, m._impute), v)
        w = torch.where(nan, torch.ones_like(w), w)
    elif m.nan_strategy != "propagate":
        v = torch.where(nan, torch.zeros_like(v), v)
        w = torch.where(nan, torch.zeros_like(w), w)
    return torch.stack([(v * w).sum(), w.sum()])


class _ValueUpdates(AggregationNaN, Metric):
    """``update(value, weight=1.0)`` like ``MeanMetric``, checked before any
    write; subclasses declare their slots (a ``bad`` one included) after
    ``super().__init__``."""

    def update(self, value, weight=1.0) -> None:
        """Adds one update: ``value`` (number or tensor), ``weight`` broadcastable to it."""
        _check_inputs(self._label, self.bad.device, value, weight)
        super().update(value=value, weight=weight)

    _forward_on_state = True  # the batch value is read back from the state (_batch_value)


class RunningMean(_ValueUpdates):
    """Mean of the values of the last ``window`` updates, weighted like
    ``MeanMetric`` (``update(value, weight=1.0)``).

    Args:
        window: number of updates kept.
        nan_strategy: as the aggregation metrics (``d9d_kernels.metrics.aggregation``):
            ``"warn"`` (default), ``"ignore"``, ``"error"``, ``"disable"`` /
            ``"propagate"`` or a float (impute).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.RunningMean(window=3)
        >>> for i in range(6):
        ...     m.update(torch.tensor([float(i)]))
        >>> m.compute().item()
        4.0
    """

    def __init__(self, window: int = 5, nan_strategy: str = "warn"):
        super().__init__(nan_strategy)
        A.check_int("RunningMean", "window", window)
        self.window = window
        self.add_state("ring", shape=(window, 2))
        self.add_state("seen", kind="max", shape=(1,), init=0.0)
        self.add_state("bad", shape=(1,))

    def __repr__(self) -> str:
        return f"RunningMean(window={self.window})"

    # forward on the state: the slot an update writes depends on `seen`
    def _batch_value(self) -> torch.Tensor:
        """The batch's own mean (torchmetrics' ``RunningMean`` forward), read
        back from the ring slot the update just wrote."""
        row = self.ring.index_select(0, torch.remainder(self.seen - 1, self.window).to(torch.int64))[0]
        return row[0] / row[1]

    def _update(self, value, weight=1.0):
        pos = torch.remainder(self.seen, self.window).to(torch.int64)
        self.ring.index_copy_(0, pos, _batch_sums(self, value, weight)[None])
        self.seen += 1

    def _compute(self, state):
        ring = state["ring"]
        return ring[:, 0].sum() / ring[:, 1].sum()


class ExponentialMovingAverage(_ValueUpdates):
    """Exponentially weighted mean of the values of all updates so far: an
    update ``t`` steps back weighs ``decay**t`` (times its own weights),
    ``update(value, weight=1.0)`` as ``MeanMetric``.

    ``compute() = Σ_t decay**(T-t) Σ w_t·v_t / Σ_t decay**(T-t) Σ w_t``: with
    one unit-weight value per update this is the bias-corrected EMA
    ``ema_T / (1 - decay**T)`` of ``ema_t = decay·ema_{t-1} + (1 - decay)·v_t``.
    State: ``sums`` SUM ``[2]`` (the decayed ``Σ w·v``, ``Σ w``), ``last``
    (the last update's sums, for ``forward``), ``bad``. Both sums are linear
    in the data, so a sync's sum over ranks is the EMA of the global per-step
    sums, provided every rank calls ``update`` once per step (as a training
    loop does); ranks that update different numbers of times decay differently.

    Args:
        decay: in ``[0, 1)``; 0 keeps only the last update.
        nan_strategy: as ``RunningMean``.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.ExponentialMovingAverage(decay=0.5)
        >>> for v in (1.0, 2.0, 4.0):
        ...     m.update(torch.tensor(v))
        >>> round(m.compute().item(), 4)  # (1/4 + 2/2 + 4) / (1/4 + 1/2 + 1)
        3.0
    """

    def __init__(self, decay: float = 0.99, nan_strategy: str = "warn"):
        A.check(isinstance(decay, numbers.Real) and not isinstance(decay, bool) and 0.0 <= float(decay) < 1.0,
                "ExponentialMovingAverage", "decay", f"must be a real number in [0, 1), got {decay!r}")
        super().__init__(nan_strategy)
        self.decay = float(decay)
        self.add_state("sums", shape=(2,))
        self.add_state("last", shape=(2,))
        self.add_state("bad", shape=(1,))

    def __repr__(self) -> str:
        return f"ExponentialMovingAverage(decay={self.decay})"

    # forward on the state: the update scales the whole state (a scratch copy cannot be folded in)

    def _batch_value(self) -> torch.Tensor:
        """The batch's own weighted mean."""
        return self.last[0] / self.last[1]

    def _update(self, value, weight=1.0):
        self.last = _batch_sums(self, value, weight)
        self.sums.mul_(self.decay).add_(self.last)

    def _compute(self, state):
        return state["sums"][0] / state["sums"][1]
