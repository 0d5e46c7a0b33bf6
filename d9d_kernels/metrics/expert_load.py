"""ExpertLoad: MoE router statistics (expert load, imbalance, dead experts) of every layer.

State (``ExpertLoadStatistic``, SUM, synced in the group's one collective):
``load`` ``[L, E]`` (routed slots per layer and expert since the reset,
float64: exact to 2**53), ``bad`` ``[1]`` (slots whose expert index lies
outside ``[0, E)`` and is not ``-1``, and negative / non-finite counts), and
with ``with_probs=True`` ``gate`` ``[L, E + 1]`` (Σ over tokens of the gate
probabilities per expert, then the token count). A layer a rank never
updates holds zeros there, so the SUM over the pipeline and data ranks
gives every rank every layer: sync over a context that spans ``pp`` and the
data dims (a d9d context's default does).

Summaries (``compute()``; docs/metrics.md, "MoE router statistics"), over the
*active* layers (those with at least one routed slot since the reset; a
layer without one is left out of every summary; no active layer gives NaN):

* ``max_violation``: max over layers of ``max_e load / mean_e load - 1``;
* ``dead_experts``: (layer, expert) pairs with no slot, summed over layers;
* ``cv``: mean over layers of ``std_e load / mean_e load`` (population std);
* ``entropy``: mean over layers of ``-Σ_e p log p / log E``, ``p = load /
  Σ_e load`` (``0 log 0 = 0``; 1 when ``E == 1``);
* with ``with_probs``: ``lb_loss``, mean over layers of the load-balancing
  term ``E Σ_e f_e P_e`` (``f`` the fraction of slots routed to ``e``, ``P``
  its mean gate probability; 1 when both are uniform), and
  ``gate_entropy``, the normalised entropy of ``P``, over layers with gate
  data.

``per_layer()`` gives the per-layer tensors and p50 / p90 / max of the
per-layer violation.
"""

from __future__ import annotations

import math
import re

import torch

from d9d_kernels import ops
from d9d_kernels.core.metric import Metric, host_checks, poisoned
from d9d_kernels.core.statistic import SUM, Slot, Statistic, either, param, statistic
from d9d_kernels.metrics import _args as A
from d9d_kernels.ops.expert_histogram import layer_list

__all__ = ["ExpertLoad", "ExpertLoadStatistic", "expert_load_summary", "moe_layers"]

NAME = "ExpertLoad"


@statistic
class ExpertLoadStatistic(Statistic):
    """``load`` [L, E] + ``bad`` [1] (+ ``gate`` [L, E + 1] when ``gate``); SUM.

    Args:
        num_layers: L.
        num_experts: E.
        gate: keep the gate-probability sums (merged: kept if any member wants them).
    """

    num_layers: int = param(convert=int)
    num_experts: int = param(convert=int)
    gate: bool = param(False, convert=bool, merge=either)
    inputs = ("indices", "layers", "probs", "counts")

    def slots(self) -> list[Slot]:
        L, E = self.num_layers, self.num_experts
        out = [Slot("load", SUM, (L, E)), Slot("bad", SUM, (1,))]
        return out + ([Slot("gate", SUM, (L, E + 1))] if self.gate else [])

    def update(self, state: dict[str, torch.Tensor], indices=None, layers=None, probs=None, counts=None) -> None:
        if counts is None:
            ops.expert_histogram(indices, layers, probs, load=state["load"], bad=state["bad"],
                                 gate=state.get("gate") if probs is not None else None)
            return
        # counts [L', E]: negative or non-finite entries are bad and left out
        c = counts.to(torch.float64)
        ok = torch.isfinite(c) & (c >= 0)
        state["bad"].add_((~ok).sum(dtype=torch.float64).reshape(1))
        c = torch.where(ok, c, torch.zeros((), dtype=torch.float64, device=c.device))
        load = state["load"]
        if not layers:
            return
        if layers == list(range(layers[0], layers[0] + len(layers))):  # a pipeline stage's contiguous layers
            load[layers[0]:layers[0] + len(layers)].add_(c)
        else:
            load.index_add_(0, _layer_index(layers, c.device), c)


_INDEX: dict = {}


def _layer_index(layers: list[int], device: torch.device) -> torch.Tensor:
    """``layers`` as an int64 tensor on ``device``, made once per (layers, device)."""
    key = (tuple(layers), device)
    t = _INDEX.get(key)
    if t is None:
        t = _INDEX[key] = torch.tensor(layers, dtype=torch.int64, device=device)
    return t


def expert_load_summary(load: torch.Tensor, gate: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The per-layer statistics of ``load`` [L, E] (and ``gate`` [L, E + 1]),
    torch ops on the device: ``active`` [L] bool, ``tokens`` [L] (slots),
    ``violation``, ``cv``, ``entropy`` [L] (NaN for inactive layers),
    ``dead`` [L] (0 for inactive layers), and with ``gate`` ``gate_mass``
    [L, E] (mean gate probability per expert), ``lb_loss``,
    ``gate_entropy`` [L] (NaN where a layer has no gate data or no load)."""
    E = load.shape[-1]
    tokens = load.sum(-1)
    active = tokens > 0
    nan = torch.full_like(tokens, float("nan"))
    mean = tokens / E
    safe = torch.where(active, mean, torch.ones_like(mean))
    violation = torch.where(active, load.amax(-1) / safe - 1, nan)
    std = (load - mean[..., None]).square().mean(-1).sqrt()
    cv = torch.where(active, std / safe, nan)
    p = load / torch.where(active, tokens, torch.ones_like(tokens))[..., None]
    out = {"active": active, "tokens": tokens, "violation": violation, "dead": ((load == 0) & active[..., None]).sum(
        -1, dtype=torch.float64), "cv": cv, "entropy": torch.where(active, _norm_entropy(p, E), nan)}
    if gate is not None:
        n = gate[..., E]
        has = n > 0
        mass = gate[..., :E] / torch.where(has, n, torch.ones_like(n))[..., None]
        both = has & active
        out["gate_mass"] = torch.where(has[..., None], mass, torch.full_like(mass, float("nan")))
        out["lb_loss"] = torch.where(both, E * (p * mass).sum(-1), nan)
        msum = mass.sum(-1)
        q = mass / torch.where(msum > 0, msum, torch.ones_like(msum))[..., None]
        out["gate_entropy"] = torch.where(has & (msum > 0), _norm_entropy(q, E), nan)
    return out


def _norm_entropy(p: torch.Tensor, E: int) -> torch.Tensor:
    """``-Σ p log p / log E`` over the last dim (``0 log 0 = 0``); 1 when E == 1."""
    if E == 1:
        return torch.ones_like(p[..., 0])
    return -torch.special.xlogy(p, p).sum(-1) / math.log(E) + 0.0  # + 0.0: no -0.0 for a one-expert layer


def _percentile(values: torch.Tensor, keep: torch.Tensor, q: float) -> torch.Tensor:
    """numpy's linear-interpolation percentile ``q`` of ``values`` where ``keep``
    (NaN when nothing is kept), by a sort and a gather on the device (no host
    read: ``torch.quantile`` may check ``q`` on the host)."""
    ordered = torch.where(keep, values, math.inf).sort().values  # kept values first
    n = keep.sum(dtype=values.dtype)
    pos = (n - 1).clamp(min=0) * q
    lo = pos.floor()
    below = ordered.gather(0, lo.to(torch.int64).reshape(1))[0]
    above = ordered.gather(0, pos.ceil().to(torch.int64).reshape(1))[0]
    value = below + (above - below) * (pos - lo)
    return torch.where(n > 0, value, torch.full_like(value, float("nan")))


def _mean_over(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``keep``; NaN when nothing is kept (0 / 0)."""
    zero = torch.zeros_like(values)
    return torch.where(keep, values, zero).sum() / keep.sum(dtype=values.dtype)


def moe_layers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """``(layer id, module)`` of every d9d MoE layer of ``model`` (a module with
    a ``tokens_per_expert`` buffer and ``reset_stats()``, as
    ``d9d.module.block.moe.MoELayer``), in module order. The id is the last
    integer part of the module's name (d9d's models keep their decoder layers
    in a ``ModuleDict`` keyed by global layer index, ``layers.12.mlp``), so a
    pipeline stage's layers get their global ids; when some name has none,
    or two share one, the ids are the positions 0, 1, ..."""
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(getattr(m, "tokens_per_expert", None), torch.Tensor) and callable(getattr(m, "reset_stats", None))]
    ids = []
    for name, _ in found:
        nums = re.findall(r"(?:^|\.)(\d+)(?=\.|$)", name)
        ids.append(int(nums[-1]) if nums else None)
    if None in ids or len(set(ids)) != len(ids):
        ids = list(range(len(found)))
    return [(i, m) for i, (_, m) in zip(ids, found)]


class ExpertLoad(Metric):
    """Expert load, imbalance and dead experts of every MoE layer (router statistics).

    ``compute()`` returns a dict of 0-d float64 tensors: ``max_violation``,
    ``dead_experts``, ``cv``, ``entropy`` (and ``lb_loss``, ``gate_entropy``
    with ``with_probs``); the module docstring defines them. ``per_layer()``
    gives the per-layer tensors and percentiles. Sync over a context that
    spans the pipeline (``pp``) and data dims so every rank sees every layer.

    Args:
        num_experts: E, the routed experts per layer.
        num_layers: L, the MoE layers of the whole model (all pipeline stages).
        top_k: experts per token: the last dim of ``indices``.
        with_probs: also take the gate probabilities (``update(probs=...)``)
            and report the load-balancing term and the gate-mass entropy.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> m = dk.ExpertLoad(num_experts=4, num_layers=2, top_k=2)
        >>> m.update(torch.tensor([[[0, 1], [2, 3]], [[0, 0], [0, -1]]]))  # [L, T, k]; -1: dropped
        >>> out = m.compute()
        >>> out["max_violation"].item(), out["dead_experts"].item()   # layer 1: 3 slots on expert 0
        (3.0, 3.0)
    """

    _bad_cause = "expert_index_out_of_range"

    def __init__(self, num_experts: int, num_layers: int = 1, top_k: int = 1, with_probs: bool = False):
        super().__init__()
        A.check_int(NAME, "num_experts", num_experts)
        A.check_int(NAME, "num_layers", num_layers)
        A.check_int(NAME, "top_k", top_k)
        A.check(top_k <= num_experts, NAME, "top_k", f"must be <= num_experts ({num_experts}), got {top_k}")
        A.check(isinstance(with_probs, bool), NAME, "with_probs", f"must be a bool, got {with_probs!r}", TypeError)
        self.num_experts, self.num_layers, self.top_k, self.with_probs = num_experts, num_layers, top_k, with_probs

    def _statistics(self):
        return {"s": ExpertLoadStatistic(self.num_layers, self.num_experts, gate=self.with_probs)}

    def _raise_on_bad(self) -> bool:
        return True  # an expert index out of range is a routing bug, never data to skip

    def _bad_message(self, count: int) -> str:
        return (f"{self._label}: {count} routed slot(s) with an expert index outside [0, {self.num_experts}) "
                "(other than -1, a dropped slot) or negative / non-finite counts were seen since the last reset")

    def _layers(self, layers, rows: int, arg: str) -> list[int]:
        ids = layer_list(layers, rows, NAME, "layers")
        if layers is None and rows != self.num_layers:
            A.fail(NAME, arg, f"holds {rows} layer(s) but the metric has num_layers={self.num_layers}: pass "
                   "layers=[...] (the layer ids its first dim holds)")
        A.check(len(ids) == rows, NAME, "layers", f"must name one layer per row of {arg} ({rows}), got {len(ids)}")
        for l in ids:
            if not 0 <= l < self.num_layers:
                A.fail(NAME, "layers", f"must lie in [0, {self.num_layers}) (num_layers), got {l}")
        return ids

    def update(self, indices: torch.Tensor | None = None, layers=None, probs: torch.Tensor | None = None, *,
               counts: torch.Tensor | None = None) -> None:
        """Adds routing decisions.

        Args:
            indices: int ``[L', T, top_k]`` expert indices (``[T, top_k]`` when
                one layer is fed); ``-1`` = a dropped slot.
            layers: the layer ids ``indices``' (or ``counts``') first dim holds
                (host ints: a list, a range or a CPU tensor); default
                ``range(num_layers)``.
            probs: ``[L', T, E]`` (``[T, E]``) gate probabilities (the full
                softmax), only with ``with_probs=True``.
            counts: ``[L', E]`` (``[E]``) tokens per expert instead of
                ``indices`` (e.g. d9d's ``MoELayer.tokens_per_expert``).
        """
        dev, E, k = self.device, self.num_experts, self.top_k
        A.check((indices is None) != (counts is None), NAME, "indices", "or 'counts' must be given, not both")
        if probs is not None and not self.with_probs:
            A.fail(NAME, "probs", "needs ExpertLoad(..., with_probs=True) (the gate sums are its state)")
        if counts is not None:
            A.check_tensor(NAME, "counts", counts)
            A.check(probs is None, NAME, "probs", "goes with indices, not counts")
            A.check(counts.device == dev, NAME, "counts", f"must be on {dev}, got {counts.device}")
            if counts.dim() == 1:
                counts = counts[None]
            if counts.dim() != 2 or counts.shape[1] != E:
                A.fail(NAME, "counts", f"must be [L', {E}] (or [{E}]), got shape {tuple(counts.shape)}")
            ids = self._layers(layers, counts.shape[0], "counts")
            self._feed({"s": dict(counts=counts, layers=ids)})
            return
        A.check_tensor(NAME, "indices", indices)
        if indices.is_floating_point() or indices.dtype == torch.bool:
            A.fail(NAME, "indices", f"must hold integer expert indices, got {indices.dtype}", TypeError)
        A.check(indices.device == dev, NAME, "indices", f"must be on {dev}, got {indices.device}")
        if indices.dim() == 2:
            indices = indices[None]
        if indices.dim() != 3 or indices.shape[2] != k:
            A.fail(NAME, "indices", f"must be [L', T, top_k={k}] (or [T, {k}] for one layer), got shape "
                   f"{tuple(indices.shape)}")
        ids = self._layers(layers, indices.shape[0], "indices")
        if probs is not None:
            A.check_tensor(NAME, "probs", probs)
            A.check(probs.is_floating_point(), NAME, "probs", f"must be floating, got {probs.dtype}", TypeError)
            A.check(probs.device == dev, NAME, "probs", f"must be on {dev}, got {probs.device}")
            if probs.dim() == 2:
                probs = probs[None]
            want = (indices.shape[0], indices.shape[1], E)
            if tuple(probs.shape) != want:
                A.fail(NAME, "probs", f"must be [L', T, E] = {list(want)}, got shape {tuple(probs.shape)}")
        self._feed({"s": dict(indices=indices, layers=ids, probs=probs)})

    def update_from_model(self, model: torch.nn.Module, layers=None, reset_stats: bool = True) -> None:
        """Adds the ``tokens_per_expert`` counters of every d9d MoE layer of
        ``model`` (``moe_layers``: their global layer ids from the module
        names, unless ``layers`` names them) in one update, then (by default)
        zeroes the counters with the layers' ``reset_stats()``, so the next
        call adds only new tokens. Reads nothing on the host."""
        found = moe_layers(model)
        A.check(bool(found), NAME, "model", "has no d9d MoE layer (a module with tokens_per_expert and reset_stats)")
        counts = torch.stack([m.tokens_per_expert for _, m in found])
        self.update(counts=counts, layers=[i for i, _ in found] if layers is None else layers)
        if reset_stats:
            for _, m in found:
                m.reset_stats()

    def _compute(self, states):
        s = states["s"]
        per = expert_load_summary(s["load"], s.get("gate"))
        active = per["active"]
        nan = torch.full((), float("nan"), dtype=torch.float64, device=active.device)
        anyl = active.any()
        out = {
            "max_violation": torch.where(anyl, torch.where(active, per["violation"], -math.inf).amax(), nan),
            "dead_experts": torch.where(anyl, per["dead"].sum(), nan),
            "cv": _mean_over(per["cv"], active),
            "entropy": _mean_over(per["entropy"], active),
        }
        if "gate" in s:
            out["lb_loss"] = _mean_over(per["lb_loss"], ~torch.isnan(per["lb_loss"]))
            out["gate_entropy"] = _mean_over(per["gate_entropy"], ~torch.isnan(per["gate_entropy"]))
        return out

    def per_layer(self) -> dict[str, torch.Tensor]:
        """Per-layer values (synced after ``wait_sync``, else local), on the device.

        ``load`` [L, E] (slots per expert), ``active`` [L] bool, ``tokens``
        [L] (slots), ``violation`` / ``cv`` / ``entropy`` [L] (NaN for
        layers without tokens), ``dead`` [L]; ``violation_p50``,
        ``violation_p90``, ``violation_max`` (0-d, over active layers; NaN
        without any); with ``with_probs`` also ``gate_mass`` [L, E] (mean
        gate probability per expert), ``lb_loss`` and ``gate_entropy`` [L].
        Bad inputs raise (CPU) or make every value NaN (GPU), as ``compute()``.
        """
        self._warn_unsynced()
        states = self._states()
        bad = self._bad_count(states)
        checked = host_checks(self.device)
        if bad is not None and checked and bad.item() != 0:
            self._checked_compute(states)  # raises with the causes
        s = states["s"]
        out = {"load": s["load"].clone(), **expert_load_summary(s["load"], s.get("gate"))}
        v, active = out["violation"], out["active"]
        out["violation_p50"] = _percentile(v, active, 0.5)
        out["violation_p90"] = _percentile(v, active, 0.9)
        out["violation_max"] = torch.where(active.any(), torch.where(active, v, -math.inf).amax(),
                                           torch.full_like(v[0], float("nan")))
        return out if bad is None or checked else poisoned(out, bad)
