"""Fused compute: a group's members evaluated per formula family, not one by one.

Each member's own ``compute()`` costs views of its statistics, a bad-count
read on the host and ~10 small torch ops of its formula: per member, so a
large group's compute grows past its sync. Here members are sorted once into *families*
whose formulas are the same torch expression on differently placed state
(every weighted mean; every macro F1 of one configuration...). Per family,
the state its members read is gathered from the packed buffer with ONE
``index_select`` per reduction kind (flat indices built once), the formula
runs once on the stacked ``[K, ...]`` tensors (the catalogue formulas take
leading dims) and the result is split with one ``unbind``. All members'
bad-input counts come from one gather and are read on the host in ONE
transfer; when one is non-zero its member raises its usual error. Members of
no family (custom metrics, confusion matrices, ranking, samplewise...) keep
their own ``compute()``.

The buffer is found from the current views (``Storage.current_views``: the
synced snapshot after ``wait_sync``, else the local state), so the fused
path reads exactly what the per-member path reads. Results equal the
per-member formulas (tests/core/test_fused_compute.py).
"""

from __future__ import annotations

import math

import torch

from d9d_kernels.core import group
from d9d_kernels.core.statistic import MAX, REPLICA, SUM
from d9d_kernels.metrics.aggregation import MaxMetric, MinMetric, SumMetric, WeightedMeanMetric
from d9d_kernels.metrics.classification import _Classification

__all__ = ["fused_values", "fused_compute_to_host"]

_SIMPLE = (int, float, str, bool, type(None))
_MOMENTS = (SumMetric, WeightedMeanMetric)
_EXTREMA = (MaxMetric, MinMetric)


def _config(m) -> tuple:
    """The public configuration of a metric (what its formula may depend on)."""
    return tuple(sorted((k, v) for k, v in m.__dict__.items() if not k.startswith("_") and isinstance(v, _SIMPLE)))


def _at(layout, j: int, slot: str) -> tuple[str, int]:
    """(kind, flat offset) of slot ``slot`` of merged statistic ``j``."""
    for s, o in layout.placed[j]:
        if s.name == slot:
            return s.kind, o
    raise KeyError(slot)


# Each family: fields(m, layout) -> {kind: [flat indices of one member]} and
# formula(first member, {kind: [K, n] gathered}) -> [K, ...] values.


def _moments_fields(m, layout):
    j = m._stat_map["m"]
    (_, om), (_, op) = _at(layout, j, "moments"), _at(layout, j, "pivot")
    return {SUM: [om, om + 1], REPLICA: [op]}


def _moments_formula(first, g):
    w, sx, px = g[SUM][:, 0], g[SUM][:, 1], torch.nan_to_num(g[REPLICA][:, 0], nan=0.0)
    return sx / w + px if type(first) is WeightedMeanMetric else sx + w * px


def _extrema_fields(m, layout):
    _, o = _at(layout, m._stat_map["e"], "extrema")
    return {MAX: [o] if type(m) is MaxMetric else [o + 1]}


def _extrema_formula(first, g):
    return g[MAX][:, 0] if type(first) is MaxMetric else -g[MAX][:, 0]


def _class_fields(m, layout):
    j = m._stat_map["stats"]
    merged = layout.stats[j]
    C = merged.num_classes
    row = merged.top_ks.index(m._stats()["stats"].top_ks[0])
    _, o = _at(layout, j, "stats")
    idx = list(range(o + row * 3 * C, o + (row + 1) * 3 * C))  # tp, predicted, target [3, C]
    idx.append(_at(layout, j, "extras")[1])  # valid rows
    if m.nan_strategy == "propagate":
        idx.append(_at(layout, j, "nonfinite")[1])
    return {SUM: idx}


def _class_formula(first, g):
    a = g[SUM]
    C = first.num_classes
    st = a[:, : 3 * C].reshape(-1, 3, C)
    n = a[:, 3 * C]
    tp, pred, tgt = st[:, 0], st[:, 1], st[:, 2]
    fp = pred - tp
    fn = tgt - tp
    tn = n[:, None] - tp - fp - fn
    value = first._sample_scores(tp, fp, tn, fn)
    if first.nan_strategy == "propagate":
        nf = a[:, 3 * C + 1].reshape((-1,) + (1,) * (value.dim() - 1))
        value = torch.where(nf > 0, torch.full_like(value, float("nan")), value)
    return value


def _family(m):
    """``(key, fields, formula)`` of member ``m``, or None (computed on its own)."""
    t = type(m)
    if t in _MOMENTS:
        return (t, _config(m)), _moments_fields, _moments_formula
    if t in _EXTREMA:
        return (t, _config(m)), _extrema_fields, _extrema_formula
    if (isinstance(m, _Classification) and m.task == "multiclass" and m.multidim_average != "samplewise"
            and all(getattr(t, f) is getattr(_Classification, f) for f in ("_value", "_compute", "_counts", "_finish"))):
        return (t, _config(m)), _class_fields, _class_formula
    return None


def _bad_fields(m, layout):
    """Flat SUM indices (bad, and non-finite to subtract) of a family member that raises on bad input."""
    j = m._stat_map["stats" if isinstance(m, _Classification) else "m" if "m" in m._stat_map else "e"]
    bad = _at(layout, j, "bad")[1]
    if isinstance(m, _Classification) and m.nan_strategy != "error":
        return bad, _at(layout, j, "nonfinite")[1]
    return bad, None


class FusedPlan:
    """A group's members sorted into families, with their flat indices (built once)."""

    def __init__(self, group):
        layout = group._storage.layout
        self.order = list(group._members)
        fams: dict = {}
        self.single: list[str] = []
        for name, m in group._members.items():
            fam = _family(m)
            if fam is None:
                self.single.append(name)
                continue
            key, fields, formula = fam
            e = fams.setdefault(key, {"formula": formula, "first": m, "names": [], "idx": {}})
            e["names"].append(name)
            for kind, idx in fields(m, layout).items():
                e["idx"].setdefault(kind, []).append(idx)
        self.families = list(fams.values())
        fused = {n for e in self.families for n in e["names"]}
        self.checked_fused, self.checked_single, bad, nf = [], [], [], []
        for name, m in group._members.items():
            if not m._raise_on_bad():
                continue
            if name in fused:
                b, f = _bad_fields(m, layout)
                self.checked_fused.append(m)
                bad.append(b)
                nf.append(f)
            else:
                self.checked_single.append(m)
        self.bad_idx = bad
        self.nf_idx = nf if any(f is not None for f in nf) else None
        self._device_idx: dict = {}

    def indices(self, device):
        """Per kind, one flat index tensor on ``device`` covering every family
        (each family's block: ``(kind, start, K, n)``), and the bad-count
        indices (bad slots, then the non-finite slots to subtract); made once per device."""
        out = self._device_idx.get(device)
        if out is None:
            flat: dict = {}
            blocks = []
            for e in self.families:
                b = {}
                for k, rows in e["idx"].items():
                    lst = flat.setdefault(k, [])
                    b[k] = (len(lst), len(rows), len(rows[0]))
                    lst.extend(i for row in rows for i in row)
                blocks.append(b)
            mk = lambda v: torch.tensor(v, dtype=torch.int64, device=device)  # noqa: E731
            bad = None
            if self.bad_idx:
                nf = [f for f in (self.nf_idx or []) if f is not None]
                bad = mk(self.bad_idx + nf)
            out = self._device_idx[device] = ({k: mk(v) for k, v in flat.items()}, blocks, bad)
        return out


def _plan(group) -> FusedPlan:
    d = group.__dict__
    plan = d.get("_fused_plan")
    if plan is None:
        plan = d["_fused_plan"] = FusedPlan(group)
    return plan


def _buffers(group) -> dict:
    """The flat buffers (per kind) the current views point into."""
    bufs = {}
    st = group._storage
    for j, views in enumerate(st.current_views()):
        for s, _ in st.layout.placed[j]:
            if s.kind not in bufs:
                v = views[s.name]
                bufs[s.kind] = v if v._base is None else v._base
        if len(bufs) == 3:
            break
    return bufs


def _values(group, plan: FusedPlan, bufs) -> dict:
    out = {}
    if not plan.families:
        return out
    flat, blocks, _ = plan.indices(next(iter(bufs.values())).device)
    gathered = {k: bufs[k].index_select(0, i) for k, i in flat.items()}
    for e, b in zip(plan.families, blocks):
        g = {k: gathered[k][start : start + K * n].view(K, n) for k, (start, K, n) in b.items()}
        out.update(zip(e["names"], e["formula"](e["first"], g).unbind(0)))
    return out


def _fused_bad(plan: FusedPlan, bufs) -> torch.Tensor | None:
    """Family members' bad slots then their non-finite slots (``FusedPlan.indices``), one gather."""
    if not plan.checked_fused:
        return None
    return bufs[SUM].index_select(0, plan.indices(bufs[SUM].device)[2])


def _fused_counts(plan: FusedPlan, raw: list) -> list:
    """Per ``plan.checked_fused`` member: its bad count minus its non-finite count (host floats)."""
    K = len(plan.checked_fused)
    nf = iter(raw[K:])
    return [b - next(nf) if f is not None else b for b, f in zip(raw[:K], plan.nf_idx or [None] * K)]


def _single_bad(plan: FusedPlan) -> list:
    return [(m, c) for m, c in ((m, m._bad_count(m._states())) for m in plan.checked_single) if c is not None]


def fused_values(group) -> dict[str, torch.Tensor]:
    """``{name: value}`` of every member, in member order; raises a member's
    bad-input error when its count is non-zero (one host read for all)."""
    plan = _plan(group)
    bufs = _buffers(group)
    bad, single = _fused_bad(plan, bufs), _single_bad(plan)
    if bad is not None or single:
        parts = ([bad] if bad is not None else []) + [c.reshape(1) for _, c in single]
        raw = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
        nb = 0 if bad is None else bad.numel()
        counts = (_fused_counts(plan, raw[:nb]) if bad is not None else []) + raw[nb:]
        if any(v != 0 for v in counts):  # NaN counts (impossible) also raise
            ms = plan.checked_fused + [m for m, _ in single]
            order = {id(m): i for i, m in enumerate(group._members.values())}
            for m, v in sorted(zip(ms, counts), key=lambda t: order[id(t[0])]):
                if v != 0:  # the first bad member (in member order) raises its own error, with its causes
                    m._checked_compute(m._states())
    vals = _values(group, plan, bufs)
    members = group._members
    for name in plan.single:
        vals[name] = members[name].compute()
    return {name: vals[name] for name in plan.order}


def _cause_names(m) -> list[str]:
    """The bad-input causes ``Metric._bad_causes`` reports for a family member."""
    if not isinstance(m, _Classification):
        return ["nonfinite_inputs"]
    if m.nan_strategy != "error":
        return ["target_out_of_range", "nonfinite_preds"]
    return ["target_out_of_range_or_nonfinite_preds"]


def _check_matrix(plan: FusedPlan, device) -> torch.Tensor:
    """``[R, len(raw)]`` float64: per checked family member, its count then its
    cause values (``_cause_names``) as +-1 combinations of the gathered
    bad / non-finite slots (exact: small integer sums in float64)."""
    key = ("checks", device)
    M = plan._device_idx.get(key)
    if M is None:
        K = len(plan.checked_fused)
        nf_at, rows = {}, []
        for i, f in enumerate(plan.nf_idx or [None] * K):
            if f is not None:
                nf_at[i] = K + len(nf_at)
        width = K + len(nf_at)
        for i, m in enumerate(plan.checked_fused):
            bad = [0.0] * width
            bad[i] = 1.0
            if i in nf_at:
                nf = [0.0] * width
                nf[nf_at[i]] = 1.0
                count = [b - n for b, n in zip(bad, nf)]
                rows += [count, count, nf]  # count, target_out_of_range, nonfinite_preds
            else:
                rows += [bad, bad]  # count, its one cause
        M = plan._device_idx[key] = torch.tensor(rows, dtype=torch.float64, device=device)
    return M


def fused_compute_to_host(group, keys: dict):
    """``MetricGroup.compute_to_host()``: every value packed per family (one
    ``cat``, one permutation into member order) with the bad-input counts and
    causes ``HostValues`` checks, then ONE non-blocking device->host copy."""
    from d9d_kernels.core.metric import HostValues, copy_to_host

    plan = _plan(group)
    bufs = _buffers(group)
    dev = next(iter(bufs.values())).device
    parts, seg = [], {}  # seg: name -> (offset in the packed order, shape)
    pos = 0
    if plan.families:
        flat, blocks, _ = plan.indices(dev)
        gathered = {k: bufs[k].index_select(0, i) for k, i in flat.items()}
        for e, b in zip(plan.families, blocks):
            g = {k: gathered[k][start : start + K * n].view(K, n) for k, (start, K, n) in b.items()}
            v = e["formula"](e["first"], g).to(torch.float64)
            shape, n = tuple(v.shape[1:]), v[0].numel()
            for name in e["names"]:
                seg[name] = (pos, shape)
                pos += n
            parts.append(v.reshape(-1))
    members = group._members
    for name in plan.single:
        m = members[name]
        v = m._compute_unchecked(m._states()).detach().to(torch.float64)
        seg[name] = (pos, tuple(v.shape))
        pos += v.numel()
        parts.append(v.reshape(-1))
    checks, tail = [], 0
    bad = _fused_bad(plan, bufs)
    if bad is not None:
        c = _check_matrix(plan, dev) @ bad
        parts.append(c)
        tail += c.numel()
        checks += [(m, _cause_names(m)) for m in plan.checked_fused]
    for m in plan.checked_single:
        states = m._states()
        count = m._bad_count(states)
        if count is None:
            continue
        causes = m._bad_causes(states)
        parts.append(torch.stack([count.reshape(()), *(t.reshape(()) for t in causes.values())]).to(torch.float64))
        tail += 1 + len(causes)
        checks.append((m, list(causes)))
    names = plan.order
    shapes = [seg[n][1] for n in names]
    key = (dev, tuple(seg[n] for n in names), pos, tail)
    perm = plan._device_idx.get(key)
    if perm is None:
        order = [i for n in names for i in range(seg[n][0], seg[n][0] + math.prod(seg[n][1]))]
        perm = plan._device_idx[key] = torch.tensor(order + list(range(pos, pos + tail)),
                                                    dtype=torch.int64, device=dev)
    packed = torch.cat(parts).index_select(0, perm) if parts else torch.zeros(0, dtype=torch.float64)
    host, event = copy_to_host(packed)
    return HostValues(host, [keys[n] for n in names], shapes, checks, event, single=False)


group.register_fused_compute(fused_values, fused_compute_to_host)
