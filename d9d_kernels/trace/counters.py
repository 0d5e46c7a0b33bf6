"""HolisticTraceAnalysis's augmented counters: kernel-launch queue length per CUDA stream
(``get_queue_length_time_series`` / ``get_queue_length_summary``) and memory bandwidth of
memcpy / memset per kind (``get_memory_bw_time_series`` / ``get_memory_bw_summary``).

Queue length.

Per rank and stream: +1 when a launch call (``cudaLaunchKernel``, ``cudaLaunchKernelExC``,
``cuLaunchKernel``, ``cudaMemcpyAsync``, ``cudaMemsetAsync`` and the HIP equivalents, as
HTA's list) that has a GPU event in the trace starts, -1 when that GPU event starts.
The running sum is the number of launched, not yet started operations: a step function.

Figures per stream: ``max`` and ``mean`` / ``median`` over the change points (HTA's
``describe()`` statistics, not weighted by time), ``time_weighted_mean`` (weighted by how
long each value holds, from the first change to the last), and ``series`` (JSON and the
HTML plot; at most ``max_points`` points, evenly picked, when longer). Events at the same
µs keep the order HTA gives them (launches then GPU starts, in file order, sorted by time
with numpy's unstable quicksort, as pandas ``sort_values`` does), so the change-point
statistics equal HTA's; a stable order moves the mean by about 1 % on nccl_rank0_of2.

Memory bandwidth. Per rank and kind (HTA's names: ``Memcpy HtoD``, ``Memcpy DtoH``,
``Memcpy DtoD``, ... = the first 11 characters of a ``Memcpy*`` name, ``Memset``, and
``Memcpy Unknown`` for ``dma*``), over the GPU events HTA types as MEMORY (name starts
with Memcpy, Memset or dma): +bandwidth when an operation starts, -bandwidth when it
ends; the running sum is the bandwidth in use, summed over the rank's devices and
streams. The bandwidth of an operation is its ``args["memory bandwidth (GB/s)"]`` (as
Kineto writes it); where that is absent, ``args.bytes / dur`` (HTA takes 0 there), else
0. An operation of zero length ends 1 µs after it starts, as in HTA, so that its end
never sorts before its start. Figures per kind: ``max`` / ``mean`` / ``median`` /
``min`` / ``points`` over the change points with a positive value (HTA's ``describe()``
of the summary, which drops the idle points), ``time_weighted_mean`` (the step function
averaged from the first change to the last, idle time included), ``ops`` and ``bytes``
(operations and their ``args.bytes``), and ``series`` (capped as for the queue). Ties
in time are ordered as HTA orders them (starts then ends, in file order, numpy's
quicksort over integer µs when the times are whole), so the statistics equal HTA's.
"""

from __future__ import annotations

import numpy as np

from d9d_kernels.trace._common import (
    ROUNDING_NOTE,
    hta_times,
    hta_type,
    launch_rows,
    open_steps,
    rank_key,
    resolve_mode,
)
from d9d_kernels.trace._result import metric, result

TOOL = "counters"
QUEUE_LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaMemcpyAsync",
                      "cudaMemsetAsync", "hipLaunchKernel", "hipExtModuleLaunchKernel", "hipMemsetAsync",
                      "hipMemcpyAsync", "hipMemcpyWithStream")


def queue_series(rt, rounding: str = "hta") -> dict:
    """``{stream: (ts, queue_length)}`` step functions (arrays, one point per change)."""
    start, _ = hta_times(rt, rounding)
    g, c = launch_rows(rt)
    keep = rt.name_mask(lambda n: n in QUEUE_LAUNCH_NAMES)[c]
    g, c = g[keep], c[keep]
    # one array over all streams, launches (file order) then GPU starts (file order), sorted
    # by time with numpy's quicksort: the order HTA's pandas sort_values gives, ties included
    oc, og = np.argsort(c, kind="stable"), np.argsort(g, kind="stable")
    ts = np.concatenate((start[c[oc]], start[g[og]]))
    stream = np.concatenate((rt.stream[g[oc]], rt.stream[g[og]]))
    delta = np.concatenate((np.ones(c.size), -np.ones(g.size)))
    order = np.argsort(ts, kind="quicksort")
    ts, stream, delta = ts[order], stream[order], delta[order]
    out = {}
    for st in np.unique(stream):
        m = stream == st
        out[int(st)] = (ts[m], np.cumsum(delta[m]))
    return out


def memory_kind(name: str) -> str | None:
    """HTA's memory-operation kind of a GPU event name (``get_memory_kernel_type``), or
    None for a name HTA does not type as MEMORY."""
    if hta_type(name) != "MEMORY":
        return None
    if name[:6] == "Memset":
        return "Memset"
    if name[:6] != "Memcpy":
        return "Memcpy Unknown"
    return name[:11]


def bandwidth_series(rt, rounding: str = "hta") -> dict:
    """``{kind: (ts, gbps, rows)}``: step functions of the bandwidth in use (one point per
    change) and the memory-operation rows of that kind (see module docstring)."""
    kinds = [memory_kind(n) for n in rt.names]
    labels = sorted({k for k in kinds if k is not None})
    code = np.array([labels.index(k) if k is not None else -1 for k in kinds], dtype=np.int64)
    rows = np.flatnonzero(rt.gpu_mask & (code[rt.name_id] >= 0)) if code.size else np.zeros(0, np.int64)
    if rows.size == 0:
        return {}
    start, end = hta_times(rt, rounding)
    s = start[rows]
    d = end[rows] - s
    e = s + np.where(d == 0, 1.0, d)
    bw = rt.mem_bw[rows]
    nb, dur = rt.nbytes[rows], rt.dur[rows]
    est = np.divide(nb, dur * 1e3, out=np.zeros_like(nb), where=np.isfinite(nb) & (dur > 0))
    bw = np.where(np.isfinite(bw), bw, est)
    ts = np.concatenate((s, e))
    if np.all(ts == np.floor(ts)):  # HTA's column is int64 then: sort the same dtype for its tie order
        ts = ts.astype(np.int64)
    delta = np.concatenate((bw, -bw))
    kind = np.concatenate((code[rt.name_id[rows]],) * 2)
    order = np.argsort(ts, kind="quicksort")
    ts, delta, kind = ts[order], delta[order], kind[order]
    out = {}
    for i, label in enumerate(labels):
        m = kind == i
        if m.any():
            out[label] = (ts[m].astype(np.float64), np.cumsum(delta[m]),
                          rows[code[rt.name_id[rows]] == i])
    return out


def _pick(n: int, max_points: int) -> np.ndarray:
    return np.unique(np.linspace(0, n - 1, max_points).astype(np.int64)) if n > max_points else np.arange(n)


def _time_weighted(ts, v) -> float:
    span = ts[-1] - ts[0]
    return float(np.sum(v[:-1] * np.diff(ts)) / span) if span > 0 else float(v.mean())


def _bw_metrics(rt, ts, bw, rows, max_points) -> dict:
    pos = bw[bw > 0]
    stat = (lambda f: float(f(pos))) if pos.size else (lambda f: None)  # noqa: E731
    nb = rt.nbytes[rows]
    have = np.isfinite(nb)
    pick = _pick(ts.size, max_points)
    why = "" if pos.size else " (None: no operation with a bandwidth)"
    return {
        "max": metric(stat(np.max), "GB/s", "peak bandwidth in use (sum over concurrent operations)" + why),
        "mean": metric(stat(np.mean), "GB/s", "mean over the change points with bandwidth > 0 "
                                              "(HTA's get_memory_bw_summary, not time-weighted)" + why),
        "median": metric(stat(np.median), "GB/s", "median over the change points with bandwidth > 0" + why),
        "min": metric(stat(np.min), "GB/s", "min over the change points with bandwidth > 0" + why),
        "points": metric(int(pos.size), "count", "change points with bandwidth > 0 (HTA's count)"),
        "time_weighted_mean": metric(_time_weighted(ts, bw), "GB/s",
                                     "bandwidth in use averaged over time from the first change to the "
                                     "last (idle time included)"),
        "ops": metric(int(rows.size), "count", "memory operations of this kind"),
        "bytes": metric(float(nb[have].sum()) if have.any() else None, "bytes",
                        "sum of args.bytes" + ("" if have.any() else " (None: no args.bytes in the trace)")),
        "series": {"ts_us": ts[pick].tolist(), "gbps": bw[pick].tolist()},
    }


def _stream_metrics(ts, q, max_points) -> dict:
    tw = _time_weighted(ts, q)
    pick = _pick(ts.size, max_points)
    return {
        "max": metric(float(q.max()), "count", "max queue length (launched, not yet started operations)"),
        "mean": metric(float(q.mean()), "count", "mean over change points (HTA's describe(), not time-weighted)"),
        "median": metric(float(np.median(q)), "count", "median over change points (HTA's describe())"),
        "time_weighted_mean": metric(tw, "count", "mean queue length weighted by how long each value holds"),
        "changes": metric(int(ts.size), "count", "change points (2 per launched operation)"),
        "series": {"ts_us": ts[pick].tolist(), "queue_length": q[pick].astype(int).tolist()},
    }


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False, rounding="hta", max_points: int = 2000) -> dict:
    """Queue length per rank and stream, memory bandwidth per rank and kind (see module docstring)."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed)
    notes = list(wl.notes) + [steps_note, ROUNDING_NOTE,
                              f"series: at most {max_points} points per stream / memory kind (evenly picked)"]
    out, maxes, bw_peak, bw_bytes, no_mem = {}, [], {}, {}, []
    for r, rt in ranks.items():
        if resolve_mode(rt, profile_mode) != "gpu":
            out[rank_key(r)] = {"mode": "cpu", "note": "no GPU events in this trace"}
            continue
        series = queue_series(rt, rounding)
        mem = {k: _bw_metrics(rt, ts, bw, rows, max_points)
               for k, (ts, bw, rows) in bandwidth_series(rt, rounding).items()}
        out[rank_key(r)] = {"streams": {f"stream{st}": _stream_metrics(ts, q, max_points)
                                        for st, (ts, q) in series.items()},
                            "memory_bw": mem}
        maxes += [float(q.max()) for _, q in series.values()]
        if not mem:
            no_mem.append(rank_key(r))
        for k, m in mem.items():
            if m["max"]["value"] is not None:
                bw_peak[k] = max(bw_peak.get(k, 0.0), m["max"]["value"])
            if m["bytes"]["value"] is not None:
                bw_bytes[k] = bw_bytes.get(k, 0.0) + m["bytes"]["value"]
    summary = {"max_queue_length": metric(max(maxes), "count", "max over ranks and streams")} if maxes else {}
    if bw_peak:
        summary["peak_memory_bw"] = {k: metric(v, "GB/s", "max over ranks of the peak bandwidth in use")
                                     for k, v in sorted(bw_peak.items())}
    if bw_bytes:
        summary["memory_bytes"] = {k: metric(v, "bytes", "args.bytes summed over ranks")
                                   for k, v in sorted(bw_bytes.items())}
    if no_mem:
        notes.append(f"memory bandwidth: no memcpy/memset/dma GPU events in {', '.join(no_mem)}")
    notes.append("memory bandwidth: per operation args['memory bandwidth (GB/s)'], else args.bytes / dur "
                 "(HolisticTraceAnalysis takes 0 there); only memcpy/memset, not the traffic of compute "
                 "or communication kernels")
    return result(TOOL, out, summary, notes, errors)
