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

from collections import defaultdict

import numpy as np

from d9d_kernels.trace._common import launch_rows, open_steps, rank_key, resolve_mode
from d9d_kernels.trace._load import KIND_PROFILER_STEP
from d9d_kernels.trace._result import metric, result

TOOL = "critical_path"
SYNC_NAMES = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
              "hipDeviceSynchronize", "hipStreamSynchronize", "hipEventSynchronize")
TOP = 10


def step_path(rt, lo: float, hi: float, launch_of: dict, cpu_rows: np.ndarray, gpu_rows: np.ndarray,
              is_sync: np.ndarray) -> dict:
    """Backtrack one window ``[lo, hi)``; ``{"cpu", "gpu", "gap", "end", "events"}`` (µs)."""
    ts, end = rt.ts, rt.ts + rt.dur
    cpu = cpu_rows[(ts[cpu_rows] >= lo) & (ts[cpu_rows] < hi)]
    kept = np.asarray([g for g, c in launch_of.items() if lo <= ts[c] < hi], dtype=np.int64)
    gpu = gpu_rows[np.isin(gpu_rows, kept)]
    if cpu.size + gpu.size == 0:
        return {}
    thread = defaultdict(list)
    for i in cpu.tolist():
        thread[(int(rt.pid[i]), int(rt.tid[i]))].append(i)
    thread = {k: np.asarray(v, dtype=np.int64) for k, v in thread.items()}
    stream = defaultdict(list)
    for i in gpu.tolist():
        stream[int(rt.stream[i])].append(i)
    stream = {k: np.asarray(v, dtype=np.int64) for k, v in stream.items()}
    acc = {"cpu": 0.0, "gpu": 0.0, "gap": 0.0}
    on_path: dict = defaultdict(float)

    allr = np.concatenate((cpu, gpu))
    node = int(allr[np.argmax(end[allr])])
    last = float(end[node])
    on_gpu = bool(rt.gpu_mask[node])
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
            same = stream[int(rt.stream[node])]
            prev = same[end[same] <= cursor]
            best, best_end = None, -np.inf
            if prev.size:
                best = int(prev[np.argmax(end[prev])])
                best_end = float(end[best])
            launch = launch_of.get(node)
            if launch is not None and min(float(end[launch]), cursor) >= best_end:
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
        same = thread.get(key, np.zeros(0, dtype=np.int64))
        enc = same[(ts[same] < cursor) & (end[same] >= cursor)]
        inner = int(enc[np.argmax(ts[enc])]) if enc.size else None
        if inner is not None and is_sync[inner]:
            done = gpu[(end[gpu] > ts[inner]) & (end[gpu] <= cursor)]
            if done.size:
                g = int(done[np.argmax(end[done])])
                acc["cpu"] += cursor - float(end[g])
                on_path[inner] += cursor - float(end[g])
                node, cursor, on_gpu = g, float(end[g]), True
                continue
        prev = same[end[same] < cursor]
        nxt_end = float(end[prev].max()) if prev.size else -np.inf
        if inner is not None:
            bound = max(nxt_end, float(ts[inner]), lo)
            acc["cpu"] += cursor - bound
            on_path[inner] += cursor - bound
            cursor = bound
        elif prev.size:
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


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False) -> dict:
    """Critical-path split per rank and step (see module docstring)."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed)
    notes = list(wl.notes) + [steps_note, "path traced backwards along binding dependencies "
                              "(stream order, launch, thread order, synchronisation); see docs/trace.md"]
    out = {}
    for r, rt in ranks.items():
        if resolve_mode(rt, profile_mode) != "gpu":
            out[rank_key(r)] = {"mode": "cpu", "note": "no GPU events in this trace"}
            continue
        g, c = launch_rows(rt)
        launch_of = dict(zip(g.tolist(), c.tolist()))
        # CPU events on threads, without the ProfilerStep spans (they enclose everything)
        cpu_rows = np.flatnonzero(~rt.gpu_mask & (rt.stream < 0) & (rt.kind != KIND_PROFILER_STEP))
        gpu_rows = np.flatnonzero(rt.gpu_mask)
        is_sync = rt.name_mask(lambda n: n in SYNC_NAMES)
        nums, s0, s1 = rt.steps
        windows = [(f"step{int(n)}", float(a), float(b)) for n, a, b in zip(nums, s0, s1)]
        if not windows:
            windows = [("all", float(rt.ts.min()), float((rt.ts + rt.dur).max()) + 1)]
        per, tot, events = {}, defaultdict(float), defaultdict(float)
        for name, lo, hi in windows:
            p = step_path(rt, lo, hi, launch_of, cpu_rows, gpu_rows, is_sync)
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
                events[(rt.names[rt.name_id[i]], "gpu" if rt.gpu_mask[i] else "cpu")] += v
        if not per:
            out[rank_key(r)] = {"note": "no events in the steps"}
            continue
        entry = {f"{k}_pct": metric(100.0 * tot[k] / tot["path"] if tot["path"] > 0 else None, "%",
                                    f"{k} time on the critical path / path time, all steps")
                 for k in ("cpu", "gpu", "gap")}
        entry["path_time_total"] = metric(tot["path"], "us", "sum over steps of path_time")
        entry["steps"] = per
        top = sorted(events.items(), key=lambda kv: -kv[1])[:TOP]
        entry["top_events"] = [{"name": n, "side": s, "time": metric(v, "us", "time on the path, all steps")}
                               for (n, s), v in top]
        out[rank_key(r)] = entry
    return result(TOOL, out, {}, notes, errors)
