"""Helpers shared by the part-1 trace tools: cached workload loading, GPU event
selection under a step filter, kernel classification, device peak FLOP/s.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import re
from pathlib import Path

import numpy as np

from d9d_kernels.trace._load import (
    KIND_KERNEL,
    KIND_MEMCPY,
    KIND_MEMSET,
    KIND_PROFILER_STEP,
    RankTrace,
    TraceError,
    Workload,
    find_workload,
    load_card,
    load_ranks,
)

# ----------------------------------------------------------------------------- loading
_CACHE: dict = {}


def _key(trace_dir, card):
    """Identity of the inputs: every file under the given paths with its mtime and size."""
    paths = [trace_dir] if not isinstance(trace_dir, (list, tuple)) else list(trace_dir)
    out = []
    for p in paths:
        p = Path(p)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            try:
                st = f.stat()
                out.append((str(f), st.st_mtime_ns, st.st_size))
            except OSError:
                out.append((str(f), None, None))
    return tuple(out), str(card)


def open_workload(trace_dir, workload_card_path=None, parallel: bool = True, allow_mixed: bool = False):
    """``(workload, {rank: RankTrace}, errors)``; errors maps file -> reason.

    The last parsed workload is cached (keyed by path + mtime) so that running
    several tools on one directory parses it once.
    """
    if isinstance(trace_dir, Workload):
        wl = trace_dir
        key = None
    else:
        key = (_key(trace_dir, workload_card_path), bool(allow_mixed))
        if key in _CACHE:
            return _CACHE[key]
        wl = find_workload(trace_dir, workload_card_path, allow_mixed=allow_mixed)
    errors: dict = {}
    ranks = load_ranks(wl, parallel=parallel and len(wl.traces) > 1, errors=errors)
    if not ranks:
        first = next(iter(errors.items()), (wl.root, "no readable trace"))
        raise TraceError(*first)
    out = (wl, ranks, errors)
    if key is not None:
        _CACHE.clear()
        _CACHE[key] = out
    return out


# ranks from which map_ranks uses a process pool (fewer: the pool's start-up outweighs the work)
MAP_POOL_MIN_RANKS = 8
_MAP_STATE: tuple | None = None


def _map_one(r):
    fn, ranks = _MAP_STATE
    return fn(ranks[r])


def map_ranks(fn, ranks: dict) -> dict:
    """``{rank: fn(rank_trace)}``; with :data:`MAP_POOL_MIN_RANKS` ranks or more and several
    cores, in a pool of forked processes: the children inherit the parsed ranks (nothing
    is pickled on the way in) and send back only ``fn``'s results, which must be picklable.
    For the per-rank analyses that need no other rank (critical path, kernel sequences)."""
    global _MAP_STATE
    keys = list(ranks)
    workers = min(os.cpu_count() or 1, len(keys))
    if workers < 2 or len(keys) < MAP_POOL_MIN_RANKS or "fork" not in mp.get_all_start_methods():
        return {r: fn(ranks[r]) for r in keys}
    _MAP_STATE = (fn, ranks)
    try:
        with mp.get_context("fork").Pool(workers) as pool:
            return dict(zip(keys, pool.map(_map_one, keys, chunksize=1)))
    finally:
        _MAP_STATE = None


def card_of(wl: Workload, workload_card_path=None) -> dict:
    if workload_card_path is not None and wl.card_path != str(workload_card_path):
        return load_card(workload_card_path)
    return wl.card or {}


def rank_key(r: int) -> str:
    return f"rank{r}"


def resolve_mode(rt: RankTrace, profile_mode: str) -> str:
    if profile_mode not in ("auto", "gpu", "cpu"):
        raise ValueError(f"profile_mode must be 'auto', 'gpu' or 'cpu', got {profile_mode!r}")
    if profile_mode != "auto":
        return profile_mode
    return "gpu" if rt.gpu_mask.any() else "cpu"


def gpu_rows(rt: RankTrace, step_filter: str = "hta") -> np.ndarray:
    """Row mask of GPU work (kernels, memcpy, memset on a stream) under ``step_filter``.

    ``"hta"``: HolisticTraceAnalysis's default (drop GPU work not launched before the
    last ProfilerStep; see :meth:`RankTrace.hta_step_filter`). ``"all"``: every GPU event.
    """
    if step_filter == "hta":
        return rt.hta_step_filter(include_last_profiler_step=False)
    if step_filter == "all":
        return rt.gpu_mask
    raise ValueError(f"step_filter must be 'hta' or 'all', got {step_filter!r}")


def gpu_intervals(rt: RankTrace, rows: np.ndarray, rounding: str = "hta"):
    """``(start, end)`` float64 µs arrays of ``rows``.

    ``rounding="hta"``: as HolisticTraceAnalysis does for traces with sub-µs timestamps,
    start is rounded up and end down to whole µs (an event shorter than that gets a
    zero or negative length and counts as nothing). ``"exact"``: the file's values.
    """
    s = rt.ts[rows]
    e = s + rt.dur[rows]
    if rounding == "hta":
        if np.any(rt.ts != np.floor(rt.ts)):
            s = np.ceil(s)
            e = np.floor(e)
    elif rounding != "exact":
        raise ValueError(f"rounding must be 'hta' or 'exact', got {rounding!r}")
    return s, e


ROUNDING_NOTE = ("rounding 'hta': with sub-microsecond timestamps, event starts are rounded up and ends "
                 "down to whole microseconds, as HolisticTraceAnalysis does; pass rounding='exact' to "
                 "use the file's values")

STEP_FILTER_NOTE = ("GPU events: kernels, memcpy and memset with a stream; step filter 'hta': GPU work "
                    "launched from the last ProfilerStep (and work with no launching CPU event) is "
                    "dropped, as HolisticTraceAnalysis does by default; no filter with < 2 steps")

# ----------------------------------------------------------------------------- classes
# HolisticTraceAnalysis's 3-way kernel typing (hta/utils/utils.py), reproduced for comparison.
_HTA_COMM = re.compile(r"^nccl.*Kernel")
_HTA_MEM = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
_HTA_NOT_COMP = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")


def hta_type(name: str) -> str:
    if _HTA_COMM.match(name):
        return "COMMUNICATION"
    if _HTA_MEM.match(name):
        return "MEMORY"
    if not _HTA_NOT_COMP.match(name):
        return "COMPUTATION"
    return "OTHER"


# Our 6 classes. Rules are applied in this order; the first match wins.
KERNEL_CLASSES = ("communication", "memory", "attention", "gemm", "reduction", "elementwise", "other")
_RULES = [
    ("communication", re.compile(r"^(nccl|rccl)|nccl.*kernel|allreduce|all_reduce|allgather|"
                                 r"reducescatter|reduce_scatter|alltoall|sendrecv|cross_device_reduce",
                                 re.I)),
    ("memory", re.compile(r"^(memcpy|memset|dma)|memcpy|memset", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|attn|sdpa|_mha|mha_|xformers", re.I)),
    ("gemm", re.compile(r"gemm|matmul|cublas|cutlass|xmma|wgmma|nvjet|triton_tem|_mm_|bmm|"
                        r"conv|winograd|implicit_convolve|dgrad|wgrad|fprop|s884|s1688|h884|h1688|"
                        r"i8816|sm80_|sm90_|Cijk_", re.I)),
    ("reduction", re.compile(r"reduce|reduction|norm|softmax|welford|triton_red|triton_per|"
                             r"cross_entropy|nll_loss|argmax|argmin|topk|cumsum|scan|_sum|sum_|"
                             r"mean|\bbn_|cub::", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|pointwise|triton_poi|copy|fill|"
                               r"cat_|index|gather|scatter|gelu|relu|silu|swiglu|sigmoid|tanh|"
                               r"dropout|add|mul|div|where|clamp|foreach|adam|sgd|rope|rotary|"
                               r"cast|convert|transpose|embedding|masked|exp|pow|sqrt|neg", re.I)),
]
KERNEL_RULES_DOC = (
    "first matching rule wins: communication = NCCL/RCCL kernel or collective name; "
    "memory = memcpy/memset/dma (and every gpu_memcpy/gpu_memset event); attention = "
    "flash/fmha/attention/attn/sdpa/mha/xformers; gemm = gemm/matmul/cublas/cutlass/xmma/"
    "wgmma/nvjet/triton_tem/bmm/convolution (cuDNN conv, winograd, dgrad/wgrad/fprop) and "
    "tensor-core tile names (s1688, h884, sm80_, sm90_, Cijk_ for ROCm); reduction = "
    "reduce/norm/softmax/welford/triton_red/triton_per/cross_entropy/argmax/topk/cumsum/cub; "
    "elementwise = elementwise/vectorized/unrolled/triton_poi/copy/fill/index/gather/"
    "activations/optimizer foreach; anything else = other")


def kernel_class(name: str, kind: int = KIND_KERNEL) -> str:
    if kind in (KIND_MEMCPY, KIND_MEMSET):
        return "memory"
    for cls, rx in _RULES:
        if rx.search(name):
            return cls
    return "other"


def classify_rows(rt: RankTrace, rows: np.ndarray, fn) -> np.ndarray:
    """Apply ``fn(name, kind)`` once per distinct (name, kind) among ``rows``; object array."""
    keys = rt.name_id[rows].astype(np.int64) * 16 + rt.kind[rows]
    uniq, inv = np.unique(keys, return_inverse=True)
    labels = np.asarray([fn(rt.names[int(k) // 16], int(k) % 16) for k in uniq], dtype=object)
    return labels[inv] if uniq.size else np.empty(0, dtype=object)


# ----------------------------------------------------------------------------- devices
# Dense BF16/FP16 tensor-core peak of one device (FLOP/s), vendor data sheets.
PEAK_FLOPS = [
    (re.compile(r"H200", re.I), 989e12),
    (re.compile(r"H100.*PCIe", re.I), 756e12),
    (re.compile(r"H100|H800|GH200", re.I), 989e12),
    (re.compile(r"B200", re.I), 2250e12),
    (re.compile(r"A100|A800", re.I), 312e12),
    (re.compile(r"L40S", re.I), 362e12),
    (re.compile(r"A10G|A10\b", re.I), 125e12),
    (re.compile(r"V100", re.I), 125e12),
    (re.compile(r"MI300X|MI325", re.I), 1307e12),
    (re.compile(r"MI250X|MI250", re.I), 191.5e12),  # per GCD (one visible device)
]


def device_peak_flops(rt: RankTrace) -> tuple[float | None, str | None]:
    for props in rt.device_properties or []:
        name = str(props.get("name", ""))
        for rx, peak in PEAK_FLOPS:
            if rx.search(name):
                return peak, name
        return None, name
    return None, None


# ----------------------------------------------------------------------------- step filter
STEPS_DOC = ("steps: 'hta' (default; HolisticTraceAnalysis's filter: GPU work launched from the last "
             "ProfilerStep, or with no launching CPU event, is dropped; no filter with < 2 steps), "
             "'all' (every event), or 'N:M' (ProfilerStep#N..#M inclusive: CPU events starting in "
             "those steps and the GPU work they launched)")
_STEPS_CACHE: dict = {}
_STEPS_RE = re.compile(r"^\s*(\d+)\s*(?::\s*(\d+)\s*)?$")


def parse_steps(steps) -> str | tuple[int, int]:
    """``"all"``, ``"hta"`` or an inclusive ``(N, M)`` step-number range; ValueError otherwise."""
    if isinstance(steps, (tuple, list)) and len(steps) == 2:
        n, m = int(steps[0]), int(steps[1])
    elif steps in ("all", "hta"):
        return steps
    else:
        mt = _STEPS_RE.match(str(steps))
        if not mt:
            raise ValueError(f"steps must be 'all', 'hta' or 'N:M' (ProfilerStep numbers), got {steps!r}")
        n = int(mt.group(1))
        m = int(mt.group(2)) if mt.group(2) is not None else n
    if m < n:
        raise ValueError(f"steps {n}:{m}: the last step is before the first")
    return n, m


def steps_note(spec) -> str:
    if spec == "hta":
        return ("step filter 'hta': GPU work launched from the last ProfilerStep (or with no launching "
                "CPU event) dropped, as HolisticTraceAnalysis does; no filter with < 2 steps")
    if spec == "all":
        return "step filter 'all': every event in the trace, no step filter"
    return (f"step filter {spec[0]}:{spec[1]}: CPU events starting in ProfilerStep#{spec[0]}..#{spec[1]} "
            "and the GPU work they launched")


def subset(rt: RankTrace, keep: np.ndarray) -> RankTrace:
    """A :class:`RankTrace` of the rows in mask ``keep`` (same name tables)."""
    rows = np.flatnonzero(keep)
    if rows.size == len(rt):
        return rt
    new_index = np.full(len(rt), -1, dtype=np.int64)
    new_index[rows] = np.arange(rows.size)
    cols = {c: getattr(rt, c)[rows] for c in ("name_id", "cat_id", "kind", "ts", "dur", "pid", "tid",
                                              "stream", "device", "correlation", "external_id",
                                              "is_comm", "nbytes", "mem_bw")}
    comm = {int(new_index[r]): a for r, a in rt.comm_args.items() if new_index[r] >= 0}
    return RankTrace(path=rt.path, rank=rt.rank, names=rt.names, cats=rt.cats, comm_args=comm,
                     distributed_info=rt.distributed_info, device_properties=rt.device_properties,
                     metadata=rt.metadata, **cols)


def select_steps(rt: RankTrace, spec) -> RankTrace:
    """Rows of ``rt`` kept by the step filter ``spec`` (from :func:`parse_steps`)."""
    if spec == "all":
        return rt
    gpu = rt.gpu_mask
    if spec == "hta":
        return subset(rt, ~gpu | rt.hta_step_filter(include_last_profiler_step=False))
    n, m = spec
    nums, start, end = rt.steps
    sel = (nums >= n) & (nums <= m)
    if not sel.any():
        have = f"{int(nums.min())}..{int(nums.max())}" if nums.size else "none"
        raise TraceError(rt.path, f"steps {n}:{m}: no ProfilerStep#N in that range (steps present: {have})")
    lo, hi = float(start[sel].min()), float(end[sel].max())
    # ProfilerStep spans of other steps that start inside the window (none, normally) are dropped
    num_of_name = np.array([int(x.split("#", 1)[1]) if x.startswith("ProfilerStep#")
                            and x.split("#", 1)[1].isdigit() else -1 for x in rt.names], dtype=np.int64)
    row_num = num_of_name[rt.name_id]
    other_step = (rt.kind == KIND_PROFILER_STEP) & ((row_num < n) | (row_num > m))
    cpu = ~gpu & (rt.ts >= lo) & (rt.ts < hi) & ~other_step
    corr = rt.correlation[cpu & (rt.correlation >= 0)]
    keep_gpu = gpu & (rt.correlation >= 0) & np.isin(rt.correlation, corr)
    return subset(rt, cpu | keep_gpu)


def open_steps(trace_dir, workload_card_path=None, steps="hta", allow_mixed: bool = False,
               step_filter=None):
    """:func:`open_workload` with the step filter applied: ``(wl, ranks, errors, note)``.

    ``step_filter`` is the older name of ``steps`` and wins when given.
    """
    spec = parse_steps(step_filter if step_filter is not None else steps)
    wl, ranks, errors = open_workload(trace_dir, workload_card_path, allow_mixed=allow_mixed)
    key = (id(ranks), spec)
    if _STEPS_CACHE.get("key") == key and _STEPS_CACHE.get("ranks") is ranks:
        return _STEPS_CACHE["value"]
    errors = dict(errors)
    out = {}
    for r, rt in ranks.items():
        try:
            out[r] = select_steps(rt, spec)
        except TraceError as exc:
            errors[exc.file] = exc.reason
    if not out:
        raise TraceError(*next(iter(errors.items())))
    value = (wl, out, errors, steps_note(spec))
    # the tools of one CLI run share the filtered view (``ranks`` is kept alive by the check)
    _STEPS_CACHE.clear()
    _STEPS_CACHE.update(key=key, ranks=ranks, value=value)
    return value


def hta_times(rt: RankTrace, rounding: str = "hta") -> tuple[np.ndarray, np.ndarray]:
    """``(start, end)`` µs of every row; ``rounding="hta"`` as :func:`gpu_intervals` (HTA
    rounds every event, CPU and GPU, when the file has sub-µs timestamps)."""
    every = np.ones(len(rt), dtype=bool)
    return gpu_intervals(rt, every, rounding)


def launch_rows(rt: RankTrace) -> tuple[np.ndarray, np.ndarray]:
    """``(gpu_row, cpu_row)`` pairs linked by correlation id: each GPU event (stream >= 0)
    and the non-GPU event (runtime call) that launched it. GPU events without a launching
    event in the trace are left out; with several candidates the last in file order wins,
    as in HTA's ``transform_correlation_to_index``."""
    gpu = rt.gpu_mask & (rt.correlation >= 0)
    cpu = ~rt.gpu_mask & (rt.stream < 0) & (rt.correlation >= 0)
    c_rows = np.flatnonzero(cpu)
    c_corr = rt.correlation[c_rows]
    # last occurrence per correlation id
    order = np.lexsort((c_rows, c_corr))
    c_corr, c_rows = c_corr[order], c_rows[order]
    last = np.r_[c_corr[1:] != c_corr[:-1], True] if c_corr.size else np.zeros(0, dtype=bool)
    c_corr, c_rows = c_corr[last], c_rows[last]
    g_rows = np.flatnonzero(gpu)
    pos = np.searchsorted(c_corr, rt.correlation[g_rows])
    pos_ok = np.minimum(pos, max(c_corr.size - 1, 0))
    found = (pos < c_corr.size) & (c_corr[pos_ok] == rt.correlation[g_rows]) if c_corr.size \
        else np.zeros(g_rows.size, dtype=bool)
    return g_rows[found], c_rows[pos_ok[found]]
