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

Where the compiled ``group_values`` op runs (CPU, CUDA; not while traced),
the members whose formula it knows (weighted means and sums, max/min,
accuracy / precision / recall / F-beta / specificity / Jaccard of any task and
average; not with ``zero_division`` other than 0: the program's 0/0 is 0.0)
are evaluated by ONE call of it instead (d9d_kernels/ops/
group_values.py); the torch families are then only the others, and the
reference the op is tested against. The same plan gives forward's batch
values (from the scratch buffers) and a single metric's ``compute()``, so a
member's value is the same bits whichever way it is asked for.

The buffer is found from the current views (``Storage.current_views``: the
synced snapshot after ``wait_sync``, else the local state), so the fused
path reads exactly what the per-member path reads. Results equal the
per-member formulas (tests/core/test_fused_compute.py).
"""

from __future__ import annotations

import math

import torch

from d9d_kernels.core import compiled
from d9d_kernels.core import metric as core_metric
from d9d_kernels.core.device import constant
from d9d_kernels.core.statistic import MAX, REPLICA, SUM
from d9d_kernels.metrics.aggregation import MaxMetric, MinMetric, SumMetric, WeightedMeanMetric
from d9d_kernels.metrics.classification import (
    Accuracy,
    ConfusionMatrix,
    FBetaScore,
    JaccardIndex,
    Precision,
    Recall,
    Specificity,
    _Classification,
)
from d9d_kernels.ops import group_values as GV

__all__ = ["fused_values", "fused_compute_to_host", "fused_batch_values", "member_value"]

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
    if type(first) is not WeightedMeanMetric:
        return sx + w * px
    mean = sx / w + px
    return torch.where(w == 0, torch.full_like(mean, float("nan")), mean)  # as WeightedMeanMetric._compute


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
        idx.append(_at(layout, j, "bad")[1] + 1)  # NaN/Inf predictions (labelled.BAD)
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


def _plain_classification(m) -> bool:
    """A classification metric whose value is its class's ``_formula`` of the counts."""
    return (isinstance(m, _Classification) and m.multidim_average != "samplewise"
            and all(getattr(type(m), f) is getattr(_Classification, f)
                    for f in ("_value", "_compute", "_counts", "_finish", "_sample_scores")))


def _family(m):
    """``(key, fields, formula)`` of member ``m``, or None (computed on its own)."""
    t = type(m)
    if t in _MOMENTS:
        return (t, _config(m)), _moments_fields, _moments_formula
    if t in _EXTREMA:
        return (t, _config(m)), _extrema_fields, _extrema_formula
    if _plain_classification(m) and m.task == "multiclass":
        return (t, _config(m)), _class_fields, _class_formula
    return None


_NATIVE_CLASSES = ((Accuracy, GV.ACCURACY), (Precision, GV.PRECISION), (Recall, GV.RECALL),
                   (FBetaScore, GV.FBETA), (Specificity, GV.SPECIFICITY), (JaccardIndex, GV.JACCARD))


def _nonfinite(m, layout, j: int) -> int:
    """The program's kNonfinite column: the flat index of the count of NaN/Inf
    predictions under nan_strategy="propagate", else -1."""
    return _at(layout, j, "bad")[1] + 1 if m.nan_strategy == "propagate" else -1


def _native_row(m, layout) -> tuple[list[int], float, tuple[int, ...]] | None:
    """``(program row with out = 0, beta², value shape)`` of ``m`` for the
    group_values op (csrc/kernels/group_values.h), or None where it has no formula for it."""
    t = type(m)
    if t in _MOMENTS:
        f = _moments_fields(m, layout)  # w and Σx at f[SUM][0], the pivot at f[REPLICA][0]
        code = GV.MEAN if t is WeightedMeanMetric else GV.SUM
        return [code, 0, 0, 0, 1, f[SUM][0], f[REPLICA][0], -1, 0], 0.0, ()
    if t in _EXTREMA:
        code = GV.MAX if t is MaxMetric else GV.MIN
        return [code, 0, 0, 0, 1, _extrema_fields(m, layout)[MAX][0], 0, -1, 0], 0.0, ()
    if t is ConfusionMatrix and m.task == "multiclass" and m.normalize is None:
        j, C = m._stat_map["stats"], m.num_classes
        return [GV.CONFMAT, 0, 0, 0, C, _at(layout, j, "confmat")[1], 0, _nonfinite(m, layout, j), 0], 0.0, (C, C)
    if not _plain_classification(m):
        return None
    if m._uses_zero_division and m.zero_division != 0.0:  # the program's 0/0 is 0.0: the torch formula takes it
        return None
    code = next((c for cls, c in _NATIVE_CLASSES if isinstance(m, cls) and t._formula is cls._formula), None)
    if code is None:
        return None
    j = m._stat_map["stats"]
    nf = _nonfinite(m, layout, j)
    beta2 = float(m.beta) ** 2 if code == GV.FBETA else 0.0
    if m.task == "multiclass":
        merged = layout.stats[j]
        C = merged.num_classes
        row = merged.top_ks.index(m._stats()["stats"].top_ks[0])
        avg = GV.AVERAGES[m.average]
        stats = _at(layout, j, "stats")[1] + row * 3 * C
        prog = [code, avg, GV.CLASS_ROWS, int(m.top_k != 1), C, stats, _at(layout, j, "extras")[1], nf, 0]
    else:  # binary: micro over its one label; multilabel: the member's average over labels
        C = m.num_labels if m.task == "multilabel" else 1
        avg = GV.AVERAGES[m.average] if m.task == "multilabel" else GV.AVERAGES["micro"]
        prog = [code, avg, GV.LABEL_ROWS, 0, C, _at(layout, j, "state")[1], 0, nf, 0]
    return prog, beta2, (C,) if avg == GV.AVERAGES["none"] else ()


def _bad_fields(m, layout) -> tuple[list[int], tuple[float, ...], tuple[str, ...]]:
    """Flat SUM indices of the ``bad`` slot of a family member that raises on
    bad input, each count's weight in the count that raises and its cause
    (``core.metric.raising_weights`` / ``bad_causes_of``, as a metric's own check)."""
    j = m._stat_map["stats" if isinstance(m, _Classification) else "m" if "m" in m._stat_map else "e"]
    slot, b = next((s, o) for s, o in layout.placed[j] if s.name == "bad")
    n = math.prod(slot.shape)
    return (list(range(b, b + n)), core_metric.raising_weights(n, m.nan_strategy),
            core_metric.bad_causes_of(n, m._bad_cause))


class FusedPlan:
    """Members (``{name: metric}`` on one storage) sorted into the group_values
    program (``native``), formula families and the rest, with their flat
    indices (built once per device)."""

    def __init__(self, members: dict, layout, native: bool):
        self.order = list(members)
        rows = []
        if native:
            for name, m in members.items():
                r = _native_row(m, layout)
                if r is not None:
                    rows.append((r[2] != (), name, r))
            rows.sort(key=lambda t: t[0])  # stable: member order within scalars and vectors
        # scalar outputs first, then vectors
        self.native: list[str] = [name for _, name, _ in rows]
        self.native_index = frozenset(self.native)
        self.forward_select = {}  # ForwardKeys -> fused_forward's [(key, value index)], or False
        self.native_shapes = [r[2] for _, _, r in rows]
        self.n_scalar = sum(1 for vec, _, _ in rows if not vec)
        program, pos = [], 0
        for _, _, (prog, _, shape) in rows:
            program.append(prog[:-1] + [pos])
            pos += math.prod(shape)
        self.program, self.beta2, self.out_size = program, [r[1] for _, _, r in rows], pos
        fams: dict = {}
        self.single: list[str] = []
        for name, m in members.items():
            if name in self.native:
                continue
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
        # every member native and ordered as the group: _native's dict is the result as it is
        self.in_order = self.native == self.order
        self.checked_fused, self.checked_single = [], []
        self.bad_idx: list[int] = []  # every checked family member's bad slot, one after another
        self.bad_weights: list[tuple[float, ...]] = []  # per member: its counts' weights in the count that raises
        self.bad_causes: list[tuple[str, ...]] = []  # per member: its counts' causes
        for name, m in members.items():
            if not m._raise_on_bad():
                continue
            if _family(m) is not None:  # bad counts gathered as for the families (native or not)
                idx, w, causes = _bad_fields(m, layout)
                self.checked_fused.append(m)
                self.bad_idx += idx
                self.bad_weights.append(w)
                self.bad_causes.append(causes)
            else:
                self.checked_single.append(m)
        self._device_idx: dict = {}

    def indices(self, device):
        """Per kind, one flat index tensor on ``device`` covering every family
        (each family's block: ``(kind, start, K, n)``); made once per device."""
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
            mk = lambda v: constant(v, torch.int64, device)  # noqa: E731
            out = self._device_idx[device] = ({k: mk(v) for k, v in flat.items()}, blocks)
        return out

    def bad_index(self, device):
        """``bad_idx`` as an int64 tensor on ``device``; made once per device."""
        key = ("bad_idx", device)
        out = self._device_idx.get(key)
        if out is None:
            out = self._device_idx[key] = constant(self.bad_idx, torch.int64, device)
        return out

    def native_args(self, device):
        """(program, beta², an empty float64 tensor) on ``device``; made once per device."""
        key = ("native", device)
        out = self._device_idx.get(key)
        if out is None:
            out = self._device_idx[key] = (
                constant(self.program, torch.int64, device).reshape(-1, len(GV.COLUMNS)),
                constant(self.beta2, torch.float64, device),
                torch.empty(0, dtype=torch.float64, device=device))
        return out


def _plan(owner) -> FusedPlan:
    """The plan of a group (its members) or of a single metric (itself, named ``""``)."""
    st = owner._storage
    # the layout is part of the key: a metric that joins a group keeps its slots at the group's offsets
    key = (st.layout, st.device, GV.group_values_ok(st.device))
    d = owner.__dict__
    plan = d.get("_fused_plan")
    if plan is None or plan.key != key:
        members = owner._members if isinstance(owner, core_metric._GroupBase) else {"": owner}
        plan = d["_fused_plan"] = FusedPlan(members, st.layout, native=key[2])
        plan.key = key
        plan.host = bool(plan.native) and GV.host_compute_ok(st.device)
    return plan


def _native_out(plan: FusedPlan, bufs) -> torch.Tensor:
    """The plan's ``native`` members' values packed (scalars, then vectors): one group_values call."""
    dev = bufs[SUM].device
    prog, beta2, empty = plan.native_args(dev)
    out = torch.empty(plan.out_size, dtype=torch.float64, device=dev)
    GV.group_values(bufs[SUM], bufs.get(MAX, empty), bufs.get(REPLICA, empty), prog, beta2, out)
    return out


def _native(plan: FusedPlan, bufs) -> dict:
    """``{name: value}`` of the plan's ``native`` members: the scalars, then
    the vector members split from the rest of the packed output."""
    out = _native_out(plan, bufs)
    k = plan.n_scalar
    scalars = GV.scalars(out if k == out.numel() else out[:k])
    if k == len(plan.native):
        return dict(zip(plan.native, scalars))
    shapes = plan.native_shapes[k:]
    vectors = [v.view(s) for v, s in zip(out[k:].split([math.prod(s) for s in shapes]), shapes)]
    return dict(zip(plan.native, [*scalars, *vectors]))


def _host_args(plan: FusedPlan) -> tuple:
    """``GV.host_compute``'s arguments after the buffers: ``_program_args``,
    then the bad index and matrix (empty when no member raises); made once."""
    args = plan._device_idx.get("host")
    if args is None:
        cpu = torch.device("cpu")
        if plan.checked_fused:
            bad = (plan.bad_index(cpu), _bad_matrix(plan, cpu, causes=False))
        else:
            bad = (torch.empty(0, dtype=torch.int64), torch.empty(0, 0, dtype=torch.float64))
        args = plan._device_idx["host"] = (*_program_args(plan), *bad)
    return args


def _program_args(plan: FusedPlan) -> tuple:
    """The group_values program's CPU arguments after the buffers, as
    ``_C.group_compute`` and ``PlanRunner.set_forward`` take them: program,
    beta², output size, scalar count and the vector members' shapes."""
    prog, beta2, _ = plan.native_args(torch.device("cpu"))
    shapes = [list(s) for s in plan.native_shapes[plan.n_scalar:]]
    return prog, beta2, plan.out_size, plan.n_scalar, shapes


def _host_native(plan: FusedPlan, bufs) -> tuple[dict, list | None]:
    """CPU buffers: ``({name: value}`` of the ``native`` members, the raising
    bad counts of the checked family members or None), one C++ call."""
    empty = _EMPTY
    vals, _, counts = GV.host_compute(bufs[SUM], bufs.get(MAX, empty), bufs.get(REPLICA, empty), *_host_args(plan))
    return dict(zip(plan.native, vals)), (counts if plan.checked_fused else None)


_EMPTY = torch.empty(0, dtype=torch.float64)


def _values(plan: FusedPlan, bufs, native: dict | None = None) -> dict:
    if native is not None:
        out = native
    else:
        out = _native(plan, bufs) if plan.native else {}
    if not plan.families:
        return out
    flat, blocks = plan.indices(next(iter(bufs.values())).device)
    gathered = {k: bufs[k].index_select(0, i) for k, i in flat.items()}
    for e, b in zip(plan.families, blocks):
        g = {k: gathered[k][start : start + K * n].view(K, n) for k, (start, K, n) in b.items()}
        out.update(zip(e["names"], e["formula"](e["first"], g).unbind(0)))
    return out


def _bad_counts(plan: FusedPlan, bufs, causes: bool) -> torch.Tensor | None:
    """The rows of ``_bad_matrix`` evaluated on the family members' bad slots
    (gathered first: a NaN elsewhere in the buffer must not reach the sums)."""
    if not plan.checked_fused:
        return None
    s = bufs[SUM]
    return _bad_matrix(plan, s.device, causes) @ s.index_select(0, plan.bad_index(s.device))


def _single_bad(plan: FusedPlan) -> list:
    return [(m, c) for m, c in ((m, m._bad_count(m._states())) for m in plan.checked_single) if c is not None]


def fused_values(group) -> dict[str, torch.Tensor]:
    """``{name: value}`` of every member, in member order. Bad-input counts
    as ``core.metric.host_checks`` says: on CPU state one host read for all,
    and a member's non-zero count raises its error; on a GPU no host read, and
    that member's value is NaN."""
    plan = _plan(group)
    bufs = group._storage.current_buffers()
    if not core_metric.host_checks(group._storage.device):
        vals = _values(plan, bufs)
        bad = _bad_counts(plan, bufs, causes=False)  # per member, the count that raises
        if bad is not None:
            names = {id(m): n for n, m in group._members.items()}
            for m, c in zip(plan.checked_fused, bad.unbind(0)):
                vals[names[id(m)]] = core_metric.poisoned(vals[names[id(m)]], c)
    else:
        native = None
        if plan.host:  # CPU: values and counts in one call
            native, bad = _host_native(plan, bufs)
        else:
            bad = _bad_counts(plan, bufs, causes=False)
        single = _single_bad(plan)
        if bad is not None or single:
            counts = bad if isinstance(bad, list) else []  # the host call's counts are read already
            parts = ([bad] if isinstance(bad, torch.Tensor) else []) + [c.reshape(1) for _, c in single]
            if parts:  # one host read for the rest
                counts = counts + (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
            if any(counts):  # NaN counts (impossible) are true too, and raise
                ms = plan.checked_fused + [m for m, _ in single]
                order = {id(m): i for i, m in enumerate(group._members.values())}
                for m, v in sorted(zip(ms, counts), key=lambda t: order[id(t[0])]):
                    if v != 0:  # the first bad member (in member order) raises its own error, with its causes
                        m._checked_compute(m._states())
        vals = _values(plan, bufs, native)
    if plan.in_order:
        return vals
    members = group._members
    for name in plan.single:
        vals[name] = members[name].compute()
    return {name: vals[name] for name in plan.order}


def _bad_matrix(plan: FusedPlan, device, causes: bool) -> torch.Tensor:
    """``[R, len(bad_idx)]`` float64: per checked family member, a row of its
    count that raises, then (``causes``) one row per cause (``bad_causes``):
    weighted sums of the gathered bad counts (exact: small integer sums in
    float64); made once per device."""
    key = ("bad_matrix", causes, device)
    M = plan._device_idx.get(key)
    if M is None:
        width, rows, pos = len(plan.bad_idx), [], 0
        for w in plan.bad_weights:
            count = [0.0] * width
            count[pos : pos + len(w)] = w
            rows.append(count)
            for i in range(len(w) if causes else 0):
                cause = [0.0] * width
                cause[pos + i] = 1.0
                rows.append(cause)
            pos += len(w)
        M = plan._device_idx[key] = constant(rows, torch.float64, device)
    return M


def fused_compute_to_host(group, keys: dict):
    """``MetricGroup.compute_to_host()``: every value packed per family (one
    ``cat``, one permutation into member order) with the bad-input counts and
    causes ``HostValues`` checks, then ONE non-blocking device->host copy."""
    from d9d_kernels.core.metric import HostValues, copy_to_host

    plan = _plan(group)
    bufs = group._storage.current_buffers()
    dev = next(iter(bufs.values())).device
    parts, seg = [], {}  # seg: name -> (offset in the packed order, shape)
    pos = 0
    if plan.native:  # already packed: scalars, then vectors
        parts.append(_native_out(plan, bufs))
        for name, shape in zip(plan.native, plan.native_shapes):
            seg[name] = (pos, shape)
            pos += math.prod(shape)
    if plan.families:
        flat, blocks = plan.indices(dev)
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
    c = _bad_counts(plan, bufs, causes=True)
    if c is not None:
        parts.append(c)
        tail += c.numel()
        checks += [(m, list(c)) for m, c in zip(plan.checked_fused, plan.bad_causes)]
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
        perm = plan._device_idx[key] = constant(order + list(range(pos, pos + tail)), torch.int64, dev)
    packed = torch.cat(parts).index_select(0, perm) if parts else torch.zeros(0, dtype=torch.float64)
    host, event = copy_to_host(packed)
    return HostValues(host, [keys[n] for n in names], shapes, checks, event, single=False)


def fused_batch_values(group, names: list[str], views) -> dict[str, torch.Tensor]:
    """``{name: value}`` of members ``names`` (and of any other fused member)
    on forward's scratch buffers (``views``: the scratch views, for members of
    no family); no checks, no host read. No value is a view of the scratch,
    which the next forward overwrites: the fused ones are new tensors, the
    others are cloned where they alias it."""
    st = group._storage
    plan = _plan(group)
    vals = _values(plan, st.scratch, _host_native(plan, st.scratch)[0] if plan.host else None)
    members = group._members
    for n in names:
        if n not in vals:
            vals[n] = core_metric.detach_from(members[n]._compute_unchecked(members[n]._states(views)), st)
    return vals


def fused_forward(owner, args: tuple, kwargs: dict, keys) -> dict | None:
    """``owner``'s forward (a group, or a single metric named ``""``) as ONE
    C++ call where it can run: CPU buffers, a compiled update for these
    inputs, the previous forward's ranges known and every member of ``keys``
    (a ``core.metric.ForwardKeys``) from the group_values program.
    ``PlanRunner.forward`` resets the scratch ranges of the last forward, runs
    the update's ops on the scratch, makes the batch values, folds the ranges
    the ops wrote into the state and resets them in the same pass, and
    returns the values: the same ops and arithmetic as the Python steps of
    ``forward``. Returns ``{output key: value}``, or None
    (nothing touched) where the Python steps must run."""
    st = owner._storage
    dirty = st.scratch_dirty
    if dirty is None or not dirty.native or st.saved_views is not None or torch.compiler.is_compiling():
        return None
    entry = st.compiled.get(id(owner))
    if entry is None or entry.views is not st.local_views:
        return None
    s = compiled.on_scratch(st, entry)
    if s is None:
        return None
    plan = owner.__dict__.get("_fused_plan")
    if plan is None or s.forward is not plan:  # set up for this scratch: its buffers are the values' inputs
        plan = _plan(owner)
        if not plan.host:
            return None
        sc = st.scratch
        compiled.set_forward(st, s, plan, (sc[SUM], sc[MAX], sc[REPLICA], *_program_args(plan)))
    select = plan.forward_select.get(keys)
    if select is None:
        native = {n: i for i, n in enumerate(plan.native)}
        select = plan.forward_select[keys] = (
            [(k, native[n]) for k, n in keys.pairs] if keys.names <= plan.native_index else False)
    if select is False:
        return None
    every = st._fold_ranges(frozenset(range(len(st.layout.stats))))
    try:
        vals = s.runner.forward(args, kwargs, dirty.reset, select)
    except BaseException:
        st.scratch_dirty = every  # the reset ran and some ops may have written: the next forward resets every range
        raise
    if vals is None:
        return None
    clean = st.scratch_dirty = st._fold_ranges(frozenset())  # the call reset what it folded: the REPLICA copy is left
    st.dirty = True
    # the next forward of these input names, if nothing changes meanwhile: compiled.fast_forward
    entry.shortcuts[frozenset(kwargs or ())] = compiled.ForwardShortcut(clean, clean.reset, plan, s.handle, select, every)
    return vals


def member_value(m, bufs) -> torch.Tensor | None:
    """A single metric's value from ``bufs`` (its storage's current or scratch
    buffers) by the group_values op, or None where the op has no formula for it."""
    plan = _plan(m)
    if not plan.native:
        return None
    return (_host_native(plan, bufs)[0] if plan.host else _native(plan, bufs))[""]


core_metric.register_fused_compute(values=fused_values, to_host=fused_compute_to_host, batch=fused_batch_values,
                                   member=member_value, forward=fused_forward)
