"""Statistics over ``ops.weighted_moments`` and ``ops.running_extrema``.

``MomentsStatistic`` (slots ``moments`` SUM [9] as in
``d9d_kernels.reference.MOMENTS``, ``bad`` SUM [1], ``pivot`` REPLICA [2],
NaN = unset) backs SumMetric / WeightedMeanMetric and the regression metrics;
``ExtremaStatistic`` (``extrema`` MAX [2] = (max, -min), ``bad`` SUM [1])
backs MaxMetric / MinMetric.

Pivots: the op sets an unset pivot from the first valid element, so sums are
about a value near the data (exact variances for ``1e6 + noise``). Ranks (or
saved checkpoint states) may hold different pivots; before their sums are
added they are re-centred to one pivot with ``recenter_moments`` (exact shift
formulas). The first distributed sync adopts, per component, the pivot of
the lowest rank that has one; it then stays fixed (``reset`` keeps it).
"""

from __future__ import annotations

import torch

from d9d_kernels import ops
from d9d_kernels.core.statistic import MAX, REPLICA, SUM, Slot, Statistic, param, statistic
from d9d_kernels.reference import MOMENTS_SIZE

__all__ = ["MomentsStatistic", "OutputMomentsStatistic", "ExtremaStatistic", "recenter_moments", "first_set"]


def recenter_moments(moments: torch.Tensor, old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Moments about pivot ``old`` (float64 [..., 2] = px, py) re-expressed about ``new``.

    Unset (NaN) pivots mean 0 (what the op used). With ``d = old - new``:
    ``sx' = sx + w dx``, ``sxx' = sxx + 2 dx sx + w dx^2`` (same for y),
    ``sxy' = sxy + dx sy + dy sx + w dx dy``; ``w, sae, sse, n`` unchanged.
    Leading dims: one moment vector per output. Torch ops only (no host
    sync). Returns a new [..., 9] tensor.
    """
    d = torch.nan_to_num(old, nan=0.0) - torch.nan_to_num(new, nan=0.0)
    dx, dy = d[..., 0], d[..., 1]
    w, sx, sxx, sy, syy, sxy = (moments[..., i] for i in range(6))
    return torch.stack(
        [
            w,
            sx + w * dx,
            sxx + 2 * dx * sx + w * dx * dx,
            sy + w * dy,
            syy + 2 * dy * sy + w * dy * dy,
            sxy + dx * sy + dy * sx + w * dx * dy,
            moments[..., 6],
            moments[..., 7],
            moments[..., 8],
        ],
        dim=-1,
    )


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class _Fills:
    """Python numbers as float64 ``[1]`` tensors for planned updates: each new
    value of an input is filled once on the device (the ops only read it, so
    a repeated value reuses its fill; an equal value of another type or a NaN
    is filled again)."""

    def __init__(self):
        self._last: dict[str, tuple[object, torch.Tensor]] = {}

    def __call__(self, name: str, v, device: torch.device) -> torch.Tensor:
        f = self._last.get(name)
        if f is None or not (f[0] == v and type(f[0]) is type(v)):
            f = self._last[name] = (v, torch.full((1,), float(v), dtype=torch.float64, device=device))
        return f[1]


def _raw_on_state_device(op_name: str, slot: str, call):
    """A plan step ``call(op, state, inputs)`` with ``op = ops.raw(op_name)``
    for the device of ``state[slot]``, resolved at the first call (Python
    number inputs carry no device)."""
    op = []

    def run(state, inputs):
        if not op:
            op.append(ops.raw(op_name, state[slot].device))
        call(op[0], state, inputs)

    return run


def as_tensor(v, device: torch.device) -> torch.Tensor:
    """A tensor as is; a Python number as a float64 0-d tensor made by a fill
    kernel on ``device`` (no host->device copy, no sync)."""
    if isinstance(v, torch.Tensor):
        return v
    return torch.full((), float(v), dtype=torch.float64, device=device)


def first_set(values: list[torch.Tensor]) -> torch.Tensor:
    """Per component, the first non-NaN value across ``values`` (NaN if none)."""
    p = torch.stack([v.reshape(-1) for v in values])
    idx = torch.argmax((~torch.isnan(p)).to(torch.int8), dim=0)
    return p.gather(0, idx[None])[0].reshape(values[0].shape)


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
        weights = None if weights is None else as_tensor(weights, dev)
        ops.weighted_moments(
            x, y, weights, mask, state=state["moments"], bad=state["bad"], pivot=state["pivot"], skip_bad=self.skip_bad
        )

    def bind(self, sample: dict):
        """The raw ``weighted_moments`` op when ``x`` is a floating tensor and
        ``y``, ``weights``, ``mask`` are None or of ``x``'s shape (``y``,
        ``weights`` of its dtype); ``weights`` may also be a Python number
        (filled to ``x``'s size, in ``x``'s dtype when exact there, else
        float64; the kernel computes in float64, so results equal the checked
        path's)."""
        x, w = sample.get("x"), sample.get("weights")
        if self._numbers(sample):
            return self._bind_numbers(w is not None)
        if not self._direct(sample):
            return super().bind(sample)
        w_number = w is not None and not isinstance(w, torch.Tensor)
        op = ops.raw("weighted_moments", x.device)
        skip_bad = self.skip_bad
        filled = [None, None]  # (number, its fill): the op only reads weights, so a repeated n reuses it

        def run(state, inputs):
            x = inputs["x"].reshape(-1)
            y, w, mask = inputs.get("y"), inputs.get("weights"), inputs.get("mask")
            if y is not None:
                y = y.reshape(-1)
            if w_number:
                if filled[0] != w:
                    # in x's dtype when w is exact there (a host-side test): the op then
                    # needs no float64 copy of x, one op less per update (bench/analysis.md,
                    # training loop); the kernel multiplies in float64 either way
                    wv = float(w)
                    exact = torch.tensor(wv, dtype=x.dtype).item() == wv
                    filled[:] = w, torch.full(x.shape, wv, dtype=x.dtype if exact else torch.float64, device=x.device)
                w = filled[1]
            elif w is not None:
                w = w.reshape(-1)
            if mask is not None:
                mask = mask.reshape(-1)
            op(x, y, w, mask, skip_bad, state["moments"], state["bad"], state["pivot"])

        return run

    @staticmethod
    def _numbers(sample: dict) -> bool:
        """``x`` (and ``weights``) Python numbers, no ``y``, no ``mask``."""
        x, y, w, mask = (sample.get(k) for k in ("x", "y", "weights", "mask"))
        return _number(x) and y is None and mask is None and (w is None or _number(w))

    @staticmethod
    def _direct(sample: dict) -> bool:
        """Whether the raw op takes ``sample`` flattened: ``x``, ``y``,
        ``weights`` (or a number), ``mask`` None or of ``x``'s shape. Of one
        floating dtype every backend takes them; integer or mixed dtypes (a
        0-d int64 token count beside a float32 loss) the compiled kernels
        promote themselves (integers to float64)."""
        x, y, w, mask = (sample.get(k) for k in ("x", "y", "weights", "mask"))
        if not isinstance(x, torch.Tensor) or x.dtype.is_complex:
            return False
        tensors = [t for t in (x, y, w) if isinstance(t, torch.Tensor)]
        if any(t.dtype not in ops.FLOATS or t.dtype != x.dtype for t in tensors) and \
                ops.backend_for("weighted_moments", x.device, None) not in ("cpp", "cuda"):
            return False
        same = lambda t: t is None or (  # noqa: E731
            isinstance(t, torch.Tensor) and t.shape == x.shape and not t.dtype.is_complex
        )
        return (
            same(y)
            and ((w is not None and not isinstance(w, torch.Tensor)) or same(w))
            and (mask is None or (mask.dtype == torch.bool and mask.shape == x.shape))
        )

    def compile_step(self, sample: dict, state: dict):
        """``bind``'s raw op call as a ``d9d_kernels.core.compiled.OpStep``."""
        from d9d_kernels.core.compiled import OpStep

        w = sample.get("weights")
        consts = dict(skip_bad=self.skip_bad, state=state["moments"], bad=state["bad"], pivot=state["pivot"])
        if self._numbers(sample):
            if ops.backend_for("weighted_moments", state["moments"].device, None) not in ("cpp", "cuda"):
                return None
            inputs = {"x": ("fill1", "x"), "weights": ("fill1", "weights")}
            consts.update(y=None, mask=None)
        elif self._direct(sample) and ops.backend_for("weighted_moments", sample["x"].device, None) in ("cpp", "cuda"):
            inputs = {"x": ("flat", "x"), "y": ("flat", "y"), "mask": ("flat", "mask"),
                      "weights": ("flat", "weights") if w is None or isinstance(w, torch.Tensor)
                      else ("fill_like", "weights", "x")}
        else:
            return None
        return OpStep("weighted_moments", inputs, consts)

    def _bind_numbers(self, weighted: bool):
        """``x`` (and ``weights``) Python numbers, e.g. ``SumMetric.update(float(n))``:
        each new value filled once as a float64 ``[1]`` tensor on the state's
        device (the op only reads it; a repeated value reuses the fill), then
        the raw op."""
        skip_bad, fill = self.skip_bad, _Fills()

        def call(op, state, inputs):
            dev = state["moments"].device
            w = fill("weights", inputs["weights"], dev) if weighted else None
            op(fill("x", inputs["x"], dev), None, w, None, skip_bad, state["moments"], state["bad"], state["pivot"])

        return _raw_on_state_device("weighted_moments", "moments", call)

    def choose_replica(self, replicas):
        return {"pivot": first_set([r["pivot"] for r in replicas])}

    def adopt_replica(self, state, replica) -> None:
        new = replica["pivot"].to(state["pivot"].device)
        state["moments"].copy_(recenter_moments(state["moments"], state["pivot"], new))
        state["pivot"].copy_(new)

    def replica_settled(self, replica) -> bool:
        p = replica["pivot"].reshape(-1, 2)
        return not bool(torch.isnan(p[:, : 1 + self.paired]).any())


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

    def bind(self, sample: dict):
        update = self.update
        return lambda state, inputs: update(state, **inputs)

    def compile_step(self, sample: dict, state: dict):
        return None


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

    def compile_step(self, sample: dict, state: dict):
        """``bind``'s raw op call as a ``d9d_kernels.core.compiled.OpStep``."""
        from d9d_kernels.core.compiled import OpStep

        x, mask = sample.get("x"), sample.get("mask")
        if _number(x) and mask is None:
            inputs = {"x": ("fill1", "x"), "mask": ("as_is", "mask")}
        elif (isinstance(x, torch.Tensor) and x.dtype in ops.FLOATS
              and (mask is None or (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
                                    and mask.shape == x.shape))):
            inputs = {"x": ("flat", "x"), "mask": ("flat", "mask")}
        else:
            return None
        if ops.backend_for("running_extrema", state["extrema"].device, None) not in ("cpp", "cuda"):
            return None
        return OpStep("running_extrema", inputs, dict(skip_bad=self.skip_bad, state=state["extrema"], bad=state["bad"]))

    def bind(self, sample: dict):
        """The raw ``running_extrema`` op for a floating tensor ``x`` (``mask``
        None or bool of ``x``'s shape) or a Python number (filled as in
        ``MomentsStatistic``)."""
        x, mask = sample.get("x"), sample.get("mask")
        number = _number(x) and mask is None
        tensor = (isinstance(x, torch.Tensor) and x.dtype in ops.FLOATS
                  and (mask is None or (isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
                                        and mask.shape == x.shape)))
        if not (number or tensor):
            return super().bind(sample)
        skip_bad, fill = self.skip_bad, _Fills()

        def call(op, state, inputs):
            st = state["extrema"]
            x = fill("x", inputs["x"], st.device) if number else inputs["x"].reshape(-1)
            m = inputs.get("mask")
            op(x, None if m is None else m.reshape(-1), skip_bad, st, state["bad"])

        return _raw_on_state_device("running_extrema", "extrema", call)
