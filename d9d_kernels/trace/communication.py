"""Collective communication: time, count, volume, algorithm and bus bandwidth.

Per rank, per collective type and process group. Sources:

* GPU traces: NCCL/RCCL kernels (``^(nccl|rccl).*kernel``). The type comes from the
  kernel's ``Collective name`` arg, else from its name (``ncclDevKernel_AllGather_...``).
* CPU traces (gloo, no GPU kernels): the backend's own ranges (``gloo:all_reduce``, run on
  the gloo worker threads and spanning the transfer), else ``record_param_comms`` CPU ops.
  For backend ranges without collective args the volume comes from ``Input Dims`` x
  ``Input type`` (traces recorded with ``record_shapes=True``; all-gather: input x n).

Time is the event duration (for a kernel it includes waiting for the slowest peer).
Volume (bytes) = max(In, Out msg nelems) x dtype size — the full buffer nccl-tests
calls "size" (the whole gathered output for all-gather, the whole input for
reduce-scatter). algbw = volume / time; busbw = algbw x factor(n) with the nccl-tests
factors: all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n;
broadcast, reduce, send/recv 1; n = ``Group size`` (else the process group's rank
list, else the world size). Aggregates use total volume / total time. Traces without
collective args (older PyTorch) give count and time only; the result says so.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import numpy as np

from d9d_kernels.trace._common import open_steps, rank_key, resolve_mode
from d9d_kernels.trace._load import COMM_ANNOTATION_RE, KIND_KERNEL, RankTrace
from d9d_kernels.trace._result import metric, result

DTYPE_BYTES = {
    "float": 4, "float32": 4, "double": 8, "float64": 8, "half": 2, "float16": 2,
    "bfloat16": 2, "int": 4, "int32": 4, "long": 8, "int64": 8, "short": 2, "int16": 2,
    "char": 1, "int8": 1, "byte": 1, "uint8": 1, "bool": 1, "complexfloat": 8,
    "complexdouble": 16, "complexhalf": 4, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1, "uint16": 2, "uint32": 4, "uint64": 8,
    # C++ type names used in "Input type" (record_shapes)
    "c10::bfloat16": 2, "c10::half": 2, "long int": 8, "short int": 2, "signed char": 1,
    "unsigned char": 1, "c10::complex<float>": 8, "c10::complex<double>": 16,
}
_KERNEL_TYPE_RE = re.compile(r"(?:nccl|rccl)\w*?Kernel_([A-Za-z]+)", re.I)


def normalize_collective(name: str) -> str:
    s = str(name).lower().replace("_", "").replace(" ", "")
    for key in ("allreduce", "allgather", "reducescatter", "alltoall", "broadcast", "barrier",
                "sendrecv", "gather", "scatter"):
        if key in s:
            return key
    if "reduce" in s:
        return "reduce"
    if s in ("send", "recv") or s.startswith(("send", "recv")):
        return "sendrecv"
    return s or "unknown"


def busbw_factor(kind: str, n: int | None) -> float | None:
    if not n or n < 1:
        return None
    if kind == "allreduce":
        return 2.0 * (n - 1) / n
    if kind in ("allgather", "reducescatter", "alltoall", "gather", "scatter"):
        return (n - 1) / n
    if kind in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    return None


def _group_size(a: dict, world: int | None) -> int | None:
    if "Group size" in a:
        try:
            return int(a["Group size"])
        except (TypeError, ValueError):
            pass
    ranks = a.get("Process Group Ranks")
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except ValueError:
            ranks = None
    if isinstance(ranks, list) and ranks:
        return len(ranks)
    return world


def _volume(a: dict, kind: str = "", n: int | None = None) -> int | None:
    if "dtype" not in a and a.get("Input Dims") and a.get("Input type"):
        size = DTYPE_BYTES.get(str(a["Input type"][0]).lower())
        dims = a["Input Dims"][0]
        while dims and isinstance(dims[0], list):  # TensorList: first tensor
            dims = dims[0]
        if size is None or not isinstance(dims, list):
            return None
        vol = int(np.prod(dims, dtype=np.int64)) * size
        return vol * n if (kind == "allgather" and n) else vol
    size = DTYPE_BYTES.get(str(a.get("dtype", "")).lower())
    if size is None:
        return None
    n = [a.get(k) for k in ("In msg nelems", "Out msg nelems")]
    n = [int(v) for v in n if isinstance(v, (int, float))]
    return max(n) * size if n else None


def collective_events(rt: RankTrace, mode: str):
    """Rows of the collectives of one rank, in time order, with their parsed args.

    Returns a list of dicts: row, kind (normalized type), pg, n, bytes (or None), ts, dur.
    """
    if mode == "gpu":
        rows = np.flatnonzero(rt.is_comm & (rt.kind == KIND_KERNEL))
    else:
        cpu = rt.is_comm & (rt.kind != KIND_KERNEL)
        ann = cpu & rt.name_mask(lambda n: bool(COMM_ANNOTATION_RE.match(n)))
        rows = np.flatnonzero(ann if ann.any() else cpu)
    rows = rows[np.argsort(rt.ts[rows], kind="stable")]
    world = rt.world_size
    pgs = (rt.distributed_info or {}).get("pg_config") or []
    sole_pg = None
    if len(pgs) == 1 and isinstance(pgs[0], dict):
        sole_pg = f"{pgs[0].get('pg_name')}:{pgs[0].get('pg_desc')}" if pgs[0].get("pg_desc") \
            else str(pgs[0].get("pg_name"))
    out = []
    for i in rows:
        a = rt.comm_args.get(int(i), {})
        name = rt.names[rt.name_id[i]]
        if "Collective name" in a:
            kind = normalize_collective(a["Collective name"])
        elif COMM_ANNOTATION_RE.match(name):
            kind = normalize_collective(name.split(":", 1)[1])
        else:
            m = _KERNEL_TYPE_RE.search(name)
            kind = normalize_collective(m.group(1)) if m else "unknown"
        pg = a.get("Process Group Name")
        desc = a.get("Process Group Description")
        if pg is None:
            pg = sole_pg or "unknown"
        else:
            pg = f"{pg}:{desc}" if desc else str(pg)
        n = _group_size(a, world)
        out.append({"row": int(i), "kind": kind, "pg": pg, "n": n,
                    "bytes": _volume(a, kind, n), "ts": float(rt.ts[i]), "dur": float(rt.dur[i])})
    return out


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False) -> dict:
    """Per-rank, per-type, per-process-group communication statistics."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed)
    out = {}
    notes = list(wl.notes) + [steps_note]
    no_args = set()
    totals = {}
    for r, rt in ranks.items():
        mode = resolve_mode(rt, profile_mode)
        evs = collective_events(rt, mode)
        groups: dict = defaultdict(list)
        for ev in evs:
            groups[(ev["kind"], ev["pg"])].append(ev)
        table: dict = defaultdict(dict)
        rank_time = 0.0
        for (kind, pg), lst in sorted(groups.items()):
            t = float(sum(ev["dur"] for ev in lst))
            rank_time += t
            vols = [ev["bytes"] for ev in lst]
            have = all(v is not None for v in vols)
            entry = {
                "count": metric(len(lst), "count", f"{kind} operations in process group {pg}"),
                "time": metric(t, "us", "summed duration of the operations"
                               + (" (GPU kernels: includes waiting for peers)" if mode == "gpu" else "")),
                "mean_time": metric(t / len(lst), "us", "time / count"),
            }
            n = lst[0]["n"]
            if have and kind != "barrier":
                vol = float(sum(vols))
                algbw = vol / (t * 1e3) if t > 0 else None
                f = busbw_factor(kind, n)
                entry["volume"] = metric(vol, "bytes", "summed per-op size: max(In, Out msg nelems) x dtype size, "
                                       "or Input Dims x Input type for backend ranges")
                entry["algbw"] = metric(algbw, "GB/s", "volume / time (1 GB = 1e9 bytes)")
                entry["busbw"] = metric(algbw * f if (algbw is not None and f is not None) else None,
                                        "GB/s", f"algbw x nccl-tests factor for {kind} with n={n}")
                entry["group_size"] = metric(n, "count", "ranks in the process group")
            else:
                no_args.add(rank_key(r))
                entry["volume"] = metric(None, "bytes", "not available: the trace has no collective args")
            table[kind][pg] = entry
        totals[r] = rank_time
        out[rank_key(r)] = {
            "mode": mode,
            "source": "NCCL/RCCL GPU kernels" if mode == "gpu" else "CPU collective ranges",
            "total_time": metric(rank_time, "us", "summed duration of all collectives"),
            "collectives": dict(table),
        }
    if no_args:
        notes.append(f"{', '.join(sorted(no_args))}: collectives without 'In msg nelems'/'dtype' args "
                     "(older PyTorch trace): count and time only, no volume or bandwidth")
    summary = {}
    if totals:
        summary["max_total_time"] = metric(max(totals.values()), "us",
                                           "largest per-rank summed collective time")
    return result("communication", out, summary, notes, errors)
