"""FSDP: all-gather, reduce-scatter, reshard and copy-in/out, from FSDP annotations and NCCL kernels.

CPU side — the ``record_function`` labels FSDP itself emits (FSDP2
``torch/distributed/fsdp/_fully_shard``: ``FSDP::<what> (<module fqn>)``; its
custom ops ``fsdp::all_gather_copy_in`` / ``fsdp::split_with_sizes_copy`` /
``fsdp::chunk_cat``; FSDP1 ``FullyShardedDataParallel._<what>``). The label up
to the first `` (``, `` [`` or `` for `` is the *operation*; every operation is
grouped into one of :data:`GROUPS`. Per group and per operation: ``count``
(events) and ``cpu_time`` = length of the union of its events (nested/repeated
labels counted once).

GPU side — NCCL/RCCL kernels (on CPU-only traces: the ``c10d::`` collective
ops, else ``record_param_comms``, else ``gloo:*`` spans) typed by kernel name or ``Collective name`` arg: all_gather,
reduce_scatter, all_reduce (HSDP replication). Per type: ``count``, ``time`` =
union of the kernels, ``exposed_time`` = time not overlapped by any
non-communication GPU work on the same rank (|comm \\ compute|, as the overlap
tool defines exposed communication). GPU events follow the overlap tool's
step filter (HTA default: work launched from the last ProfilerStep is dropped).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from d9d_kernels.trace import _intervals as iv
from d9d_kernels.trace._common import gpu_rows, open_steps, rank_key
from d9d_kernels.trace._load import KIND_GPU_USER_ANNOTATION, KIND_KERNEL, RankTrace, TraceError
from d9d_kernels.trace._result import metric, result

TOOL = "fsdp"

# operation label -> group
_OP_GROUP = {
    # FSDP2
    "FSDP::all_gather": "all_gather",
    "FSDP::all_gather_copy_in": "all_gather_copy_in",
    "fsdp::all_gather_copy_in": "all_gather_copy_in",
    "FSDP::all_gather_copy_out": "all_gather_copy_out",
    "fsdp::split_with_sizes_copy": "all_gather_copy_out",
    "FSDP::post_backward_reduce": "reduce_scatter",
    "fsdp::chunk_cat": "reduce_scatter_copy_in",
    "FSDP::post_backward_rs_wait": "reduce_scatter_wait",
    "FSDP::post_backward_reshard": "reshard",
    "FSDP::post_backward_accumulate": "post_backward",
    "FSDP::post_backward": "post_backward",
    "FSDP::root_post_backward": "post_backward",
    "FSDP::root_post_backward_callback": "post_backward",
    "FSDP::pre_forward": "pre_forward",
    "FSDP::root_pre_forward": "pre_forward",
    "FSDP::inputs_to_device": "pre_forward",
    "FSDP::cast_forward_inputs": "pre_forward",
    "FSDP::post_forward": "post_forward",
    "FSDP::cast_forward_outputs": "post_forward",
    "FSDP::force_complete_post_forward": "post_forward",
    "FSDP::pre_backward": "pre_backward",
    "FSDP::forward_prefetch": "prefetch",
    "FSDP::backward_prefetch": "prefetch",
    # FSDP1
    "FullyShardedDataParallel._pre_forward": "pre_forward",
    "FullyShardedDataParallel._root_pre_forward": "pre_forward",
    "FullyShardedDataParallel._post_forward": "post_forward",
    "FullyShardedDataParallel._pre_backward_hook": "pre_backward",
    "FullyShardedDataParallel._post_backward_hook": "reduce_scatter",
    "FullyShardedDataParallel._post_backward_hook_reshard_only": "reshard",
    "FullyShardedDataParallel._pre_forward_prefetch": "prefetch",
    "FullyShardedDataParallel._pre_backward_prefetch": "prefetch",
    "FullyShardedDataParallel._post_backward_prefetch": "prefetch",
}
GROUPS = ("all_gather", "all_gather_copy_in", "all_gather_copy_out", "reduce_scatter",
          "reduce_scatter_copy_in", "reduce_scatter_wait", "reshard", "pre_forward", "post_forward",
          "pre_backward", "post_backward", "prefetch", "other")
GROUP_DEFS = {
    "all_gather": "FSDP::all_gather (unshard: copy-in + all-gather issue)",
    "all_gather_copy_in": "fsdp::all_gather_copy_in op (pack local shards into the all-gather input)",
    "all_gather_copy_out": "FSDP::all_gather_copy_out / fsdp::split_with_sizes_copy (unpack gathered params)",
    "reduce_scatter": "FSDP::post_backward_reduce (FSDP1: _post_backward_hook) — grad reduce-scatter issue",
    "reduce_scatter_copy_in": "fsdp::chunk_cat op (pack grads into the reduce-scatter input)",
    "reduce_scatter_wait": "FSDP::post_backward_rs_wait (waiting on earlier reduce-scatters)",
    "reshard": "FSDP::post_backward_reshard (FSDP1: _post_backward_hook_reshard_only) — free unsharded params",
    "pre_forward": "FSDP::pre_forward / root_pre_forward / inputs_to_device / cast_forward_inputs",
    "post_forward": "FSDP::post_forward (reshard after forward) / cast_forward_outputs",
    "pre_backward": "FSDP::pre_backward",
    "post_backward": "FSDP::post_backward* other than reduce/reshard",
    "prefetch": "FSDP::forward_prefetch / backward_prefetch for <module>",
    "other": "any other FSDP::/FullyShardedDataParallel. label",
}
_LABEL_CUT = re.compile(r" \(| \[| for ")
_AG = re.compile(r"all_?gather", re.I)
_RS = re.compile(r"reduce_?scatter", re.I)
_AR = re.compile(r"all_?reduce", re.I)
COMM_TYPES = ("all_gather", "reduce_scatter", "all_reduce")


def operation_of(name: str) -> str | None:
    """The FSDP operation label of an event name, ``None`` if not an FSDP event."""
    if not name.startswith(("FSDP::", "fsdp::", "FullyShardedDataParallel.")):
        return None
    return _LABEL_CUT.split(name, 1)[0].strip()


def group_of(op: str) -> str:
    return _OP_GROUP.get(op, "other")


def _comm_type(text: str) -> str | None:
    if _AG.search(text):
        return "all_gather"
    if _RS.search(text):
        return "reduce_scatter"
    if _AR.search(text):
        return "all_reduce"
    return None


def _cpu_comm_rows(rt: RankTrace) -> np.ndarray:
    """CPU-side collectives when there is no GPU: the ``c10d::`` ops (one per collective
    call, on the calling thread; gloo runs the work on its own thread as ``gloo:*``
    spans, and implements reduce-scatter with an all-reduce, so those are not used
    for typing), else ``record_param_comms`` ops, else ``gloo:``/``nccl:`` spans."""
    cpu = ~rt.gpu_mask & (rt.kind != KIND_GPU_USER_ANNOTATION)
    for pred in (lambda n: n.startswith("c10d::"), None, lambda n: n.startswith(("gloo:", "nccl:"))):
        rows = np.flatnonzero(cpu & (rt.is_comm if pred is None else rt.name_mask(pred)))
        if rows.size:
            return rows
    return np.empty(0, dtype=np.int64)


def rank_fsdp(rt: RankTrace, step_filter: str = "hta") -> dict:
    """Raw numbers (µs, counts) of one rank."""
    s_all, e_all = rt.ts, rt.ts + rt.dur
    ops = np.asarray([operation_of(n) for n in rt.names], dtype=object)
    ev_op = ops[rt.name_id] if len(rt.names) else np.empty(0, dtype=object)
    cpu = (rt.kind != KIND_GPU_USER_ANNOTATION) & ~rt.gpu_mask
    fsdp_rows = np.flatnonzero(cpu & (ev_op != None))  # noqa: E711 (object array)
    by_op: dict[str, dict] = {}
    by_group: dict[str, dict] = {}
    for op in sorted({ev_op[i] for i in fsdp_rows}):
        rows = fsdp_rows[ev_op[fsdp_rows] == op]
        by_op[op] = {"count": int(rows.size), "cpu_time": iv.total(s_all[rows], e_all[rows]),
                     "group": group_of(op)}
    for g in GROUPS:
        ops_g = [op for op, d in by_op.items() if d["group"] == g]
        if not ops_g:
            continue
        rows = fsdp_rows[np.isin(ev_op[fsdp_rows], ops_g)]
        by_group[g] = {"count": int(rows.size), "cpu_time": iv.total(s_all[rows], e_all[rows])}

    # communication: NCCL kernels on GPU, else record_param_comms on CPU
    comm: dict[str, dict] = {}
    g_rows = np.flatnonzero(gpu_rows(rt, step_filter))
    source = "gpu"
    if g_rows.size:
        kern_comm = g_rows[rt.is_comm[g_rows]]
        compute = g_rows[~rt.is_comm[g_rows] & (rt.kind[g_rows] == KIND_KERNEL)]
        cand = kern_comm
    else:
        source = "cpu"
        cand = _cpu_comm_rows(rt)
        compute = np.empty(0, dtype=np.int64)
    types = np.asarray([_comm_type(rt.comm_args.get(int(i), {}).get("Collective name", "")
                                   + " " + rt.names[rt.name_id[i]]) for i in cand], dtype=object)
    comp_iv = (s_all[compute], e_all[compute])
    for t in COMM_TYPES:
        rows = cand[types == t] if cand.size else cand
        if rows.size == 0:
            continue
        c_iv = (s_all[rows], e_all[rows])
        total = iv.total(*c_iv)
        d = {"count": int(rows.size), "time": total}
        if source == "gpu":
            d["exposed_time"] = total - iv.intersection_length(c_iv, comp_iv)
        comm[t] = d
    nsteps = int(rt.steps[0].size)
    return {"ops": by_op, "groups": by_group, "comm": comm, "comm_source": source,
            "num_steps": nsteps, "found": bool(fsdp_rows.size)}


def _rank_metrics(raw: dict) -> dict:
    n = raw["num_steps"]
    out: dict[str, Any] = {
        "fsdp_activity": raw["found"],
        "num_steps": metric(n, "count", "ProfilerStep#N spans in the trace"),
    }
    groups = {}
    for g, d in raw["groups"].items():
        groups[g] = {
            "count": metric(d["count"], "count", f"events of {GROUP_DEFS[g]}"),
            "cpu_time": metric(d["cpu_time"], "us", f"CPU time: union of {GROUP_DEFS[g]} events"),
            "cpu_time_per_step": metric(d["cpu_time"] / n if n else None, "us",
                                        "cpu_time / number of ProfilerSteps"),
        }
    out["groups"] = groups
    out["operations"] = {
        op: {"group": d["group"],
             "count": metric(d["count"], "count", f"events labelled {op} (any module)"),
             "cpu_time": metric(d["cpu_time"], "us", f"union of {op} events")}
        for op, d in raw["ops"].items()}
    where = ("NCCL/RCCL kernels" if raw["comm_source"] == "gpu"
             else "CPU collective ops (c10d::* / record_param_comms / gloo:*; no GPU in the trace)")
    comm = {}
    for t, d in raw["comm"].items():
        m = {
            "count": metric(d["count"], "count", f"{t} {where}"),
            "time": metric(d["time"], "us", f"union of {t} {where}"),
            "time_per_step": metric(d["time"] / n if n else None, "us", "time / number of ProfilerSteps"),
        }
        if "exposed_time" in d:
            m["exposed_time"] = metric(d["exposed_time"], "us",
                                       f"{t} kernel time not overlapped by any non-communication kernel "
                                       "(|comm \\ compute|)")
            m["exposed_pct"] = metric(100 * d["exposed_time"] / d["time"] if d["time"] > 0 else None,
                                      "%", "exposed_time / time * 100")
        comm[t] = m
    out["collectives"] = comm
    return out


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False, step_filter=None) -> dict:
    """FSDP all-gather / reduce-scatter / reshard / copy-in/out per rank (see module docstring).

    A trace with no FSDP label gives ``fsdp_activity: False`` per rank and the note
    "no FSDP activity found" (not an error); collective kernels are still reported.

    Example:
        >>> r = metric_cal("outputs/profile_traces")                       # doctest: +SKIP
        >>> r["ranks"]["rank0"]["collectives"]["all_gather"]["exposed_time"]  # doctest: +SKIP
    """
    if profile_mode not in ("auto", "gpu", "cpu"):
        raise ValueError(f"{TOOL}: profile_mode must be 'auto', 'gpu' or 'cpu', got {profile_mode!r}")
    try:
        wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed, step_filter)
    except TraceError as exc:
        return result(TOOL, errors={exc.file: exc.reason})
    out = {}
    notes = list(wl.notes) + [steps_note]
    any_found = False
    any_gpu = False
    for r, rt in ranks.items():
        raw = rank_fsdp(rt, "all")  # open_steps already applied the filter
        any_gpu |= raw["comm_source"] == "gpu"
        if profile_mode == "cpu":
            raw["comm"] = {k: {kk: vv for kk, vv in v.items() if kk != "exposed_time"}
                           for k, v in raw["comm"].items()}
        any_found |= raw["found"]
        out[rank_key(r)] = _rank_metrics(raw)
    summary: dict[str, Any] = {"fsdp_activity": any_found}
    if not any_found:
        notes.insert(0, "no FSDP activity found: no FSDP::*, fsdp::* or FullyShardedDataParallel.* "
                        "events in any rank (collective kernels, if any, are still listed)")
    for t in COMM_TYPES:
        vals = [m["collectives"][t] for m in out.values() if t in m["collectives"]]
        if vals:
            summary[f"{t}_time_max"] = metric(max(v["time"]["value"] for v in vals), "us",
                                              f"max over ranks of {t} time")
            ex = [v["exposed_time"]["value"] for v in vals if "exposed_time" in v]
            if ex:
                summary[f"{t}_exposed_time_max"] = metric(max(ex), "us",
                                                          f"max over ranks of {t} exposed_time")
    return result(TOOL, ranks=out, summary=summary, notes=notes, errors=errors)
