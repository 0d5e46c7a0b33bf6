"""GPU kernel time by class: GEMM, attention, elementwise, reduction, communication, memory.

Per rank, over GPU events kept by the step filter (``_common.gpu_rows``):

* ``by_class``: for each class, kernel count, summed duration (µs; concurrent kernels
  each count) and its share of the summed duration of all GPU events (%), plus the
  top kernels of the class. Classes come from the kernel name, communication first
  (so an NCCL kernel named ``...Reduce...`` is communication, not reduction); rules
  in ``_common.KERNEL_RULES_DOC``.
* ``hta_kernel_type``: HolisticTraceAnalysis's kernel-type breakdown
  (``get_gpu_kernel_breakdown``): the GPU timeline is cut where any COMPUTATION or
  COMMUNICATION kernel starts or ends, and each piece is labelled by the set of
  types running ("COMPUTATION overlapping COMMUNICATION"); % of the total labelled
  time (per rank, and summed over ranks in ``summary`` as HTA does). MEMORY
  (memcpy/memset) is a third type unless ``include_memory_kernels=False`` (HTA's default: True).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from d9d_kernels.trace import _intervals as iv
from d9d_kernels.trace._common import (
    KERNEL_CLASSES,
    KERNEL_RULES_DOC,
    ROUNDING_NOTE,
    classify_rows,
    gpu_intervals,
    gpu_rows,
    hta_type,
    kernel_class,
    open_steps,
    rank_key,
    resolve_mode,
)
from d9d_kernels.trace._load import RankTrace
from d9d_kernels.trace._result import metric, result

_HTA_ORDER = ("COMPUTATION", "COMMUNICATION", "MEMORY")


def hta_type_breakdown(rt: RankTrace, step_filter="hta", rounding="hta",
                       include_memory_kernels=True) -> dict:
    """``{label: µs}`` of HTA's kernel-type breakdown for one rank (see module doc)."""
    rows = np.flatnonzero(gpu_rows(rt, step_filter))
    if rows.size == 0:
        return {}
    s, e = gpu_intervals(rt, rows, rounding)
    types = classify_rows(rt, rows, lambda n, k: hta_type(n))
    wanted = _HTA_ORDER if include_memory_kernels else _HTA_ORDER[:2]
    unions = {t: iv.union(s[types == t], e[types == t]) for t in wanted}
    unions = {t: u for t, u in unions.items() if u[0].size}
    wanted = tuple(unions)
    if not unions:
        return {}
    bounds = np.unique(np.concatenate([np.concatenate(u) for u in unions.values()]))
    if bounds.size < 2:
        return {}
    a, b = bounds[:-1], bounds[1:]
    mid = (a + b) / 2
    code = np.zeros(mid.size, dtype=np.int64)
    for bit, t in enumerate(wanted):
        us, ue = unions[t]
        j = np.searchsorted(us, mid, side="right") - 1
        inside = (j >= 0) & (mid < ue[np.maximum(j, 0)])
        code |= inside.astype(np.int64) << bit
    out: dict = defaultdict(float)
    length = b - a
    for c in np.unique(code[code > 0]):
        label = " overlapping ".join(t for bit, t in enumerate(wanted) if c >> bit & 1)
        out[label] += float(length[code == c].sum())
    return dict(out)


def class_breakdown(rt: RankTrace, step_filter="hta", rounding="hta", top: int = 5) -> dict:
    rows = np.flatnonzero(gpu_rows(rt, step_filter))
    if rows.size == 0:
        return {}
    s, e = gpu_intervals(rt, rows, rounding)
    d = np.maximum(e - s, 0.0)
    classes = classify_rows(rt, rows, kernel_class)
    total = float(d.sum())
    out = {}
    for c in KERNEL_CLASSES:
        m = classes == c
        if not m.any():
            continue
        ids = rt.name_id[rows[m]]
        per = np.bincount(ids, weights=d[m], minlength=len(rt.names))
        order = np.argsort(per)[::-1][:top]
        out[c] = {
            "count": metric(int(m.sum()), "count", f"GPU events classified {c}"),
            "time": metric(float(d[m].sum()), "us", f"summed duration of {c} GPU events"),
            "pct": metric(100.0 * float(d[m].sum()) / total if total else None, "%",
                          f"{c} time / summed duration of all GPU events"),
            "top_kernels": [{"name": rt.names[i], "time": metric(float(per[i]), "us", "summed duration")}
                            for i in order if per[i] > 0],
        }
    return out


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False, step_filter=None, rounding="hta", include_memory_kernels=True) -> dict:
    """Kernel time by class, and HTA's kernel-type breakdown, per rank."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed, step_filter)
    out = {}
    notes = list(wl.notes) + ["classes: " + KERNEL_RULES_DOC, steps_note, ROUNDING_NOTE]
    agg: dict = defaultdict(float)
    hta_agg: dict = defaultdict(float)
    for r, rt in ranks.items():
        if resolve_mode(rt, profile_mode) != "gpu":
            out[rank_key(r)] = {"mode": "cpu", "note": "no GPU kernels in this trace"}
            continue
        by_class = class_breakdown(rt, "all", rounding)  # filtered by open_steps
        hta = hta_type_breakdown(rt, "all", rounding, include_memory_kernels)
        tot = sum(hta.values())
        for k, v in hta.items():
            hta_agg[k] += v
        out[rank_key(r)] = {
            "mode": "gpu",
            "by_class": by_class,
            "hta_kernel_type": {
                k: {"time": metric(v, "us", f"time during which exactly {k} kernels run"),
                    "pct": metric(100.0 * v / tot if tot else None, "%",
                                  "share of the time any computation/communication kernel runs")}
                for k, v in sorted(hta.items(), key=lambda kv: -kv[1])},
        }
        for c, v in by_class.items():
            agg[c] += v["time"]["value"]
    tot = sum(agg.values())
    summary = {"by_class_pct": {c: metric(100.0 * v / tot, "%", f"{c} share of summed GPU event time, all ranks")
                                for c, v in agg.items()} if tot else {}}
    htot = sum(hta_agg.values())
    summary["hta_kernel_type_pct"] = {
        k: metric(100.0 * v / htot, "%", "HTA kernel-type share, time summed over ranks")
        for k, v in sorted(hta_agg.items(), key=lambda kv: -kv[1])} if htot else {}
    return result("kernel", out, summary, notes, errors)
