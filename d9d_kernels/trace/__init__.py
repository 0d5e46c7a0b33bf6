"""Offline analysis of PyTorch profiler (Kineto) traces and CUDA memory snapshots.

Tools (one module each, all ``metric_cal(trace_dir, workload_card_path=None,
profile_mode="auto", steps="hta", allow_mixed=False) -> dict``): throughput,
communication, memory, overlap, training_phases, fsdp, straggler, kernel,
gpu_utilization, idle_time, launch, counters, sequences, critical_path; and
:func:`d9d_kernels.trace.diff.compare` (``python -m d9d_kernels.trace diff A B``),
which compares two runs. ``trace_dir`` is a workload directory, a directory of
``.json``/``.json.gz`` traces, one trace file, or a list of trace files (see
:mod:`d9d_kernels.trace._load`); traces of different jobs are refused unless
``allow_mixed``.

Output convention (:mod:`d9d_kernels.trace._result`): every number is a
metric ``{"value": v, "unit": "us" | "ms" | "%" | "bytes" | "GB/s" | ...,
"definition": "..."}``; a tool returns ``{"tool", "ranks": {"rank0": {...}},
"summary": {...}, "notes": [...], "errors": {file: reason}, "warnings": [...]}``.

``steps``: one step filter for every tool, ``"hta"`` (HolisticTraceAnalysis's
default: GPU work of the last ProfilerStep dropped), ``"all"`` or ``"N:M"``
(ProfilerStep numbers, inclusive). ``profile_mode``: ``"auto"`` (GPU analysis when
the trace has GPU events, CPU-only otherwise), ``"gpu"`` or ``"cpu"``. GPU-time
tools also take ``rounding="hta" | "exact"``; the defaults reproduce
HolisticTraceAnalysis (docs/trace.md).

Example:
    >>> from d9d_kernels.trace import overlap              # doctest: +SKIP
    >>> overlap.metric_cal("outputs/profile_traces")       # doctest: +SKIP
"""

from d9d_kernels.trace._load import (  # noqa: F401
    RankTrace,
    TraceError,
    Workload,
    find_workload,
    load_rank,
    load_ranks,
)
from d9d_kernels.trace._result import metric, result  # noqa: F401

TOOLS = (
    "throughput", "communication", "memory", "overlap", "training_phases",
    "fsdp", "straggler", "kernel", "gpu_utilization", "idle_time", "launch", "counters", "sequences", "critical_path",
)
