"""Generate real Kineto traces with torch.profiler on CPU for the trace tests.

``make_gloo_workload(root, steps=3)`` runs 2 gloo ranks that each do a small matmul
and an ``all_reduce`` per step under ``torch.profiler`` and writes them as torchtitan
does: ``root/profile_traces/iteration_<steps>/rank{R}_trace.json`` (rank 1 gzipped),
plus a ``workload_card.yaml``. Rank 1 sleeps ``lag_s`` before every all_reduce, so it
arrives last at every collective by construction.
"""

from __future__ import annotations

import gzip
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

NUMEL = 1000  # float32 elements per all_reduce -> 4000 bytes


def _worker(rank, world_size, root, steps, lag_s):
    out = Path(root) / "profile_traces" / f"iteration_{steps}"
    out.mkdir(parents=True, exist_ok=True)
    x = torch.ones(NUMEL)
    a = torch.randn(64, 64)
    path = out / f"rank{rank}_trace.json"
    sched = torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                schedule=sched,
                                on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(steps + 1):
            a = a @ a
            a = a / a.norm()
            if rank == 1:
                time.sleep(lag_s)
            dist.all_reduce(x)
            prof.step()
    if rank == 1:
        with open(path, "rb") as src, gzip.open(str(path) + ".gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        os.remove(path)
    return str(path)


def make_gloo_workload(root, steps: int = 3, lag_s: float = 0.1) -> Path:
    root = Path(root)
    run_distributed(_worker, 2, str(root), steps, lag_s)
    (root / "workload_card.yaml").write_text("batch_size: 4\nseq_len: 128\nflops_per_token: 1000\n"
                                             "peak_flops: 1.0e9\n")
    return root


_CACHED: dict = {}
LAG_S = 0.1  # large next to scheduling jitter on a loaded 2-core machine
STEPS = 3


def gloo_workload() -> Path:
    """The 2-rank gloo workload, generated once per test process (removed at exit)."""
    if "root" not in _CACHED:
        import atexit
        import tempfile

        root = Path(tempfile.mkdtemp(prefix="d9d_trace_gloo_"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _CACHED["root"] = make_gloo_workload(root / "workload", steps=STEPS, lag_s=LAG_S)
    return _CACHED["root"]
