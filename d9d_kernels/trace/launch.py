"""CUDA kernel launch statistics (HolisticTraceAnalysis's ``get_cuda_kernel_launch_stats``).

Per rank, each GPU event launched by a launch call (``cudaLaunchKernel``,
``cudaLaunchKernelExC``, and with ``include_memory_events`` ``cudaMemcpyAsync`` /
``cudaMemsetAsync``) is paired with that call by correlation id:

* cpu_duration = duration of the launch call; gpu_duration = duration of the GPU event;
* launch delay = GPU start - launch call end, clipped at 0 (time queued on the stream);
* **short kernels**: cpu_duration <= ``runtime_cutoff`` and gpu_duration < cpu_duration
  (launching costs more than running; HTA's "short GPU kernels" chart);
* **runtime outliers**: cpu_duration > ``runtime_cutoff`` (50 µs);
* **launch delay outliers**: launch delay > ``launch_delay_cutoff`` (100 µs).

``launch_names="hta"`` uses HTA's list of launch calls (CUDA only); ``"all"`` adds the
driver call ``cuLaunchKernel`` (Triton) and the HIP calls, so ROCm traces get statistics too.
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

TOOL = "launch"
HTA_KERNEL_LAUNCH = ("cudaLaunchKernel", "cudaLaunchKernelExC")
HTA_MEMORY_LAUNCH = ("cudaMemcpyAsync", "cudaMemsetAsync")
EXTRA_KERNEL_LAUNCH = ("cuLaunchKernel", "cuLaunchKernelEx", "hipLaunchKernel", "hipExtLaunchKernel",
                       "hipModuleLaunchKernel", "hipExtModuleLaunchKernel")
EXTRA_MEMORY_LAUNCH = ("hipMemcpyAsync", "hipMemsetAsync", "hipMemcpyWithStream")
TOP = 10


def launch_pairs(rt, include_memory_events: bool = True, launch_names: str = "hta",
                 rounding: str = "hta") -> dict:
    """Arrays over the launched GPU events: ``gpu_row, cpu_dur, gpu_dur, delay`` (µs)."""
    if launch_names not in ("hta", "all"):
        raise ValueError(f"{TOOL}: launch_names must be 'hta' or 'all', got {launch_names!r}")
    names = set(HTA_KERNEL_LAUNCH) | (set(HTA_MEMORY_LAUNCH) if include_memory_events else set())
    if launch_names == "all":
        names |= set(EXTRA_KERNEL_LAUNCH) | (set(EXTRA_MEMORY_LAUNCH) if include_memory_events else set())
    start, end = hta_times(rt, rounding)
    g, c = launch_rows(rt)
    keep = rt.name_mask(lambda n: n in names)[c]
    g, c = g[keep], c[keep]
    cpu_dur = end[c] - start[c]
    return {"gpu_row": g, "cpu_dur": cpu_dur, "gpu_dur": end[g] - start[g],
            "delay": np.maximum(start[g] - end[c], 0.0)}


def _stats(x: np.ndarray, what: str) -> dict:
    if x.size == 0:
        return {k: metric(None, "us", f"{k} of {what}: no launches") for k in ("mean", "median", "p95", "max")}
    return {"mean": metric(float(x.mean()), "us", f"mean {what}"),
            "median": metric(float(np.median(x)), "us", f"median {what}"),
            "p95": metric(float(np.percentile(x, 95)), "us", f"95th percentile {what}"),
            "max": metric(float(x.max()), "us", f"max {what}")}


def rank_launch(rt, runtime_cutoff=50.0, launch_delay_cutoff=100.0, **kw) -> dict:
    p = launch_pairs(rt, **kw)
    n = int(p["gpu_row"].size)
    short = (p["cpu_dur"] <= runtime_cutoff) & (p["gpu_dur"] < p["cpu_dur"])
    rt_out = p["cpu_dur"] > runtime_cutoff
    ld_out = p["delay"] > launch_delay_cutoff
    pct = (lambda k: metric(100.0 * k / n if n else None, "%", "share of launches"))
    order = np.argsort(-p["delay"], kind="stable")[:TOP]
    names = rt.name_array(p["gpu_row"][order])
    return {
        "launches": metric(n, "count", "GPU events paired with their launch call (correlation id)"),
        "launch_delay": _stats(p["delay"], "launch delay: GPU start - launch call end, clipped at 0"),
        "cpu_duration": _stats(p["cpu_dur"], "launch call duration"),
        "gpu_duration": _stats(p["gpu_dur"], "duration of the launched GPU event"),
        "short_kernels": metric(int(short.sum()), "count",
                                f"cpu_duration <= {runtime_cutoff:g} us and gpu_duration < cpu_duration"),
        "short_kernels_pct": pct(int(short.sum())),
        "runtime_outliers": metric(int(rt_out.sum()), "count", f"cpu_duration > {runtime_cutoff:g} us"),
        "runtime_outliers_pct": pct(int(rt_out.sum())),
        "launch_delay_outliers": metric(int(ld_out.sum()), "count",
                                        f"launch delay > {launch_delay_cutoff:g} us"),
        "launch_delay_outliers_pct": pct(int(ld_out.sum())),
        # full names, longest delays first (text output shows the table, JSON keeps all)
        "longest_delays": [{"name": str(nm), "delay": metric(float(d), "us", "launch delay")}
                           for nm, d in zip(names, p["delay"][order])],
    }


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False, rounding="hta", runtime_cutoff: float = 50.0,
               launch_delay_cutoff: float = 100.0, include_memory_events: bool = True,
               launch_names: str = "all") -> dict:
    """Launch delay, short kernels and outliers per rank (see module docstring)."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed)
    notes = list(wl.notes) + [steps_note, ROUNDING_NOTE,
                              f"launch calls: {launch_names!r} ("
                              + ("HTA's list" if launch_names == "hta" else
                                 "HTA's list + cuLaunchKernel and the HIP calls") + ")"]
    out, worst = {}, []
    for r, rt in ranks.items():
        if resolve_mode(rt, profile_mode) != "gpu":
            out[rank_key(r)] = {"mode": "cpu", "note": "no GPU events in this trace"}
            continue
        e = rank_launch(rt, runtime_cutoff, launch_delay_cutoff,
                        include_memory_events=include_memory_events, launch_names=launch_names,
                        rounding=rounding)
        out[rank_key(r)] = e
        if e["launch_delay"]["median"]["value"] is not None:
            worst.append(e["launch_delay"]["median"]["value"])
    summary = {}
    if worst:
        summary["max_median_launch_delay"] = metric(max(worst), "us", "max over ranks of the median launch delay")
    return result(TOOL, out, summary, notes, errors)
