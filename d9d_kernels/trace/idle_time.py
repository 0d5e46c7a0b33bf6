"""Why each GPU stream is idle: host wait, kernel wait, other (HolisticTraceAnalysis's
``get_idle_time_breakdown``).

Per rank and stream, over the GPU events (kernels, memcpy, memset) kept by the step
filter, sorted by start: the gap before each event is ``start - end of the previous
event on the stream`` (the first event has no gap). A gap is

* **host wait** when the runtime call that launched the event started after the
  previous event ended: the CPU did not enqueue work fast enough;
* **kernel wait** otherwise, when the gap is shorter than ``consecutive_kernel_delay``
  (30 µs, HTA's default): the overhead of launching back-to-back kernels;
* **other** otherwise (e.g. a kernel waiting on an event from another stream).

An event whose launching call is not in the trace cannot be a host wait. Gaps are
summed as HTA does, including negative ones (events overlapping on one stream after
rounding); their count is reported so that such traces are visible.
"""

from __future__ import annotations

import numpy as np

from d9d_kernels.trace._common import (
    ROUNDING_NOTE,
    hta_times,
    launch_rows,
    open_steps,
    rank_key,
    resolve_mode,
)
from d9d_kernels.trace._result import metric, result

TOOL = "idle_time"
CATEGORIES = ("host_wait", "kernel_wait", "other")
DEFINITIONS = {
    "host_wait": "gaps before GPU events whose launching runtime call started after the previous "
                 "event on the stream ended (CPU not enqueuing fast enough)",
    "kernel_wait": "gaps shorter than consecutive_kernel_delay that are not host waits "
                   "(back-to-back launch overhead)",
    "other": "remaining gaps (e.g. waiting on another stream's event)",
}


def stream_gaps(rt, rounding: str = "hta", consecutive_kernel_delay: float = 30.0) -> dict:
    """``{stream: {"host_wait": us, "kernel_wait": us, "other": us, "gaps": n, "negative": n}}``."""
    start, end = hta_times(rt, rounding)
    g_rows, c_rows = launch_rows(rt)
    launch_ts = np.full(len(rt), np.nan)
    launch_ts[g_rows] = start[c_rows]
    rows = np.flatnonzero(rt.gpu_mask)
    out = {}
    for st in np.unique(rt.stream[rows]):
        r = rows[rt.stream[rows] == st]
        r = r[np.argsort(start[r], kind="stable")]
        s, e, lts = start[r], end[r], launch_ts[r]
        gap = s[1:] - e[:-1]
        host = lts[1:] > e[:-1]  # NaN (no launch in the trace) compares False
        kern = ~host & (gap < consecutive_kernel_delay)
        other = ~host & ~kern
        out[int(st)] = {"host_wait": float(gap[host].sum()), "kernel_wait": float(gap[kern].sum()),
                        "other": float(gap[other].sum()), "gaps": int(gap.size),
                        "negative": int((gap < 0).sum())}
    return out


def _metrics(d: dict, what: str) -> dict:
    total = sum(d[c] for c in CATEGORIES)
    m = {c: metric(d[c], "us", f"{DEFINITIONS[c]}; {what}") for c in CATEGORIES}
    m["idle_time"] = metric(total, "us", f"sum of all gaps between consecutive GPU events; {what}")
    for c in CATEGORIES:
        m[f"{c}_pct"] = metric(100.0 * d[c] / total if total > 0 else None, "%",
                               f"{c} / idle_time * 100 (HTA's idle_time_ratio)")
    return m


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False, rounding="hta", consecutive_kernel_delay: float = 30.0) -> dict:
    """Idle-time breakdown per rank and stream (see module docstring)."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed)
    out, notes = {}, list(wl.notes) + [steps_note, ROUNDING_NOTE,
                                       f"consecutive_kernel_delay = {consecutive_kernel_delay:g} us"]
    host_pct = []
    for r, rt in ranks.items():
        if resolve_mode(rt, profile_mode) != "gpu":
            out[rank_key(r)] = {"mode": "cpu", "note": "no GPU events in this trace"}
            continue
        per = stream_gaps(rt, rounding, consecutive_kernel_delay)
        tot = {c: sum(v[c] for v in per.values()) for c in CATEGORIES}
        entry = _metrics(tot, "summed over streams")
        entry["streams"] = {f"stream{st}": _metrics(v, f"stream {st}") for st, v in per.items()}
        neg = sum(v["negative"] for v in per.values())
        if neg:
            notes.append(f"{rank_key(r)}: {neg} negative gap(s) (events overlapping on one stream); "
                         "summed as HTA does")
        out[rank_key(r)] = entry
        if entry["host_wait_pct"]["value"] is not None:
            host_pct.append(entry["host_wait_pct"]["value"])
    summary = {}
    if host_pct:
        summary["max_host_wait_pct"] = metric(max(host_pct), "%", "max over ranks of host_wait_pct")
    return result(TOOL, out, summary, notes, errors)
