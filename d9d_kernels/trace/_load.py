"""Workload discovery and Kineto trace parsing (shared by every trace tool).

Stable interface (other tools and the CLI import these names):

``find_workload(path) -> Workload``
    ``path`` is a torchtitan output dir (``profile_traces/iteration_N/rank{R}_trace.json[.gz]``,
    ``memory_snapshot/iteration_N/rank{R}_memory_snapshot.pickle``, ``workload_card.yaml``),
    any directory holding ``.json`` / ``.json.gz`` traces (searched recursively), one trace
    file, or a list of trace files. The latest ``iteration_N`` is used when several exist.
    Rank of a file: ``distributedInfo.rank`` read from the file's head, else a
    ``rank<R>`` / ``rank-<R>`` / ``rank_<R>`` in the file name, else its position in sorted order.

``load_rank(path, rank=None) -> RankTrace``
    Parses one trace into compact columnar numpy arrays (one row per complete ``"ph": "X"``
    event). Raises :class:`TraceError` naming the file for unreadable / truncated / corrupt
    JSON, a missing ``traceEvents`` list, events missing ``ts``/``dur``, or an empty trace.

``load_ranks(workload, parallel=True, progress=None, errors=None) -> dict[int, RankTrace]``
    Parses every rank, in a process pool when ``parallel`` (at most ``os.cpu_count()``
    workers, and no more than fit in 80% of MemAvailable at ~4x (msgspec) / ~6x (stdlib
    json) the largest file's uncompressed size each; ranks come back as compact columns,
    so only one raw JSON document per worker is ever alive). With ``errors`` (a dict) a bad rank is recorded as ``errors[file] = reason`` and
    skipped; without it the first :class:`TraceError` is raised. ``progress``: tqdm bar
    (default: when stderr is a terminal).

``load_card(path) -> dict | None``  reads ``workload_card.yaml`` (see :func:`load_card`).

Event kinds (``RankTrace.kind``, int8): see the ``KIND_*`` constants. Timestamps are
microseconds as float64, exactly as in the file (no rounding).
"""

from __future__ import annotations

import gc
import gzip
import json
import multiprocessing as mp
import operator
import os
import re
import sys
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

__all__ = [
    "TraceError", "Workload", "RankTrace", "find_workload", "load_rank", "load_ranks",
    "load_card", "KIND_NAMES",
    "KIND_OTHER", "KIND_KERNEL", "KIND_MEMCPY", "KIND_MEMSET", "KIND_CPU_OP",
    "KIND_USER_ANNOTATION", "KIND_GPU_USER_ANNOTATION", "KIND_PROFILER_STEP",
    "KIND_RUNTIME", "COLLECTIVE_ARG_KEYS", "COMM_ANNOTATION_RE", "COMM_KERNEL_RE",
]


class TraceError(Exception):
    """A trace or workload file that cannot be used; ``file`` and ``reason`` for messages."""

    def __init__(self, file, reason: str):
        self.file = str(file)
        self.reason = reason
        super().__init__(f"{self.file}: {reason}")

    def __reduce__(self):  # picklable across the process pool
        return (TraceError, (self.file, self.reason))


class MixedJobsError(TraceError):
    """A directory holds traces of more than one job (see :func:`find_workload`)."""


# ----------------------------------------------------------------------------- kinds
KIND_OTHER = 0
KIND_KERNEL = 1              # cat "kernel" (GPU, has args.stream)
KIND_MEMCPY = 2              # cat "gpu_memcpy"
KIND_MEMSET = 3              # cat "gpu_memset"
KIND_CPU_OP = 4              # cat "cpu_op" / "operator"
KIND_USER_ANNOTATION = 5     # cat "user_annotation" (record_function ranges)
KIND_GPU_USER_ANNOTATION = 6  # cat "gpu_user_annotation"
KIND_PROFILER_STEP = 7       # "ProfilerStep#N" on the CPU side
KIND_RUNTIME = 8             # cat "cuda_runtime" / "cuda_driver" / "hip_runtime"
KIND_NAMES = {
    KIND_OTHER: "other", KIND_KERNEL: "kernel", KIND_MEMCPY: "memcpy", KIND_MEMSET: "memset",
    KIND_CPU_OP: "cpu_op", KIND_USER_ANNOTATION: "user_annotation",
    KIND_GPU_USER_ANNOTATION: "gpu_user_annotation", KIND_PROFILER_STEP: "profiler_step",
    KIND_RUNTIME: "runtime",
}
_CAT_KIND = {
    "kernel": KIND_KERNEL, "gpu_memcpy": KIND_MEMCPY, "gpu_memset": KIND_MEMSET,
    "cpu_op": KIND_CPU_OP, "operator": KIND_CPU_OP, "user_annotation": KIND_USER_ANNOTATION,
    "gpu_user_annotation": KIND_GPU_USER_ANNOTATION, "cuda_runtime": KIND_RUNTIME,
    "cuda_driver": KIND_RUNTIME, "hip_runtime": KIND_RUNTIME, "hip_driver": KIND_RUNTIME,
}
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
# GPU communication kernels: NCCL/RCCL kernels (ncclKernel_*, ncclDevKernel_*, rccl*).
COMM_KERNEL_RE = re.compile(r"^(nccl|rccl).*kernel", re.IGNORECASE)
# args copied for collectives (record_param_comms CPU ops and NCCL kernels with args)
COLLECTIVE_ARG_KEYS = (
    "Collective name", "In msg nelems", "Out msg nelems", "Group size", "dtype",
    "In split size", "Out split size", "Process Group Name", "Process Group Description",
    "Process Group Ranks", "Global rank start", "Global rank stride", "Seq",
    "Input Dims", "Input type",
)
# CPU-side collective ranges recorded by the process-group backends: "gloo:all_reduce",
# "nccl:all_reduce", ... (gloo: on its worker threads, spanning the actual transfer)
COMM_ANNOTATION_RE = re.compile(r"^(gloo|nccl|rccl|mpi|ucc|xccl):\w+")


# ----------------------------------------------------------------------------- data
@dataclass
class RankTrace:
    """One rank's trace as columns; row ``i`` is the i-th complete event in file order.

    Columns (numpy, length ``n``): ``name_id``/``cat_id`` (int32 into ``names``/``cats``),
    ``kind`` (int8, ``KIND_*``), ``ts``/``dur`` (float64 µs), ``pid``/``tid`` (int64; string
    ids are mapped to negative ints), ``stream`` (int64, ``args.stream``, -1 if absent),
    ``device`` (int64, ``args.device`` else -1), ``correlation`` (int64, -1 if absent),
    ``external_id`` (int64, ``args["External id"]``, -1 if absent), ``is_comm`` (bool:
    NCCL/RCCL kernel, a ``record_param_comms`` CPU op, or a backend range such as
    ``gloo:all_reduce`` / ``nccl:all_reduce``, see :data:`COMM_ANNOTATION_RE`).
    ``nbytes`` / ``mem_bw`` (float64, NaN if absent): ``args.bytes`` and
    ``args["memory bandwidth (GB/s)"]`` (Kineto writes them on memcpy and memset events).
    ``comm_args``: row -> dict of :data:`COLLECTIVE_ARG_KEYS` present on that event.
    ``steps``: ``(step_num, start_us, end_us)`` arrays of the CPU-side ProfilerStep#N spans.
    """

    path: str
    rank: int
    names: list
    cats: list
    name_id: np.ndarray
    cat_id: np.ndarray
    kind: np.ndarray
    ts: np.ndarray
    dur: np.ndarray
    pid: np.ndarray
    tid: np.ndarray
    stream: np.ndarray
    device: np.ndarray
    correlation: np.ndarray
    external_id: np.ndarray
    is_comm: np.ndarray
    nbytes: np.ndarray
    mem_bw: np.ndarray
    comm_args: dict = field(default_factory=dict)
    distributed_info: dict | None = None
    device_properties: list | None = None
    metadata: dict = field(default_factory=dict)

    # -- convenience ---------------------------------------------------------
    def __len__(self) -> int:
        return int(self.ts.size)

    @property
    def end(self) -> np.ndarray:
        return self.ts + self.dur

    @property
    def world_size(self) -> int | None:
        di = self.distributed_info or {}
        return di.get("world_size")

    def name_array(self, rows=None) -> np.ndarray:
        """Names as an object array (all rows, or the given rows/mask)."""
        names = np.asarray(self.names, dtype=object)
        ids = self.name_id if rows is None else self.name_id[rows]
        return names[ids]

    def name_mask(self, predicate) -> np.ndarray:
        """Row mask of events whose name satisfies ``predicate(str)`` (evaluated once per name)."""
        table = np.fromiter((bool(predicate(n)) for n in self.names), dtype=bool,
                            count=len(self.names))
        return table[self.name_id] if table.size else np.zeros(len(self), dtype=bool)

    @property
    def gpu_mask(self) -> np.ndarray:
        """GPU work on a stream: kernels, memcpy, memset with ``args.stream >= 0``."""
        return ((self.kind == KIND_KERNEL) | (self.kind == KIND_MEMCPY)
                | (self.kind == KIND_MEMSET)) & (self.stream >= 0)

    @property
    def steps(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        rows = np.flatnonzero(self.kind == KIND_PROFILER_STEP)
        nums = np.array([int(_STEP_RE.match(self.names[i]).group(1))
                         for i in self.name_id[rows]], dtype=np.int64)
        order = np.argsort(self.ts[rows], kind="stable")
        rows = rows[order]
        return nums[order], self.ts[rows], self.ts[rows] + self.dur[rows]

    def hta_step_filter(self, include_last_profiler_step: bool = False) -> np.ndarray:
        """Row mask of GPU work kept by HolisticTraceAnalysis's default step filter.

        HTA (``Trace._filter_irrelevant_gpu_kernels``) keeps a GPU event (stream >= 0 and
        correlation >= 0) only if a non-GPU event with the same correlation id starts
        before the start of the last event whose name contains "ProfilerStep" (or, with
        ``include_last_profiler_step``, before the end of the latest one). With fewer than
        two distinct ProfilerStep names nothing is filtered (every GPU event is kept).
        """
        gpu = self.gpu_mask
        step_name = self.name_mask(lambda n: "ProfilerStep" in n)
        if len({self.name_id[i] for i in np.flatnonzero(step_name)}) < 2:
            return gpu
        gpu_k = gpu & (self.correlation >= 0)
        cpu = ~gpu_k
        steps = cpu & step_name
        limit_ts = self.ts[steps].max()
        if include_last_profiler_step:
            limit = (self.ts[steps] + self.dur[steps]).max()
            cpu_kept = cpu & (self.ts <= limit)
        else:
            cpu_kept = cpu & (self.ts < limit_ts)
        corr = np.unique(self.correlation[cpu_kept])
        return gpu_k & np.isin(self.correlation, corr)


@dataclass
class Workload:
    """What :func:`find_workload` found. ``traces``/``memory_snapshots``: rank -> path."""

    root: str
    traces: dict = field(default_factory=dict)
    memory_snapshots: dict = field(default_factory=dict)
    card: dict | None = None
    card_path: str | None = None
    iteration: int | None = None
    notes: list = field(default_factory=list)


# ----------------------------------------------------------------------------- reading
def _open_text(path: Path):
    if str(path).endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def _read_bytes(path: Path) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        if str(path).endswith(".gz"):
            # one-shot inflate: ~25% faster than gzip.open().read()
            d = zlib.decompressobj(wbits=31)
            data = d.decompress(data)
            if not d.eof:
                raise TraceError(path, "truncated gzip stream")
    except FileNotFoundError:
        raise TraceError(path, "file not found") from None
    except (OSError, EOFError, zlib.error) as exc:
        raise TraceError(path, f"cannot read (truncated or corrupt gzip?): {exc}") from None
    if not data or data.isspace():  # isspace stops at the first other byte; strip() copies the file
        raise TraceError(path, "empty file")
    return data


def _read_json(path: Path, data: bytes | None = None) -> dict:
    """Generic (stdlib) decode of a whole trace document."""
    if data is None:
        data = _read_bytes(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceError(path, f"not UTF-8 text: {exc}") from None
    gc_was = gc.isenabled()
    gc.disable()  # millions of small containers: the cyclic GC only slows decoding down
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        # Kineto writes a trailing comma when a trace is cut off; say truncated plainly
        what = "truncated" if exc.pos >= len(text.rstrip()) - 1 else "corrupt"
        raise TraceError(path, f"{what} JSON: {exc.msg} at line {exc.lineno} col {exc.colno}") from None
    finally:
        if gc_was:
            gc.enable()
    del text
    if isinstance(doc, list):  # bare Chrome trace array
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceError(path, "no 'traceEvents' list (not a Kineto/Chrome trace)")
    return doc


def _as_int(v, strings: dict) -> int:
    if isinstance(v, int):
        return v
    try:
        return int(v)
    except (TypeError, ValueError):
        return strings.setdefault(v, -2 - len(strings))


# ---- fast path: msgspec typed decoding (only the fields used are materialised) --------
try:  # optional dependency: 3-4x faster decode and far fewer objects than json.loads
    import msgspec as _msgspec
except ImportError:  # pragma: no cover - exercised by forcing _FAST = None in tests
    _msgspec = None


_NAN = float("nan")


def _make_fast_decoder():
    if _msgspec is None:
        return None
    from typing import Any, Optional, Union

    F = _msgspec.field
    fields = [("stream", int, F(default=-1)), ("device", int, F(default=-1)),
              ("correlation", int, F(default=-1)), ("external_id", int, F(default=-1, name="External id")),
              ("nbytes", float, F(default=_NAN, name="bytes")),
              ("mem_bw", float, F(default=_NAN, name="memory bandwidth (GB/s)"))]
    coll = [(f"c{i}", Any, F(default=None, name=k)) for i, k in enumerate(COLLECTIVE_ARG_KEYS)]
    Args = _msgspec.defstruct("Args", fields + coll, gc=False)
    Ev = _msgspec.defstruct("Ev", [
        ("ph", str, F(default="")), ("cat", str, F(default="")), ("name", str, F(default="")),
        ("pid", Union[int, str], F(default=-1)), ("tid", Union[int, str], F(default=-1)),
        ("ts", Optional[float], F(default=None)), ("dur", float, F(default=0.0)),
        ("args", Optional[Args], F(default=None))], gc=False)
    Doc = _msgspec.defstruct("Doc", [
        ("traceEvents", Optional[list[Ev]], F(default=None)),
        ("distributedInfo", Any, F(default=None)), ("deviceProperties", Any, F(default=None)),
        ("schemaVersion", Any, F(default=None)), ("displayTimeUnit", Any, F(default=None)),
        ("baseTimeNanoseconds", Any, F(default=None)), ("traceName", Any, F(default=None))])
    return _msgspec.json.Decoder(Doc)


# D9D_TRACE_JSON=stdlib forces the stdlib decoder (benchmarks, debugging)
_FAST = None if os.environ.get("D9D_TRACE_JSON") == "stdlib" else _make_fast_decoder()
_COLL_ATTRS = [(f"c{i}", k) for i, k in enumerate(COLLECTIVE_ARG_KEYS)]


def _columns_fast(path: Path, data: bytes):
    """Columns via msgspec; ``None`` when the file needs the generic path."""
    gc_was = gc.isenabled()
    gc.disable()
    try:
        doc = _FAST.decode(data)
    except _msgspec.ValidationError:
        return None  # unusual types somewhere (e.g. string stream ids): generic path
    except _msgspec.DecodeError as exc:
        msg = str(exc)
        what = "truncated" if "truncated" in msg.lower() else "corrupt"
        raise TraceError(path, f"{what} JSON: {msg}") from None
    finally:
        if gc_was:
            gc.enable()
    if doc.traceEvents is None:
        raise TraceError(path, "no 'traceEvents' list (not a Kineto/Chrome trace)")
    dist, devprops = doc.distributedInfo, doc.deviceProperties
    evs = [e for e in doc.traceEvents if e.ph == "X"]
    bad = 0
    if evs and any(e.ts is None for e in evs):
        bad = sum(e.ts is None for e in evs)
        evs = [e for e in evs if e.ts is not None]
    meta = {k: getattr(doc, k) for k in ("schemaVersion", "displayTimeUnit", "baseTimeNanoseconds",
                                         "traceName") if getattr(doc, k) is not None}
    del doc
    get = operator.attrgetter
    names = list(map(get("name"), evs))
    cols = {
        "names": names, "cats": list(map(get("cat"), evs)), "ts": list(map(get("ts"), evs)),
        "dur": list(map(get("dur"), evs)), "pid": list(map(get("pid"), evs)),
        "tid": list(map(get("tid"), evs)),
    }
    args = list(map(get("args"), evs))
    present = [a for a in args if a is not None]
    if len(present) == len(args):
        cols["stream"] = list(map(get("stream"), args))
        cols["device"] = list(map(get("device"), args))
        cols["corr"] = list(map(get("correlation"), args))
        cols["ext"] = list(map(get("external_id"), args))
        cols["nbytes"] = list(map(get("nbytes"), args))
        cols["mem_bw"] = list(map(get("mem_bw"), args))
    else:
        cols["stream"] = [a.stream if a is not None else -1 for a in args]
        cols["device"] = [a.device if a is not None else -1 for a in args]
        cols["corr"] = [a.correlation if a is not None else -1 for a in args]
        cols["ext"] = [a.external_id if a is not None else -1 for a in args]
        cols["nbytes"] = [a.nbytes if a is not None else _NAN for a in args]
        cols["mem_bw"] = [a.mem_bw if a is not None else _NAN for a in args]
    comm: dict = {}
    comm_names = {n for n in set(names) if n == "record_param_comms" or COMM_ANNOTATION_RE.match(n)}
    coll = operator.attrgetter(*(attr for attr, _ in _COLL_ATTRS))  # one C call per event
    keys = [k for _, k in _COLL_ATTRS]
    for i, (a, n) in enumerate(zip(args, names)):
        if a is not None and (a.c0 is not None or n in comm_names):
            comm[i] = {k: v for k, v in zip(keys, coll(a)) if v is not None}
    return cols, comm, bad, dist or None, devprops or None, meta


def _columns_generic(path: Path, data: bytes):
    doc = _read_json(path, data)
    events = doc.pop("traceEvents")
    names, cats, ts, dur, pid, tid = [], [], [], [], [], []
    stream, device, corr, ext, nbytes, mem_bw = [], [], [], [], [], []
    comm: dict = {}
    bad = 0
    row = 0
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        try:
            t = float(ev["ts"])
            d = float(ev.get("dur", 0.0))
        except (KeyError, TypeError, ValueError):
            bad += 1
            continue
        name = ev.get("name", "")
        if not isinstance(name, str):
            name = str(name)
        names.append(name)
        cats.append(ev.get("cat", ""))
        ts.append(t)
        dur.append(d)
        pid.append(ev.get("pid", -1))
        tid.append(ev.get("tid", -1))
        a = ev.get("args")
        if a:
            stream.append(a.get("stream", -1))
            device.append(a.get("device", -1))
            corr.append(a.get("correlation", -1))
            ext.append(a.get("External id", -1))
            nbytes.append(a.get("bytes", _NAN))
            mem_bw.append(a.get("memory bandwidth (GB/s)", _NAN))
            if "Collective name" in a or name == "record_param_comms" or (
                    ":" in name and COMM_ANNOTATION_RE.match(name)):
                comm[row] = {k: a[k] for k in COLLECTIVE_ARG_KEYS if k in a}
        else:
            stream.append(-1)
            device.append(-1)
            corr.append(-1)
            ext.append(-1)
            nbytes.append(_NAN)
            mem_bw.append(_NAN)
        row += 1
    del events
    meta = {k: v for k, v in doc.items() if k not in ("distributedInfo", "deviceProperties")}
    cols = {"names": names, "cats": cats, "ts": ts, "dur": dur, "pid": pid, "tid": tid,
            "stream": stream, "device": device, "corr": corr, "ext": ext,
            "nbytes": nbytes, "mem_bw": mem_bw}
    return cols, comm, bad, doc.get("distributedInfo") or None, doc.get("deviceProperties") or None, meta


def load_rank(path, rank: int | None = None, fast: bool | None = None) -> RankTrace:
    """Parse one Kineto trace file (``.json`` / ``.json.gz``) into a :class:`RankTrace`.

    ``fast``: use the msgspec decoder (default: when msgspec is installed); the result
    is identical to the stdlib path, which is used as fallback for unusual files.
    """
    path = Path(path)
    data = _read_bytes(path)
    got = None
    if (fast is None or fast) and _FAST is not None:
        got = _columns_fast(path, data)
    if got is None:
        got = _columns_generic(path, data)
    del data
    cols, comm_rows, bad, dist, devprops, meta = got
    n_rows = len(cols["ts"])
    if n_rows == 0:
        if bad:
            raise TraceError(path, f"all {bad} complete events lack a numeric 'ts'")
        raise TraceError(path, "empty trace: no complete ('ph': 'X') events")
    str_ids: dict = {}

    def ints(col):
        try:
            return np.asarray(col, dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            pass
        return np.asarray([v if v.__class__ is int else _as_int(v, str_ids) for v in col],
                          dtype=np.int64)

    def intern(col):
        uniq = list(dict.fromkeys(col))  # first-occurrence order
        index = {v: i for i, v in enumerate(uniq)}
        return uniq, np.fromiter(map(index.__getitem__, col), dtype=np.int32, count=len(col))

    def floats(col):
        try:
            return np.asarray(col, dtype=np.float64)
        except (TypeError, ValueError):
            pass
        out = np.full(len(col), np.nan)
        for i, v in enumerate(col):
            try:
                out[i] = float(v)
            except (TypeError, ValueError):
                pass
        return out

    name_list, name_id = intern(cols["names"])
    cat_list, cat_id = intern(cols["cats"])
    cat_kind = np.asarray([_CAT_KIND.get(str(c).lower(), KIND_OTHER) for c in cat_list],
                          dtype=np.int8)
    kind = cat_kind[cat_id]
    is_step_name = np.asarray([bool(_STEP_RE.match(n)) for n in name_list], dtype=bool)
    kind[is_step_name[name_id] & (kind != KIND_GPU_USER_ANNOTATION)
         & (kind != KIND_KERNEL)] = KIND_PROFILER_STEP
    comm_name = np.asarray([bool(COMM_KERNEL_RE.match(n)) for n in name_list], dtype=bool)
    is_comm = comm_name[name_id] & (kind == KIND_KERNEL)
    ann = np.asarray([n == "record_param_comms" or bool(COMM_ANNOTATION_RE.match(n))
                      for n in name_list], dtype=bool)
    is_comm |= ann[name_id] & (kind != KIND_KERNEL)
    if rank is None:
        rank = int(dist["rank"]) if isinstance(dist, dict) and "rank" in dist else 0
    if bad:
        meta["_skipped_events"] = bad
    return RankTrace(
        path=str(path), rank=int(rank), names=name_list, cats=cat_list,
        name_id=name_id, cat_id=cat_id, kind=kind,
        ts=np.asarray(cols["ts"], dtype=np.float64), dur=np.asarray(cols["dur"], dtype=np.float64),
        pid=ints(cols["pid"]), tid=ints(cols["tid"]), stream=ints(cols["stream"]),
        device=ints(cols["device"]), correlation=ints(cols["corr"]), external_id=ints(cols["ext"]),
        is_comm=is_comm, nbytes=floats(cols["nbytes"]), mem_bw=floats(cols["mem_bw"]),
        comm_args=comm_rows, distributed_info=dist,
        device_properties=devprops, metadata=meta,
    )


def _load_one(args):
    path, rank = args
    try:
        return rank, load_rank(path, rank), None
    except TraceError as exc:
        return rank, None, exc
    except MemoryError:
        return rank, None, TraceError(path, "out of memory while parsing")


def load_ranks(workload: Workload, parallel: bool = True, progress: bool | None = None,
               errors: dict | None = None, max_workers: int | None = None) -> dict:
    """Parse every rank of ``workload`` -> ``{rank: RankTrace}`` (sorted by rank)."""
    items = sorted(workload.traces.items())
    jobs = [(p, r) for r, p in items]
    if progress is None:
        progress = sys.stderr.isatty()
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(jobs), desc="parsing ranks", unit="rank", file=sys.stderr)
        except ImportError:  # pragma: no cover
            bar = None
    out: dict = {}
    workers = min(len(jobs), max_workers or os.cpu_count() or 1, _memory_worker_cap(p for p, _ in jobs))
    if parallel and workers > 1:
        # fork: workers inherit the imported modules (a fresh interpreter would re-import
        # torch through d9d_kernels, ~2 s per worker); HTA's parser does the same
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else None
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            results: Iterable = pool.map(_load_one, jobs)
            out_iter = results
            for rank, rt, err in out_iter:
                _collect(out, rank, rt, err, errors, bar)
    else:
        for job in jobs:
            _collect(out, *_load_one(job), errors, bar)
    if bar is not None:
        bar.close()
    return dict(sorted(out.items()))


def _uncompressed_size(path) -> int:
    try:
        size = os.path.getsize(path)
        if str(path).endswith(".gz") and size >= 4:
            with open(path, "rb") as fh:  # gzip ISIZE trailer (mod 2**32; grow for big ratios)
                fh.seek(-4, os.SEEK_END)
                isize = int.from_bytes(fh.read(4), "little")
            return max(isize, size * 4)
        return size
    except OSError:
        return 0


def _memory_worker_cap(paths) -> int:
    """Workers that fit in available memory: one parse holds ~(3 msgspec | 12 stdlib) x the
    uncompressed JSON size at its peak (tracemalloc: 3.1x and 5.0x on nccl_rank0_of2)."""
    factor = 4 if _FAST is not None else 6
    biggest = max((_uncompressed_size(p) for p in paths), default=0) * factor
    try:
        with open("/proc/meminfo") as fh:
            avail = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return 1 << 30
    return max(1, int(avail * 0.8 // max(biggest, 1)))


def _collect(out, rank, rt, err, errors, bar):
    if bar is not None:
        bar.update(1)
    if err is not None:
        if errors is None:
            raise err
        errors[err.file] = err.reason
        return
    out[rank] = rt


# ----------------------------------------------------------------------------- discovery
_TRACE_SUFFIXES = (".json", ".json.gz")
_RANK_NAME_RE = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
_DIST_RANK_RE = re.compile(r'"distributedInfo"\s*:\s*\{[^{}]*?"rank"\s*:\s*(\d+)', re.DOTALL)
_ITER_RE = re.compile(r"iteration_(\d+)$")


def _is_trace_file(p: Path) -> bool:
    n = p.name
    return p.is_file() and n.endswith(_TRACE_SUFFIXES)


def _head(path: Path, nbytes: int = 1 << 20) -> str:
    try:
        with _open_text(path) as fh:
            return fh.read(nbytes)
    except (OSError, EOFError, zlib.error, UnicodeDecodeError):
        return ""


def _head_rank(path: Path, nbytes: int = 1 << 20) -> int | None:
    """``distributedInfo.rank`` if it appears in the first MiB of the file."""
    m = _DIST_RANK_RE.search(_head(path, nbytes))
    return int(m.group(1)) if m else None


_DIST_RE = re.compile(r'"distributedInfo"\s*:\s*(\{[^{}]*)', re.DOTALL)
_FIELD_RE = {k: re.compile(rf'"{k}"\s*:\s*"?([\w.:-]+)') for k in ("backend", "world_size")}
_TS_RE = re.compile(r'"ts"\s*:\s*"?(-?[\d.]+)')
# traces of one job start within this of each other (µs): profilers start on every rank
# at the same step; separate runs of a job are hours apart
JOB_START_GAP_US = 600e6


def job_signature(path: Path) -> tuple | None:
    """``(backend, world_size, first_ts_us)`` from the first MiB (None where absent);
    None for an unreadable file (reported by the parser later)."""
    head = _head(Path(path))
    if not head:
        return None
    m = _DIST_RE.search(head)
    info = {}
    if m:
        for k, rx in _FIELD_RE.items():
            f = rx.search(m.group(1))
            info[k] = f.group(1) if f else None
    t = _TS_RE.search(head)
    if not m and not t:  # not a trace we can place; the parser names the problem
        return None
    return info.get("backend"), info.get("world_size"), float(t.group(1)) if t else None


def _jobs(files) -> list[list]:
    """Group trace files into jobs: same distributedInfo backend/world_size and start times
    within :data:`JOB_START_GAP_US` of each other."""
    by_info: dict = {}
    for f in files:
        sig = job_signature(f)
        if sig is None:
            continue
        b, ws, t0 = sig
        by_info.setdefault((b, ws), []).append((t0, f))
    jobs = []
    for (b, ws), items in by_info.items():
        timed = sorted((t, f) for t, f in items if t is not None)
        group: list = []
        last = None
        for t, f in timed:
            if last is not None and t - last > JOB_START_GAP_US:
                jobs.append(((b, ws, group[0][0]), group))
                group = []
            group.append((t, f))
            last = t
        group += [(None, f) for t, f in items if t is None]
        if group:
            jobs.append(((b, ws, group[0][0]), group))
    return jobs


def _describe_job(sig, group) -> str:
    b, ws, t0 = sig
    what = f"backend {b}, world_size {ws}" if b or ws else "no distributedInfo"
    names = ", ".join(Path(f).name for _, f in group[:3]) + (f" (+{len(group) - 3} more)" if len(group) > 3 else "")
    return f"[{what}, first ts {t0:.0f} us: {names}]" if t0 is not None else f"[{what}: {names}]"


def _latest_iteration(d: Path) -> Path | None:
    its = [(int(m.group(1)), p) for p in d.iterdir() if p.is_dir()
           and (m := _ITER_RE.search(p.name))]
    return max(its)[1] if its else None


KNOWN_CARD_KEYS = ("batch_size", "local_batch_size", "global_batch_size", "seq_len", "sequence_length",
                   "tokens_per_step", "flops_per_token", "model_flops_per_token", "flops_per_step",
                   "peak_flops", "dp_size")


def unknown_card_keys(card: dict | None) -> str | None:
    """A warning naming the card keys no tool reads (typos), listing the known ones."""
    bad = sorted(str(k) for k in (card or {}) if k not in KNOWN_CARD_KEYS)
    if not bad:
        return None
    return (f"workload card: unknown key(s) {', '.join(bad)} (ignored); known keys: "
            + ", ".join(KNOWN_CARD_KEYS))


def load_card(path) -> dict:
    """Read a workload card (YAML). Recognised keys (others are kept as-is):

    ``batch_size`` (sequences per step on one rank; ``local_batch_size`` is an alias),
    ``global_batch_size`` (sequences per step over all data-parallel ranks),
    ``seq_len`` (alias ``sequence_length``), ``tokens_per_step`` (per rank; overrides
    batch_size * seq_len), ``flops_per_token`` (alias ``model_flops_per_token``: training
    FLOPs per token, e.g. 6 * params), ``flops_per_step`` (per rank), ``peak_flops``
    (FLOP/s of one device; otherwise looked up from the trace's device name),
    ``dp_size`` (data-parallel degree, to turn global into per-rank batch).
    """
    try:
        import yaml
    except ImportError:  # pragma: no cover
        raise TraceError(path, "pyyaml is needed to read a workload card") from None
    try:
        with open(path, "r", encoding="utf-8") as fh:
            card = yaml.safe_load(fh)
    except FileNotFoundError:
        raise TraceError(path, "workload card not found") from None
    except (OSError, yaml.YAMLError) as exc:
        raise TraceError(path, f"unreadable workload card: {exc}") from None
    if card is None:
        return {}
    if not isinstance(card, dict):
        raise TraceError(path, "workload card must be a YAML mapping")
    return card


def find_workload(path, workload_card_path=None, allow_mixed: bool = False) -> Workload:
    """Discover trace files (by rank), memory snapshots (by rank) and the workload card.

    Traces of different jobs (by distributedInfo backend / world_size and trace start
    time, see :func:`_jobs`) raise :class:`TraceError` naming the jobs, unless
    ``allow_mixed``.
    """
    notes: list = []
    if isinstance(path, (list, tuple)):
        files = [Path(p) for p in path]
        root = Path(os.path.commonpath([str(f.parent) for f in files])) if files else Path(".")
        snap_dir = None
    else:
        root = Path(path)
        if not root.exists():
            raise TraceError(root, "no such file or directory")
        snap_dir = None
        if root.is_file():
            files = [root]
        else:
            search = root
            pt = root / "profile_traces"
            if pt.is_dir():
                it = _latest_iteration(pt)
                search = it or pt
                if it is not None:
                    notes.append(f"using {it.relative_to(root)} (latest profiled iteration)")
            elif _latest_iteration(root) is not None:
                search = _latest_iteration(root)
            files = sorted(p for p in search.rglob("*") if _is_trace_file(p))
            ms = root / "memory_snapshot"
            if ms.is_dir():
                snap_dir = _latest_iteration(ms) or ms
            else:
                snap_dir = root
    if not files:
        raise TraceError(root, "no .json / .json.gz trace files found")
    for f in files:
        if not f.is_file():
            raise TraceError(f, "file not found")
    if len(files) > 1:
        jobs = _jobs(files)
        if len(jobs) > 1 and not allow_mixed:
            raise MixedJobsError(root, f"traces from {len(jobs)} different jobs: "
                             + "; ".join(_describe_job(s, g) for s, g in jobs)
                             + " — analyse one job per directory, or pass --allow-mixed (allow_mixed=True)")
        if len(jobs) > 1:
            notes.append(f"traces of {len(jobs)} different jobs analysed together (allow_mixed)")
    traces: dict = {}
    unranked = []
    for f in sorted(files):
        r = _head_rank(f)
        if r is None:
            m = _RANK_NAME_RE.search(f.name)
            r = int(m.group(1)) if m else None
        if r is None:
            unranked.append(f)
            continue
        if r in traces:
            notes.append(f"rank {r}: {f} ignored, {traces[r]} already holds that rank")
            continue
        traces[r] = f
    nxt = 0
    for f in unranked:
        while nxt in traces:
            nxt += 1
        traces[nxt] = f
        notes.append(f"{f}: no rank in distributedInfo or file name, assigned rank {nxt}")
    snaps: dict = {}
    if snap_dir is not None and snap_dir.is_dir():
        for p in sorted(snap_dir.rglob("*.pickle")):
            m = _RANK_NAME_RE.search(p.name)
            r = int(m.group(1)) if m else len(snaps)
            snaps.setdefault(r, p)
    card_path = None
    if workload_card_path is not None:
        card_path = Path(workload_card_path)
    elif root.is_dir():
        for cand in ("workload_card.yaml", "workload_card.yml"):
            if (root / cand).is_file():
                card_path = root / cand
                break
    card = load_card(card_path) if card_path is not None else None
    it = None
    for f in traces.values():
        m = re.search(r"iteration_(\d+)", str(f))
        if m:
            it = int(m.group(1))
            break
    return Workload(root=str(root), traces=dict(sorted(traces.items())),
                    memory_snapshots=dict(sorted(snaps.items())), card=card,
                    card_path=str(card_path) if card_path else None, iteration=it,
                    notes=notes)
