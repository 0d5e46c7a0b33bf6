"""Compute-communication overlap, exposed communication and GPU idle (bubble) time.

GPU mode, per rank, over the GPU events kept by the step filter (see
``_common.gpu_rows``), with HolisticTraceAnalysis's kernel typing
(``_common.hta_type``: communication = ``^nccl.*Kernel``; computation = not
NCCL, not memcpy/memset, not ``*Sync``):

* span = last GPU event end - first GPU event start (HTA's "kernel time");
* busy = |union of all GPU events|; idle (bubble) = span - busy;
* compute = |union of computation kernels|; non-compute = busy - compute;
* comm = |union of communication kernels|;
* overlap % = |compute ∩ comm| / comm (HTA ``get_comm_comp_overlap``);
* exposed communication = |comm \\ compute|.

CPU mode (no GPU events, e.g. gloo): comm intervals are the CPU collective ranges
(``communication.collective_events``: ``gloo:all_reduce``-style ranges, else
``record_param_comms``); compute intervals are the other ``cpu_op`` events on *other* threads
(a collective blocks its own thread); overlap and exposed comm as above.
"""

from __future__ import annotations

import numpy as np

from d9d_kernels.trace import _intervals as iv
from d9d_kernels.trace._common import (
    classify_rows,
    ROUNDING_NOTE,
    gpu_intervals,
    gpu_rows,
    hta_type,
    open_steps,
    rank_key,
    resolve_mode,
)
from d9d_kernels.trace._load import KIND_CPU_OP, RankTrace
from d9d_kernels.trace._result import metric, result
from d9d_kernels.trace.communication import collective_events


def temporal_breakdown(rt: RankTrace, step_filter: str = "hta", rounding: str = "hta") -> dict:
    """Raw numbers (µs) of the GPU time breakdown of one rank."""
    rows = np.flatnonzero(gpu_rows(rt, step_filter))
    if rows.size == 0:
        return {}
    s, e = gpu_intervals(rt, rows, rounding)
    types = classify_rows(rt, rows, lambda n, k: hta_type(n))
    span = float(e.max() - s.min())
    busy = iv.total(s, e)
    comp = (s[types == "COMPUTATION"], e[types == "COMPUTATION"])
    comm = (s[types == "COMMUNICATION"], e[types == "COMMUNICATION"])
    compute = iv.total(*comp)
    comm_t = iv.total(*comm)
    ov = iv.intersection_length(comp, comm)
    return {"span": span, "busy": busy, "idle": span - busy, "compute": compute,
            "non_compute": busy - compute, "comm": comm_t, "overlap": ov,
            "exposed_comm": comm_t - ov, "n_events": int(rows.size)}


def _cpu_breakdown(rt: RankTrace) -> dict:
    comm_rows = np.array([ev["row"] for ev in collective_events(rt, "cpu")], dtype=np.int64)
    ops = np.flatnonzero((rt.kind == KIND_CPU_OP) & ~rt.is_comm)
    s, e = rt.ts, rt.ts + rt.dur
    comm_t = iv.total(s[comm_rows], e[comm_rows])
    ov = 0.0
    for tid in np.unique(rt.tid[comm_rows]):
        c = comm_rows[rt.tid[comm_rows] == tid]
        o = ops[rt.tid[ops] != tid]
        ov += iv.intersection_length((s[c], e[c]), (s[o], e[o]))
    ov = min(ov, comm_t)
    return {"comm": comm_t, "overlap": ov, "exposed_comm": comm_t - ov}


def _pct(x, total):
    return 100.0 * x / total if total > 0 else None


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False, step_filter=None, rounding="hta") -> dict:
    """Overlap / exposed communication / idle breakdown per rank (see module docstring)."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed, step_filter)
    out: dict = {}
    notes = list(wl.notes) + [steps_note]
    for r, rt in ranks.items():
        mode = resolve_mode(rt, profile_mode)
        if mode == "gpu":
            b = temporal_breakdown(rt, "all", rounding)  # filtered by open_steps
            if not b:
                out[rank_key(r)] = {"mode": "gpu", "note": "no GPU events after the step filter"}
                continue
            span = b["span"]
            out[rank_key(r)] = {
                "mode": "gpu",
                "gpu_span": metric(b["span"], "us", "last GPU event end - first GPU event start"),
                "busy_time": metric(b["busy"], "us", "length of the union of all GPU events"),
                "idle_time": metric(b["idle"], "us", "bubble: span - busy (no GPU event running)"),
                "compute_time": metric(b["compute"], "us", "union of computation kernels (HTA typing)"),
                "non_compute_time": metric(b["non_compute"], "us",
                                           "busy - compute (communication, memcpy/memset, sync)"),
                "idle_pct": metric(_pct(b["idle"], span), "%", "idle_time / gpu_span"),
                "compute_pct": metric(_pct(b["compute"], span), "%", "compute_time / gpu_span"),
                "non_compute_pct": metric(_pct(b["non_compute"], span), "%", "non_compute_time / gpu_span"),
                "comm_time": metric(b["comm"], "us", "union of NCCL/RCCL kernels"),
                "overlap_time": metric(b["overlap"], "us", "|compute ∩ comm|"),
                "overlap_pct": metric(_pct(b["overlap"], b["comm"]), "%",
                                      "|compute ∩ comm| / comm_time (HTA comp_comm_overlap_pctg)"),
                "exposed_comm_time": metric(b["exposed_comm"], "us",
                                            "comm time not hidden by computation: |comm \\ compute|"),
                "exposed_comm_pct": metric(_pct(b["exposed_comm"], span), "%", "exposed_comm_time / gpu_span"),
            }
        else:
            b = _cpu_breakdown(rt)
            out[rank_key(r)] = {
                "mode": "cpu",
                "comm_time": metric(b["comm"], "us", "union of CPU collective ranges"),
                "overlap_time": metric(b["overlap"], "us",
                                       "comm time during which cpu_ops run on other threads"),
                "overlap_pct": metric(_pct(b["overlap"], b["comm"]), "%", "overlap_time / comm_time"),
                "exposed_comm_time": metric(b["exposed_comm"], "us", "comm_time - overlap_time"),
            }
    if any(v.get("mode") == "gpu" for v in out.values()):
        notes += [ROUNDING_NOTE]
    summary = {}
    vals = [v["overlap_pct"]["value"] for v in out.values()
            if "overlap_pct" in v and v["overlap_pct"]["value"] is not None]
    if vals:
        summary["mean_overlap_pct"] = metric(float(np.mean(vals)), "%", "mean over ranks of overlap_pct")
    idles = [v["idle_pct"]["value"] for v in out.values() if "idle_pct" in v]
    if idles:
        summary["max_idle_pct"] = metric(float(np.max(idles)), "%", "largest idle_pct over ranks")
    return result("overlap", out, summary, notes, errors)
