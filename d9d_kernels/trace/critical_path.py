"""The chain of CPU and GPU events that bounds each step (a simplified critical path).

Per rank and ProfilerStep, over the step's CPU events and the GPU work they launched,
the path is traced backwards from the event that ends last, always following the
dependency that released the current event last:

* a GPU event waits on the previous event of its stream and on its launch call;
  the later-ending of the two is followed, and the time between it and the GPU
  event's start is a **gap** (launch latency / queueing);
* a CPU event follows the latest-ending event of its thread that ended before it
  started; time in between that an enclosing op of the thread covers is that op's
  **CPU** time, the rest is a gap;
* a synchronising call (``cudaDeviceSynchronize``, ``cudaStreamSynchronize``,
  ``cudaEventSynchronize``) is released by the GPU event that ended last inside it,
  which the path follows (the call's time after that is CPU time).

Cross-thread dependencies are not known (e.g. the autograd engine's threads): time the
main thread spends inside an op waiting for another thread is that op's CPU time.

The step's time from its start to the last end is split into ``cpu_time``,
``gpu_time`` and ``gap_time`` on the path (they add up to ``path_time``). This is a
backtracking of binding dependencies, not HTA's full DAG longest path (HTA 0.5.0's
critical_path_analysis cannot run here: its call graph raises under numpy 2).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections import defaultdict
from functools import partial

import numpy as np

from d9d_kernels.trace._common import launch_rows, map_ranks, open_steps, rank_key, resolve_mode
from d9d_kernels.trace._load import KIND_PROFILER_STEP
from d9d_kernels.trace._result import metric, result

TOOL = "critical_path"
SYNC_NAMES = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize")
TOP = 10


class _ByEnd:
    """Rows sorted by (end, row): the latest end at or before / before a time in O(log n)
    (Python lists and bisect: one scalar query is several times cheaper than numpy's)."""

    def __init__(self, rows: np.ndarray, end: np.ndarray):
        e = end[rows]
        order = np.lexsort((rows, e))
        self.rows, self.end = rows[order].tolist(), e[order].tolist()

    def last_le(self, x: float):
        """``(row, end)`` of the latest end <= ``x`` (the first row among equal ends), or None."""
        k = bisect_right(self.end, x) - 1
        if k < 0:
            return None
        v = self.end[k]
        return self.rows[bisect_left(self.end, v)], v

    def max_lt(self, x: float) -> float:
        k = bisect_left(self.end, x) - 1
        return self.end[k] if k >= 0 else -np.inf


class _ByStart:
    """Rows sorted by (start, row) with a sparse table of range-max end: the latest-starting
    row that starts before ``x`` and ends at or after it (the innermost enclosing op) in
    O(log n), where a scan would cost O(n) per step of the path."""

    def __init__(self, rows: np.ndarray, ts: np.ndarray, end: np.ndarray):
        t = ts[rows]
        order = np.lexsort((rows, t))
        e = end[rows][order]
        self.rows, self.ts, self.end = rows[order].tolist(), t[order].tolist(), e.tolist()
        table = [e]
        w = 1
        while 2 * w <= e.size:
            prev = table[-1]
            table.append(np.maximum(prev[:-w], prev[w:]))  # max over [i, i + 2w)
            w *= 2
        self.table = [(1 << lvl, lv.tolist()) for lvl, lv in enumerate(table)][::-1]

    def enclosing(self, x: float):
        """Row with the largest start < ``x`` among rows ending >= ``x`` (first row on ties), or None."""
        pos = bisect_left(self.ts, x)
        for w, level in self.table:  # skip blocks that all end before x, largest first
            if pos >= w and level[pos - w] < x:
                pos -= w
        j = pos - 1
        if j < 0:
            return None
        for i in range(bisect_left(self.ts, self.ts[j]), j + 1):  # equal starts: the first that encloses x
            if self.end[i] >= x:
                return self.rows[i]
        return None  # pragma: no cover - j itself encloses x


def _split(rows: np.ndarray, *keys: np.ndarray) -> dict:
    """``{key tuple: rows in row order}`` grouping ``rows`` by the given per-row key arrays."""
    if rows.size == 0:
        return {}
    cols = [k[rows] for k in keys]
    order = np.lexsort([rows] + cols[::-1])
    r = rows[order]
    cols = [c[order] for c in cols]
    change = np.zeros(r.size, dtype=bool)
    for c in cols:
        change[1:] |= c[1:] != c[:-1]
    cuts = np.flatnonzero(change)
    starts = np.r_[0, cuts]
    keys_at = list(zip(*(c[starts].tolist() for c in cols)))
    return dict(zip(keys_at, np.split(r, cuts)))


def step_path(rt, lo: float, hi: float, launch_of: np.ndarray, cpu_rows: np.ndarray, gpu_rows: np.ndarray,
              is_sync: np.ndarray, is_gpu: np.ndarray | None = None, launches=None) -> dict:
    """Backtrack one window ``[lo, hi)``; ``{"cpu", "gpu", "gap", "end", "events"}`` (µs).

    ``launch_of``: per row, the row of the call that launched it (-1: none);
    ``launches``: the ``(gpu_rows, cpu_rows)`` pairs of :func:`launch_rows`."""
    ts, end = rt.ts, rt.ts + rt.dur
    if is_gpu is None:
        is_gpu = rt.gpu_mask
    if launches is None:
        g = np.flatnonzero(launch_of >= 0)
        launches = (g, launch_of[g])
    cpu = cpu_rows[(ts[cpu_rows] >= lo) & (ts[cpu_rows] < hi)]
    lg, lc = launches
    gpu = np.sort(lg[(ts[lc] >= lo) & (ts[lc] < hi)])
    if cpu.size + gpu.size == 0:
        return {}
    thread_rows = _split(cpu, rt.pid, rt.tid)
    thread_end = {k: _ByEnd(v, end) for k, v in thread_rows.items()}
    thread_start = {k: _ByStart(v, ts, end) for k, v in thread_rows.items()}
    stream_end = {k[0]: _ByEnd(v, end) for k, v in _split(gpu, rt.stream).items()}
    all_gpu = _ByEnd(gpu, end)
    acc = {"cpu": 0.0, "gpu": 0.0, "gap": 0.0}
    on_path: dict = defaultdict(float)

    allr = np.concatenate((cpu, gpu))
    node = int(allr[np.argmax(end[allr])])
    last = float(end[node])
    on_gpu = bool(is_gpu[node])
    cursor = last
    key = None if on_gpu else (int(rt.pid[node]), int(rt.tid[node]))
    for _ in range(8 * allr.size + 8):  # the cursor moves back every round; bounded for safety
        if cursor <= lo:
            break
        if on_gpu:
            start = max(float(ts[node]), lo)
            acc["gpu"] += cursor - start
            on_path[node] += cursor - start
            cursor = start
            found = stream_end[int(rt.stream[node])].last_le(cursor)
            best, best_end = found if found is not None else (None, -np.inf)
            launch = int(launch_of[node])
            if launch >= 0 and min(float(end[launch]), cursor) >= best_end:
                bound = min(float(end[launch]), cursor)
                acc["gap"] += cursor - bound  # queued after the launch returned
                # the launch call itself, then its thread
                start = max(float(ts[launch]), lo)
                acc["cpu"] += bound - start
                on_path[launch] += bound - start
                cursor, on_gpu = start, False
                key = (int(rt.pid[launch]), int(rt.tid[launch]))
                continue
            if best is None:
                break
            acc["gap"] += cursor - best_end
            node, cursor = best, best_end
            continue
        if key not in thread_end:  # the thread has no op in the window
            break
        inner = thread_start[key].enclosing(cursor)
        if inner is not None and is_sync[inner]:
            found = all_gpu.last_le(cursor)
            if found is not None and found[1] > ts[inner]:
                g, g_end = found
                acc["cpu"] += cursor - g_end
                on_path[inner] += cursor - g_end
                node, cursor, on_gpu = g, g_end, True
                continue
        nxt_end = thread_end[key].max_lt(cursor)
        if inner is not None:
            bound = max(nxt_end, float(ts[inner]), lo)
            acc["cpu"] += cursor - bound
            on_path[inner] += cursor - bound
            cursor = bound
        elif nxt_end > -np.inf:
            bound = max(nxt_end, lo)
            acc["gap"] += cursor - bound  # on the thread, outside any recorded op
            cursor = bound
        else:
            break
    if cursor > lo:
        acc["gap"] += cursor - lo
    acc["end"] = last
    acc["events"] = on_path
    return acc


def rank_path(rt, profile_mode="auto") -> dict:
    """One rank's entry: per-step split, all-step shares and the events longest on the path."""
    if resolve_mode(rt, profile_mode) != "gpu":
        return {"mode": "cpu", "note": "no GPU events in this trace"}
    g, c = launch_rows(rt)
    launch_of = np.full(len(rt), -1, dtype=np.int64)
    launch_of[g] = c
    is_gpu = rt.gpu_mask
    # CPU events on threads, without the ProfilerStep spans (they enclose everything)
    cpu_rows = np.flatnonzero(~is_gpu & (rt.stream < 0) & (rt.kind != KIND_PROFILER_STEP))
    gpu_rows = np.flatnonzero(is_gpu)
    is_sync = rt.name_mask(lambda n: n in SYNC_NAMES)
    nums, s0, s1 = rt.steps
    windows = [(f"step{int(n)}", float(a), float(b)) for n, a, b in zip(nums, s0, s1)]
    if not windows:
        windows = [("all", float(rt.ts.min()), float((rt.ts + rt.dur).max()) + 1)]
    per, tot, events = {}, defaultdict(float), defaultdict(float)
    for name, lo, hi in windows:
        p = step_path(rt, lo, hi, launch_of, cpu_rows, gpu_rows, is_sync, is_gpu, (g, c))
        if not p:
            continue
        path = p["end"] - lo
        per[name] = {
            "path_time": metric(path, "us", "step start to the last end of its CPU events and GPU work"),
            **{f"{k}_time": metric(p[k], "us", f"{k} time on the critical path") for k in ("cpu", "gpu", "gap")},
            **{f"{k}_pct": metric(100.0 * p[k] / path if path > 0 else None, "%",
                                  f"{k}_time / path_time * 100") for k in ("cpu", "gpu", "gap")},
        }
        tot["path"] += path
        for k in ("cpu", "gpu", "gap"):
            tot[k] += p[k]
        for i, v in p["events"].items():
            events[(rt.names[rt.name_id[i]], "gpu" if is_gpu[i] else "cpu")] += v
    if not per:
        return {"note": "no events in the steps"}
    entry = {f"{k}_pct": metric(100.0 * tot[k] / tot["path"] if tot["path"] > 0 else None, "%",
                                f"{k} time on the critical path / path time, all steps")
             for k in ("cpu", "gpu", "gap")}
    entry["path_time_total"] = metric(tot["path"], "us", "sum over steps of path_time")
    entry["steps"] = per
    top = sorted(events.items(), key=lambda kv: -kv[1])[:TOP]
    entry["top_events"] = [{"name": n, "side": s, "time": metric(v, "us", "time on the path, all steps")}
                           for (n, s), v in top]
    return entry


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False) -> dict:
    """Critical-path split per rank and step (see module docstring)."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed)
    notes = list(wl.notes) + [steps_note, "path traced backwards along binding dependencies "
                              "(stream order, launch, thread order, synchronisation); see docs/trace.md"]
    out = {rank_key(r): e for r, e in map_ranks(partial(rank_path, profile_mode=profile_mode), ranks).items()}
    return result(TOOL, out, {}, notes, errors)
