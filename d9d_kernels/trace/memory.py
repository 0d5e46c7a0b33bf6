"""Memory: peak reserved/allocated, fragmentation and efficiency, per rank.

Sources, used together when present (``profile_mode``: ``"auto"``/``"gpu"`` =
both, ``"snapshot"`` = snapshots only, ``"trace"``/``"cpu"`` = profiler
``[memory]`` events only):

1. CUDA caching-allocator snapshots (``torch.cuda.memory._snapshot()``
   pickles), as torchtitan writes them
   (``memory_snapshot/iteration_N/rank{R}_memory_snapshot.pickle``) or given
   directly (a ``.pickle`` file or a directory of them). Loaded with the
   restricted unpickler (:mod:`._unpickle`).

   * State at snapshot time, with ``torch/cuda/_memory_viz.py::segsum``'s
     definitions: ``reserved`` = sum of segment ``total_size``;
     ``allocated`` (memory_viz "total_allocated") = sum of ``requested_size``
     of ``active_allocated`` blocks; ``free_internal`` = sum of
     ``size - requested_size`` of those blocks (rounding by the allocator);
     ``free_external`` = sum of ``size`` of every other block (gaps between
     allocations inside reserved segments). reserved = allocated +
     free_internal + free_external.
   * A true peak when the snapshot carries ``device_traces``
     (``_record_memory_history``): the trace is a ring buffer that ends at
     the snapshot, so the state is walked *backwards* from the snapshot
     (as torch's MemoryViz.js does): ``segment_alloc``/``segment_map`` add
     to reserved, ``segment_free``/``segment_unmap`` remove; ``alloc`` adds
     to allocated, ``free_completed`` removes (``free_requested`` does not:
     the block stays owned until the stream is done with it). Allocated
     here is in block bytes, as ``torch.cuda.memory_allocated()`` counts.
     Without ``device_traces`` the peak is *not observable* and the
     snapshot-time values are reported instead, with a note saying so.

2. Profiler ``[memory]`` instant events (``profile_memory=True``): each
   carries the allocator's ``Total Allocated`` / ``Total Reserved`` after the
   event; their maximum is the peak inside the profiling window.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from ._result import metric, result
from ._unpickle import SnapshotError, load_snapshot

TOOL = "memory"

_RANK_RE = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)
_ITER_RE = re.compile(r"iteration[_-]?(\d+)", re.IGNORECASE)

_RESERVED_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
_ALLOC_DELTA = {"alloc": 1, "free_completed": -1}
_OWNED_STATES = ("active_allocated", "active_pending_free")
# profile_mode -> (read snapshots, read trace [memory] events). "cpu": the CPU
# allocator only reports through [memory] events; snapshots are CUDA-only.
_MODES = {"auto": (True, True), "gpu": (True, True), "cpu": (False, True),
          "snapshot": (True, False), "trace": (False, True)}

D_RESERVED = "bytes held by the caching allocator in cudaMalloc'd segments (sum of segment total_size)"
D_ALLOCATED = ("bytes requested by live tensors: sum of requested_size of active_allocated blocks "
               "(torch memory_viz segsum 'total_allocated')")
D_BLOCK_ALLOC = ("bytes in blocks owned by tensors incl. allocator rounding and blocks pending "
                 "stream-free (what torch.cuda.memory_allocated() counts)")
D_FREE_INT = ("internal free: sum of (block size - requested_size) over active_allocated blocks — "
              "memory lost to the allocator rounding the request (memory_viz segsum)")
D_FREE_EXT = ("external free: sum of sizes of non-active blocks inside reserved segments — gaps "
              "between allocations (memory_viz segsum)")
D_EXT_FRAG = "external fragmentation = free_external / reserved"
D_INT_FRAG = "internal fragmentation = free_internal / reserved"
D_PCT_INTERNAL = ("memory_viz '(X% internal)': free_internal / (free_internal + free_external) * 100; "
                  "None when nothing is free")
D_EFFICIENCY = "efficiency = allocated (requested bytes) / reserved; 1 = no waste"
D_LARGEST_FREE = ("largest-free-block fragmentation = 1 - (largest non-active block / free_external); "
                  "0 = all free memory is one block; not a memory_viz quantity")


# ----------------------------------------------------------------------------- snapshots


def _segments(snap: Any, source: str) -> list[dict]:
    if isinstance(snap, dict):
        segs = snap.get("segments")
    elif isinstance(snap, list):  # torch.cuda.memory_snapshot() returns the segment list
        segs = snap
    else:
        segs = None
    if not isinstance(segs, list):
        raise SnapshotError(source, "not a CUDA memory snapshot (no 'segments' list)")
    for i, s in enumerate(segs):
        if not isinstance(s, dict) or "total_size" not in s or not isinstance(s.get("blocks"), list):
            raise SnapshotError(source, f"segment {i} lacks 'total_size' or 'blocks'")
        for b in s["blocks"]:
            if not isinstance(b, dict) or "size" not in b or "state" not in b:
                raise SnapshotError(source, f"a block of segment {i} lacks 'size' or 'state'")
    return segs


def _device_traces(snap: Any) -> list:
    if isinstance(snap, dict) and isinstance(snap.get("device_traces"), list):
        return snap["device_traces"]
    return []


def _requested(b: dict) -> int:
    # memory_viz._block_extra: new format has requested_size; legacy keeps it in history
    if "requested_size" in b:
        return int(b["requested_size"])
    hist = b.get("history")
    if hist:
        return int(hist[0].get("real_size", b["size"]))
    return int(b["size"])


def segment_state(segments: list[dict]) -> dict[int, dict]:
    """Per-device snapshot-time accounting with memory_viz ``segsum`` definitions."""
    out: dict[int, dict] = {}
    for seg in segments:
        dev = int(seg.get("device", 0))
        d = out.setdefault(dev, dict(reserved=0, allocated=0, block_allocated=0, free_internal=0,
                                     free_external=0, largest_free_block=0, segments=0,
                                     active_blocks=0, pending_free_blocks=0, inactive_blocks=0))
        d["reserved"] += int(seg["total_size"])
        d["segments"] += 1
        for b in seg["blocks"]:
            size = int(b["size"])
            if b["state"] == "active_allocated":
                req = _requested(b)
                d["allocated"] += req
                d["free_internal"] += size - req
                d["active_blocks"] += 1
            else:
                d["free_external"] += size
                d["largest_free_block"] = max(d["largest_free_block"], size)
                if b["state"] == "active_pending_free":
                    d["pending_free_blocks"] += 1
                else:
                    d["inactive_blocks"] += 1
            if b["state"] in _OWNED_STATES:
                d["block_allocated"] += size
    return out


def replay_peaks(entries: list[dict], end_reserved: int, end_block_allocated: int) -> dict:
    """Walk a device trace backwards from the snapshot state; return peaks and counts.

    ``entries`` are in time order and end at the snapshot. Returns a dict with
    ``peak_reserved``, ``peak_allocated`` (block bytes), ``start_reserved``,
    ``start_allocated``, the index/time of each peak and per-action counts.
    """
    n = len(entries)
    dr = np.zeros(n, dtype=np.int64)
    da = np.zeros(n, dtype=np.int64)
    counts: dict[str, int] = {}
    times = np.full(n, np.nan)
    for i, e in enumerate(entries):
        act = e.get("action")
        counts[act] = counts.get(act, 0) + 1
        size = int(e.get("size", 0) or 0)
        if act in _RESERVED_DELTA:
            dr[i] = _RESERVED_DELTA[act] * size
        elif act in _ALLOC_DELTA:
            da[i] = _ALLOC_DELTA[act] * size
        t = e.get("time_us")
        if t is not None:
            times[i] = float(t)
    start_r = end_reserved - int(dr.sum())
    start_a = end_block_allocated - int(da.sum())
    # state after entry i, prefixed by the state before the first entry
    res = np.concatenate(([start_r], start_r + np.cumsum(dr)))
    alc = np.concatenate(([start_a], start_a + np.cumsum(da)))
    ir, ia = int(res.argmax()), int(alc.argmax())

    def _t(i: int):
        if i == 0 or np.isnan(times[i - 1]):
            return None
        return float(times[i - 1])

    return dict(peak_reserved=int(res[ir]), peak_allocated=int(alc[ia]),
                start_reserved=int(start_r), start_allocated=int(start_a),
                peak_reserved_time_us=_t(ir), peak_allocated_time_us=_t(ia),
                min_reserved=int(res.min()), min_allocated=int(alc.min()), counts=counts)


def analyze_snapshot(snap: Any, source: str = "<snapshot>") -> dict:
    """Metrics for one snapshot: ``{"devices": {"cuda:D": {...}}, "notes": [...]}``."""
    segs = _segments(snap, source)
    state = segment_state(segs)
    traces = _device_traces(snap)
    notes: list[str] = []
    devices: dict[str, dict] = {}
    all_devs = set(state) | {i for i, t in enumerate(traces) if t}
    for dev in sorted(all_devs):
        s = state.get(dev) or dict(reserved=0, allocated=0, block_allocated=0, free_internal=0,
                                   free_external=0, largest_free_block=0, segments=0,
                                   active_blocks=0, pending_free_blocks=0, inactive_blocks=0)
        reserved = s["reserved"]
        free = s["free_internal"] + s["free_external"]
        m: dict[str, Any] = {
            "reserved_at_snapshot": metric(reserved, "bytes", D_RESERVED + ", at snapshot time"),
            "allocated_at_snapshot": metric(s["allocated"], "bytes", D_ALLOCATED + ", at snapshot time"),
            "block_allocated_at_snapshot": metric(s["block_allocated"], "bytes",
                                                  D_BLOCK_ALLOC + ", at snapshot time"),
            "free_internal": metric(s["free_internal"], "bytes", D_FREE_INT),
            "free_external": metric(s["free_external"], "bytes", D_FREE_EXT),
            "external_fragmentation": metric(s["free_external"] / reserved if reserved else None,
                                             "ratio", D_EXT_FRAG),
            "internal_fragmentation": metric(s["free_internal"] / reserved if reserved else None,
                                             "ratio", D_INT_FRAG),
            "free_internal_pct": metric(100.0 * s["free_internal"] / free if free else None, "%",
                                        D_PCT_INTERNAL),
            "efficiency": metric(s["allocated"] / reserved if reserved else None, "ratio", D_EFFICIENCY),
            "largest_free_block_fragmentation": metric(
                1.0 - s["largest_free_block"] / s["free_external"] if s["free_external"] else None,
                "ratio", D_LARGEST_FREE),
            "segments": metric(s["segments"], "count", "cudaMalloc'd segments held at snapshot time"),
            "active_blocks": metric(s["active_blocks"], "count",
                                    "live allocations (active_allocated blocks) at snapshot time"),
            "pending_free_blocks": metric(s["pending_free_blocks"], "count",
                                          "blocks freed by the program but awaiting stream completion"),
            "inactive_blocks": metric(s["inactive_blocks"], "count", "free cached blocks at snapshot time"),
        }
        entries = traces[dev] if dev < len(traces) and traces[dev] else []
        if entries:
            r = replay_peaks(entries, reserved, s["block_allocated"])
            src = ("device_traces replay: backward walk of alloc/free_completed/segment_alloc/"
                   "segment_free/segment_map/segment_unmap from the snapshot state over "
                   f"{len(entries)} events (peak within the recorded window)")
            m["peak_reserved"] = metric(r["peak_reserved"], "bytes", "peak of " + D_RESERVED + "; " + src)
            m["peak_allocated"] = metric(r["peak_allocated"], "bytes",
                                         "peak of " + D_BLOCK_ALLOC + "; " + src)
            m["peak_reserved_time_us"] = metric(r["peak_reserved_time_us"], "us",
                                                "time_us of the event reaching peak_reserved (None: "
                                                "before the first recorded event or no timestamps)")
            m["peak_allocated_time_us"] = metric(r["peak_allocated_time_us"], "us",
                                                 "time_us of the event reaching peak_allocated")
            m["peak_source"] = "device_traces"
            c = r["counts"]
            for act, desc in (("alloc", "allocations"), ("free_completed", "frees completed"),
                              ("free_requested", "frees requested"), ("segment_alloc", "cudaMalloc calls"),
                              ("segment_free", "cudaFree calls (incl. empty_cache)"),
                              ("oom", "out-of-memory events")):
                m[f"{act}_count"] = metric(c.get(act, 0), "count", f"{desc} in the recorded device trace")
            if r["min_reserved"] < 0 or r["min_allocated"] < 0:
                notes.append(f"{source}: cuda:{dev} device trace inconsistent with the segments "
                             "(replay goes below zero); peaks may be wrong")
        else:
            m["peak_reserved"] = metric(reserved, "bytes",
                                        "NOT a true peak: no device_traces in the snapshot, so this is "
                                        "reserved at snapshot time (" + D_RESERVED + ")")
            m["peak_allocated"] = metric(s["block_allocated"], "bytes",
                                         "NOT a true peak: no device_traces in the snapshot, so this is "
                                         "block-allocated at snapshot time (" + D_BLOCK_ALLOC + ")")
            m["peak_source"] = "snapshot_state"
            m["alloc_count"] = metric(None, "count", "needs device_traces (_record_memory_history)")
        devices[f"cuda:{dev}"] = m
    if not traces or not any(traces):
        notes.append(f"{source}: no device_traces (snapshot taken without _record_memory_history): "
                     "peaks are snapshot-time values, not true peaks")
    return {"devices": devices, "notes": notes}


def find_snapshots(path: str | os.PathLike) -> list[tuple[int | None, int | None, Path]]:
    """``[(rank, iteration, path)]`` of snapshot pickles under ``path`` (or ``path`` itself)."""
    p = Path(path)
    if p.is_file():
        files = [p] if p.suffix in (".pickle", ".pkl") else []
    elif p.is_dir():
        files = sorted(f for ext in ("*.pickle", "*.pkl") for f in p.rglob(ext))
    else:
        return []
    out = []
    for f in files:
        rm = _RANK_RE.search(f.name)
        im = _ITER_RE.search(str(f.parent))
        out.append((int(rm.group(1)) if rm else None, int(im.group(1)) if im else None, f))
    return out


# ----------------------------------------------------------------------------- trace events


def memory_events_from_trace(doc: dict) -> dict[str, dict]:
    """Peaks of ``[memory]`` instant events of one Kineto trace, per device."""
    if isinstance(doc, list):  # bare Chrome trace array
        doc = {"traceEvents": doc}
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        return {}
    per: dict[str, dict] = {}
    for e in events:
        if not isinstance(e, dict) or e.get("name") != "[memory]":
            continue
        a = e.get("args") or {}
        dtype = a.get("Device Type")
        dev = a.get("Device Id", 0)
        key = "cpu" if dtype == 0 else f"cuda:{dev}" if dtype == 1 else f"device{dtype}:{dev}"
        d = per.setdefault(key, dict(peak_allocated=None, peak_reserved=None, events=0, allocs=0, frees=0))
        d["events"] += 1
        nbytes = a.get("Bytes")
        if isinstance(nbytes, (int, float)):
            if nbytes > 0:
                d["allocs"] += 1
            elif nbytes < 0:
                d["frees"] += 1
        for src, dst in (("Total Allocated", "peak_allocated"), ("Total Reserved", "peak_reserved")):
            v = a.get(src)
            if isinstance(v, (int, float)) and (d[dst] is None or v > d[dst]):
                d[dst] = v
    out = {}
    for key, d in per.items():
        if key == "cpu":
            d["peak_reserved"] = None  # the CPU allocator has no cache; Kineto writes 0
        out[key] = {
            "peak_allocated": metric(d["peak_allocated"], "bytes",
                                     "max 'Total Allocated' over profiler [memory] events (allocator "
                                     "allocated bytes after each alloc/free) inside the profiling window"),
            "peak_reserved": metric(d["peak_reserved"], "bytes",
                                    "max 'Total Reserved' over profiler [memory] events inside the "
                                    "profiling window (None on CPU: no caching allocator)"),
            "alloc_count": metric(d["allocs"], "count", "[memory] events with Bytes > 0"),
            "free_count": metric(d["frees"], "count", "[memory] events with Bytes < 0"),
        }
    return out


def _trace_docs(trace_dir, errors: dict, notes: list, allow_mixed: bool = False):
    """``[(rank_key, doc)]`` of the rank traces that hold ``[memory]`` events.

    ``RankTrace`` keeps complete events only, so the raw JSON is read again; a
    substring test on the decompressed text skips the JSON parse of traces
    recorded without ``profile_memory`` (the common case).
    """
    from ._load import TraceError, find_workload

    try:
        wl = find_workload(trace_dir, allow_mixed=allow_mixed)
    except TraceError as exc:
        notes.append(f"no profiler traces read for [memory] events: {exc}")
        return []
    out = []
    for rank, path in wl.traces.items():
        try:
            with open(path, "rb") as fh:
                data = fh.read()
            if str(path).endswith(".gz"):
                data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            errors[str(path)] = f"cannot read (truncated or corrupt gzip?): {exc}"
            continue
        if b'"[memory]"' not in data:
            continue
        try:
            doc = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            errors[str(path)] = f"corrupt JSON: {exc}"
            continue
        out.append((f"rank{rank}", doc))
    return out


# ----------------------------------------------------------------------------- entry point


def metric_cal(trace_dir, workload_card_path=None, profile_mode: str = "auto", steps="hta",
               allow_mixed=False) -> dict:
    """Memory metrics per rank from snapshots and/or profiler ``[memory]`` events.

    Args:
        trace_dir: workload dir, trace dir, snapshot ``.pickle`` or a dir of snapshots.
        workload_card_path: unused (accepted for the common tool signature).
        steps, allow_mixed: accepted for the common tool signature; snapshots and
            ``[memory]`` events are not step-filtered (the notes say so).
        profile_mode: ``"auto"``/``"gpu"`` (both sources), ``"snapshot"`` (snapshots
            only), ``"trace"``/``"cpu"`` (profiler ``[memory]`` events only).

    Returns:
        The shared result dict (see :mod:`._result`); ``ranks["rankR"]`` holds
        ``snapshot`` (per device, latest iteration) and ``trace_events`` (per device).

    Example:
        >>> r = metric_cal("/work/shared/data/memory/segments_only.pickle")  # doctest: +SKIP
        >>> r["ranks"]["rank0"]["snapshot"]["devices"]["cuda:1"]["efficiency"]["value"]  # doctest: +SKIP
    """
    if profile_mode not in _MODES:
        raise ValueError(f"memory: profile_mode must be one of {sorted(_MODES)}, got {profile_mode!r}")
    use_snap, use_trace = _MODES[profile_mode]
    ranks: dict[str, dict] = {}
    notes: list[str] = []
    errors: dict[str, str] = {}
    paths = [Path(p) for p in trace_dir] if isinstance(trace_dir, (list, tuple)) else [Path(trace_dir)]
    for p in paths:
        if not p.exists():
            errors[str(p)] = "no such file or directory"
    paths = [p for p in paths if p.exists()]
    if not paths:
        return result(TOOL, notes=notes, errors=errors)
    pickles_only = all(p.is_file() and p.suffix in (".pickle", ".pkl") for p in paths)
    trace_inputs = [p for p in paths if not (p.is_file() and p.suffix in (".pickle", ".pkl"))]

    if use_snap:
        found = [x for p in paths for x in find_snapshots(p)]
        # rank from the file name, else its position among unnamed snapshots
        unnamed = 0
        latest: dict[int, tuple] = {}
        per_rank_all: dict[int, list] = {}
        for rank, it, f in found:
            if rank is None:
                rank, unnamed = unnamed, unnamed + 1
            per_rank_all.setdefault(rank, []).append((it, f))
        for rank, items in sorted(per_rank_all.items()):
            items.sort(key=lambda x: (-1 if x[0] is None else x[0], str(x[1])))
            by_iter = {}
            for it, f in items:
                try:
                    a = analyze_snapshot(load_snapshot(f), source=str(f))
                except SnapshotError as exc:
                    errors[str(f)] = exc.reason
                    continue
                except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
                    errors[str(f)] = f"malformed memory snapshot ({type(exc).__name__}: {exc})"
                    continue
                a["file"] = str(f)
                a["iteration"] = it
                notes.extend(a.pop("notes"))
                by_iter[it] = a
                latest[rank] = (it, a)
            if rank in latest:
                r = ranks.setdefault(f"rank{rank}", {})
                r["snapshot"] = latest[rank][1]
                if len(by_iter) > 1:
                    r["snapshot_iterations"] = {
                        str(it): {dev: {k: m[k] for k in ("peak_reserved", "peak_allocated")}
                                  for dev, m in a["devices"].items()}
                        for it, a in by_iter.items()}
        if not found:
            notes.append(f"no memory snapshot (*.pickle) under {trace_dir}")

    if use_trace and not pickles_only:
        any_events = False
        target = trace_inputs[0] if len(trace_inputs) == 1 else trace_inputs
        for rank_key, doc in _trace_docs(target, errors, notes, allow_mixed):
            ev = memory_events_from_trace(doc)
            if ev:
                any_events = True
                ranks.setdefault(rank_key, {})["trace_events"] = ev
        if not any_events:
            notes.append("no profiler [memory] events in the traces (profile_memory=False)")

    if not pickles_only:
        notes.append(f"step filter: not applied (steps={steps!r}); snapshots and [memory] events "
                     "cover the whole profiled window")
    summary: dict[str, Any] = {}
    peaks: dict[tuple[str, str], list] = {}
    for r in ranks.values():
        for src in (r.get("snapshot", {}).get("devices", {}), r.get("trace_events", {})):
            for dev, m in src.items():
                kind = "cpu" if dev == "cpu" else "gpu"
                for k in ("peak_reserved", "peak_allocated"):
                    v = m[k]["value"]
                    if v is not None:
                        peaks.setdefault((kind, k), []).append(v)
    for (kind, k), vals in sorted(peaks.items()):
        name = f"max_{k}" if kind == "gpu" else f"max_cpu_{k}"
        summary[name] = metric(max(vals), "bytes",
                               f"max over ranks and {'GPU devices' if kind == 'gpu' else 'CPU'} of {k} "
                               "(snapshot and/or [memory] events; see each rank's definition)")
    if not ranks and not errors:
        notes.append(f"no memory data found under {trace_dir} (no snapshot pickles, no [memory] events)")
    return result(TOOL, ranks=ranks, summary=summary, notes=notes, errors=errors)
