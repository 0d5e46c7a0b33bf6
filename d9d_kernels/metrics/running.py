"""RunningMean: the mean over the last ``window`` updates (torchmetrics
``aggregation.RunningMean``: a ``MeanMetric`` state per update kept in a ring).

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

__all__ = ["RunningMean"]

#: torchmetrics' aggregation nan_strategy values -> this library's
_NAN = {"warn": "ignore", "ignore": "ignore", "error": "error", "disable": "propagate", "propagate": "propagate"}


def _float64(x, device) -> torch.Tensor:
    """A tensor in float64; a number by a fill kernel on ``device`` (no host->device copy)."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.float64)
    return torch.full((), float(x), dtype=torch.float64, device=device)


class RunningMean(Metric):
    """Mean of the values of the last ``window`` updates, weighted like
    ``MeanMetric`` (``update(value, weight=1.0)``).

    Args:
        window: number of updates kept.
        nan_strategy: torchmetrics' names: ``"warn"`` (default; NaN values are
            left out, without the warning: no host read), ``"ignore"``,
            ``"error"`` (``compute()`` raises with the count), ``"disable"``
            (NaN flows into the result; also ``"propagate"``). A float
            (impute) is not supported.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.RunningMean(window=3)
        >>> for i in range(6):
        ...     m.update(torch.tensor([float(i)]))
        >>> m.compute().item()
        4.0
    """

    def __init__(self, window: int = 5, nan_strategy: str = "warn"):
        A.check(isinstance(nan_strategy, str) and nan_strategy in _NAN, "RunningMean", "nan_strategy",
                f"must be one of {tuple(_NAN)}, got {nan_strategy!r}")
        super().__init__(nan_strategy=_NAN[nan_strategy])
        A.check_int("RunningMean", "window", window)
        self.window = window
        self.add_state("ring", shape=(window, 2))
        self.add_state("seen", kind="max", shape=(1,), init=0.0)
        self.add_state("bad", shape=(1,))

    def __repr__(self) -> str:
        return f"RunningMean(window={self.window})"

    def update(self, value, weight=1.0) -> None:
        """Adds one update: ``value`` (number or tensor), ``weight`` broadcastable to it."""
        dev = self.ring.device
        for arg, v in (("value", value), ("weight", weight)):
            if isinstance(v, torch.Tensor):
                A.check(v.device == dev, self._label, arg, f"must be on {dev}, got {v.device}")
                A.check(not v.is_complex(), self._label, arg, f"must be real, got {v.dtype}", TypeError)
            else:
                A.check(isinstance(v, numbers.Real) and not isinstance(v, bool), self._label, arg,
                        f"must be a tensor or a real number, got {type(v).__name__}", TypeError)
        vs = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
        ws = tuple(weight.shape) if isinstance(weight, torch.Tensor) else ()
        A.check(A.broadcasts_to(ws, vs) or A.broadcasts_to(vs, ws), self._label, "weight",
                f"of shape {ws} does not broadcast with value {vs}")
        super().update(value=value, weight=weight)

    _forward_on_state = True  # the slot an update writes depends on `seen`

    def _batch_value(self) -> torch.Tensor:
        """The batch's own mean (torchmetrics' ``RunningMean`` forward), read
        back from the ring slot the update just wrote."""
        row = self.ring.index_select(0, torch.remainder(self.seen - 1, self.window).to(torch.int64))[0]
        return row[0] / row[1]

    def _update(self, value, weight=1.0):
        v, w = _float64(value, self.ring.device), _float64(weight, self.ring.device)
        v, w = torch.broadcast_tensors(v, w)
        nan = torch.isnan(v) | torch.isnan(w)
        if self.nan_strategy == "error":
            self.bad += nan.sum().reshape(1)
        if self.nan_strategy != "propagate":
            v = torch.where(nan, torch.zeros_like(v), v)
            w = torch.where(nan, torch.zeros_like(w), w)
        row = torch.stack([(v * w).sum(), w.sum()])[None]
        pos = torch.remainder(self.seen, self.window).to(torch.int64)
        self.ring.index_copy_(0, pos, row)
        self.seen += 1

    def _compute(self, state):
        ring = state["ring"]
        return ring[:, 0].sum() / ring[:, 1].sum()
