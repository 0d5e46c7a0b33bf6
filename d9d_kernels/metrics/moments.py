"""Statistics over ``ops.weighted_moments`` and ``ops.running_extrema``.

``MomentsStatistic`` (slots ``moments`` SUM [9] as in
``d9d_kernels.reference.MOMENTS``, ``bad`` SUM [1], ``pivot`` REPLICA [2],
NaN = unset) backs SumMetric / WeightedMeanMetric and the regression metrics;
``ExtremaStatistic`` (``extrema`` MAX [2] = (max, -min), ``bad`` SUM [1])
backs MaxMetric / MinMetric.

Pivots: the op sets an unset pivot from the first valid element, so sums are
about a value near the data (exact variances for ``1e6 + noise``). Ranks (or
saved checkpoint states) may hold different pivots; before their sums are
added they are re-centred to one pivot with ``ops.moments_recenter`` (exact
shift formulas) by the core, from ``MomentsStatistic.pivots``: a merge to
the first set one (core/storage.py ``align``), a sync to its context's
reference (core/sync.py); ``reset`` clears them.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import torch

from d9d_kernels import ops
from d9d_kernels.core.statistic import MAX, REPLICA, SUM, Slot, Statistic, param, statistic
from d9d_kernels.reference import MOMENTS_SIZE

__all__ = ["Moments", "MomentsStatistic", "OutputMomentsStatistic", "ExtremaStatistic"]


def as_tensor(v, device: torch.device, like: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor as is; a Python number as a 0-d tensor made by a fill kernel on
    ``device`` (no host->device copy, no sync): in ``like``'s floating dtype
    when the number is exact there (the kernel then reads one dtype, no
    conversion), else float64. The replay of a recorded fill applies the same
    rule to every new value (csrc/host/replay.cpp ``exact_in``)."""
    if isinstance(v, torch.Tensor):
        return v
    v = float(v)
    # traced: float64 (the kernel computes in float64: the same bits for an exact value)
    narrow = like is not None and like.dtype in (torch.float32, torch.float16, torch.bfloat16) \
        and not torch.compiler.is_compiling()
    dtype = like.dtype if narrow and exact_in(v, like.dtype) else torch.float64
    return torch.full((), v, dtype=dtype, device=device)


def exact_in(v: float, dtype: torch.dtype) -> bool:
    """Whether ``v`` is exactly representable in the floating ``dtype`` (float32, float16, bfloat16)."""
    try:
        f32 = struct.unpack("f", struct.pack("f", v))[0]
        if dtype == torch.float16:
            return struct.unpack("e", struct.pack("e", v))[0] == v
    except OverflowError:
        return False
    bf16_ok = struct.unpack("I", struct.pack("f", f32))[0] & 0xFFFF == 0
    return f32 == v and (dtype != torch.bfloat16 or bf16_ok)


class Moments(Mapping):
    """A moments statistic's state by name, pivot-free: what formulas read
    (``states["m"]["mean_x"]``). Each entry is computed on first access
    (torch ops on the device); leading dims: one value per output.

    ============  ==========================================================
    ``weight``    Σw
    ``count``     n, the valid elements (unweighted)
    ``sum_x``     Σw·x                       (``sum_y``: Σw·y)
    ``mean_x``    Σw·x / Σw, NaN where Σw = 0 (``mean_y``)
    ``ss_x``      Σw·(x − mean_x)², ≥ 0, 0 where Σw = 0 (``ss_y``)
    ``sp_xy``     Σw·(x − mean_x)(y − mean_y), 0 where Σw = 0
    ``sum_sq_y``  Σw·y²
    ``sae``       Σw·|x − y|                 (``sse``: Σw·(x − y)²)
    ``bad``       the bad-input count
    ============  ==========================================================
    """

    NAMES = ("weight", "count", "sum_x", "sum_y", "mean_x", "mean_y", "ss_x", "ss_y", "sp_xy", "sum_sq_y",
             "sae", "sse", "bad")

    def __init__(self, state: dict[str, torch.Tensor]):
        self._m, self._pivot, self._bad = state["moments"], state["pivot"], state["bad"]
        self._cache: dict[str, torch.Tensor] = {}

    def __iter__(self):
        return iter(self.NAMES)

    def __len__(self) -> int:
        return len(self.NAMES)

    def __getitem__(self, name: str) -> torch.Tensor:
        v = self._cache.get(name)
        if v is None:
            if name not in self.NAMES:
                raise KeyError(f"{name!r}: a moments statistic's state holds {', '.join(self.NAMES)}")
            v = self._cache[name] = self._make(name)
        return v

    def _make(self, name: str) -> torch.Tensor:
        m, i = self._m, {"x": 1, "y": 3}
        w = m[..., 0]
        p = {k: torch.nan_to_num(self._pivot[..., j], nan=0.0) for j, k in enumerate("xy")}
        if name == "weight":
            return w
        if name == "count":
            return m[..., 8]
        if name == "bad":
            return self._bad
        if name in ("sae", "sse"):
            return m[..., 6 if name == "sae" else 7]
        if name == "sp_xy":
            return m[..., 5] - _safe_div(m[..., 1] * m[..., 3], w)
        c = name[-1]
        s, ss = m[..., i[c]], m[..., i[c] + 1]
        if name.startswith("sum_sq"):
            return ss + 2.0 * p[c] * s + w * p[c] * p[c]
        if name.startswith("sum"):
            return s + w * p[c]
        if name.startswith("mean"):
            return torch.where(w == 0, float("nan"), s / w + p[c])
        return torch.clamp(ss - _safe_div(s * s, w), min=0.0)  # rounding can leave a tiny negative sum


def _safe_div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b == 0, torch.zeros_like(a), a / torch.where(b == 0, torch.ones_like(b), b))


@statistic
class Shareable(Statistic):
    """Base of statistics fed per metric or per group.

    Fields (keyword-only):
        shared: merge with equal-config statistics of other members of a
            group (they must be fed the same inputs, e.g. regression metrics
            on ``preds``/``target``). Aggregation metrics, fed one by one,
            use ``shared=False``: the statistic merges with nothing else.
    """

    shared: bool = param(False, convert=bool, kw_only=True)

    def merge_key(self):
        key = super().merge_key()
        return key if self.shared else key + (id(self),)


@statistic
class MomentsStatistic(Shareable):
    """Weighted moments of ``x`` (and ``y``): one ``weighted_moments`` call.

    Args:
        paired: ``y`` is given (regression: x = preds, y = target).
        skip_bad: leave non-finite elements out (``nan_strategy="ignore"``).
        shared: see ``Shareable``.

    ``update(state, x, y=None, weights=None, mask=None)``.
    """

    inputs = ("x", "y", "weights", "mask")

    paired: bool = param(False, convert=bool)
    skip_bad: bool = param(False, convert=bool)

    def slots(self) -> list[Slot]:
        return [
            Slot("moments", SUM, (MOMENTS_SIZE,)),
            Slot("bad", SUM, (1,)),
            Slot("pivot", REPLICA, (2,), float("nan")),
        ]

    def update(self, state, x, y=None, weights=None, mask=None) -> None:
        """``x``, ``y``, ``weights``: tensors or Python numbers."""
        dev = state["moments"].device
        x, y = as_tensor(x, dev), (None if y is None else as_tensor(y, dev))
        weights = None if weights is None else as_tensor(weights, dev, like=x)
        ops.weighted_moments(
            x, y, weights, mask, state=state["moments"], bad=state["bad"], pivot=state["pivot"], skip_bad=self.skip_bad
        )

    def view(self, state, need) -> Moments:
        """The state by name, pivot-free (``Moments``): what formulas read."""
        return Moments(state)

    def pivots(self):
        return [("moments", "pivot", self.paired)]


@statistic
class OutputMomentsStatistic(MomentsStatistic):
    """``MomentsStatistic`` per output column of ``[N, outputs]`` inputs
    (torchmetrics' ``multioutput``): ``moments`` [outputs, 9], ``pivot``
    [outputs, 2], one ``weighted_moments`` call per column; ``weights`` and
    ``mask`` broadcast to ``x``'s shape. Always the Python update (no raw op).
    """

    outputs: int = param(1, convert=int)

    def slots(self) -> list[Slot]:
        M = self.outputs
        return [
            Slot("moments", SUM, (M, MOMENTS_SIZE)),
            Slot("bad", SUM, (1,)),
            Slot("pivot", REPLICA, (M, 2), float("nan")),
        ]

    def update(self, state, x, y=None, weights=None, mask=None) -> None:
        col = lambda t, j: None if t is None else torch.broadcast_to(t, x.shape)[:, j]  # noqa: E731
        for j in range(self.outputs):
            ops.weighted_moments(x[:, j], col(y, j), col(weights, j), col(mask, j), state=state["moments"][j],
                                 bad=state["bad"], pivot=state["pivot"][j], skip_bad=self.skip_bad)

@statistic
class ExtremaStatistic(Shareable):
    """Running (max, -min) of ``x``: one ``running_extrema`` call, MAX kind.

    ``update(state, x, mask=None)``. ``shared``: see ``Shareable``.
    """

    inputs = ("x", "mask")

    skip_bad: bool = param(False, convert=bool)

    def slots(self) -> list[Slot]:
        return [Slot("extrema", MAX, (2,), float("-inf")), Slot("bad", SUM, (1,))]

    def update(self, state, x, mask=None) -> None:
        """``x``: a tensor or a Python number."""
        x = as_tensor(x, state["extrema"].device)
        ops.running_extrema(x, mask, state=state["extrema"], bad=state["bad"], skip_bad=self.skip_bad)

