"""GPU busy / idle time per device and per stream, over GPU time only.

Per rank and device (``args.device``, else the event's pid), over GPU events kept by
the step filter (``_common.gpu_rows``):

* window = first GPU event start -> last GPU event end on that device (GPU time only:
  CPU-only stretches before the first kernel or after the last do not count);
* busy = |union of the device's GPU events| (kernels, memcpy, memset; concurrent
  streams count once); idle = window - busy; utilization = busy / window;
* per stream: busy = |union of that stream's events|, share of the device window.

This "busy" is time with at least one kernel resident, not SM occupancy.
"""

from __future__ import annotations

import numpy as np

from d9d_kernels.trace import _intervals as iv
from d9d_kernels.trace._common import (
    ROUNDING_NOTE,
    gpu_intervals,
    gpu_rows,
    open_steps,
    rank_key,
    resolve_mode,
)
from d9d_kernels.trace._result import metric, result


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False, step_filter=None, rounding="hta") -> dict:
    """Busy/idle per device and stream for every rank."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed, step_filter)
    out = {}
    utils = []
    for r, rt in ranks.items():
        if resolve_mode(rt, profile_mode) != "gpu":
            out[rank_key(r)] = {"mode": "cpu", "note": "no GPU events in this trace"}
            continue
        rows = np.flatnonzero(gpu_rows(rt, "all"))  # filtered by open_steps
        s, e = gpu_intervals(rt, rows, rounding)
        dev = np.where(rt.device[rows] >= 0, rt.device[rows], rt.pid[rows])
        stream = rt.stream[rows]
        devices = {}
        for d in np.unique(dev):
            m = dev == d
            w0, w1 = float(s[m].min()), float(e[m].max())
            window = w1 - w0
            busy = iv.total(s[m], e[m])
            streams = {}
            for st in np.unique(stream[m]):
                ms = m & (stream == st)
                sb = iv.total(s[ms], e[ms])
                streams[f"stream{int(st)}"] = {
                    "events": metric(int(ms.sum()), "count", "GPU events on this stream"),
                    "busy_time": metric(sb, "us", "union of this stream's GPU events"),
                    "busy_pct": metric(100.0 * sb / window if window else None, "%",
                                       "stream busy_time / device window"),
                }
            util = 100.0 * busy / window if window else None
            if util is not None:
                utils.append(util)
            devices[f"device{int(d)}"] = {
                "window": metric(window, "us", "first GPU event start to last GPU event end"),
                "busy_time": metric(busy, "us", "union of all GPU events on the device"),
                "idle_time": metric(window - busy, "us", "window - busy_time"),
                "utilization_pct": metric(util, "%", "busy_time / window"),
                "streams": streams,
            }
        out[rank_key(r)] = {"mode": "gpu", "devices": devices}
    summary = {}
    if utils:
        summary["mean_utilization_pct"] = metric(float(np.mean(utils)), "%",
                                                 "mean over ranks/devices of utilization_pct")
        summary["min_utilization_pct"] = metric(float(np.min(utils)), "%",
                                                "lowest utilization_pct over ranks/devices")
    return result("gpu_utilization", out, summary, list(wl.notes) + [steps_note, ROUNDING_NOTE],
                  errors)
