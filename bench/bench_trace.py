"""Trace analysis: d9d_kernels.trace vs HolisticTraceAnalysis on the same traces.

Question: how much wall time and peak memory do parse + the analyses HTA also
offers (temporal breakdown, compute-communication overlap, kernel-type breakdown)
take, ours vs HTA's?

Every measurement runs in a fresh Python process (imports done before the clock
starts, so import time is excluded on both sides):

* wall: ``time.perf_counter`` around parse + the three analyses; median over
  ``--repeats`` processes (p20/p50/p80 recorded); also CPU seconds (process +
  its workers, ``getrusage``), which a loaded 2-core machine distorts less;
* memory: one more process per case with ``tracemalloc`` on (Python + numpy/pandas
  buffers of the main process). Both parse serially in this run (HTA:
  ``load_traces(use_multiprocessing=False)``) so every rank's parse is seen; with the
  pool, each worker peaks at about one rank's parse. ``worker_maxrss`` is the largest child's ru_maxrss; for ours it is
  dominated by a ~430 MiB child that ``import torch`` (via ``import d9d_kernels``) spawns
  before the clock starts, so it is not a measure of the parse workers;
  plus ``ru_maxrss`` growth of the process (VmHWM after - VmRSS before the work) and
  the largest worker's ``ru_maxrss`` (RUSAGE_CHILDREN).

Providers: ``hta``; ``d9d`` (msgspec installed); ``d9d_stdlib`` (same code, stdlib json:
what an install without the optional msgspec gets).

Datasets: the shared real traces, and ``nccl_x8``: the 40k-event A100 rank copied to
8 ranks (distributedInfo.rank rewritten) to exercise parallel parsing.

    python bench/bench_trace.py [--repeats 5] [--data /work/shared/data/traces] \
        [--suite temporal+overlap+kernel_type | idle+launch+queue] [--providers hta,d9d,d9d_stdlib]

``--suite idle+launch+queue`` times HTA's get_idle_time_breakdown +
get_cuda_kernel_launch_stats + get_queue_length_summary (all ranks) against our
idle_time + launch + counters tools.

Appends rows to bench/results/bench_trace.csv.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CSV = REPO / "bench" / "results" / "bench_trace.csv"
COLUMNS = ["op", "provider", "shape", "dtype", "device", "p20", "p50", "p80", "cpu_s_p50",
           "tracemalloc_peak_mib", "rss_growth_mib", "worker_maxrss_mib", "ratio_p50_vs_hta", "git_sha"]

# what is timed on both sides: the original three HTA analyses, or the three added later
SUITES = ("temporal+overlap+kernel_type", "idle+launch+queue")
SUITES_OP = {"temporal+overlap+kernel_type": "temporal+overlap+kernel_type",
             "idle+launch+queue": "idle_time+launch+queue_length"}
CHILD = r"""
import json, os, resource, sys, time, logging, warnings
warnings.filterwarnings("ignore")
provider, trace_dir, mem, suite = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
def vm(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
if provider == "hta":
    from hta.trace_analysis import TraceAnalysis
    logging.disable(logging.WARNING)
    from hta.common.trace import Trace
    def work():
        if mem:  # serial parse, like ours in this run, so tracemalloc sees every rank's parse
            ta = TraceAnalysis.__new__(TraceAnalysis)
            ta.t = Trace(trace_dir=trace_dir)
            ta.t.load_traces(False, use_multiprocessing=False)
        else:
            ta = TraceAnalysis(trace_dir=trace_dir)
        if suite == "idle+launch+queue":
            ranks = list(ta.t.traces)
            ta.get_idle_time_breakdown(ranks=ranks, visualize=False)
            ta.get_cuda_kernel_launch_stats(ranks=ranks, visualize=False)
            ta.get_queue_length_summary(ranks=ranks)
        else:
            ta.get_temporal_breakdown(visualize=False)
            ta.get_comm_comp_overlap(visualize=False)
            ta.get_gpu_kernel_breakdown(visualize=False)
else:
    from d9d_kernels.trace import _common, counters, idle_time, kernel, launch, overlap
    import concurrent.futures  # noqa: F401 (pool import outside the clock, as HTA's)
    def work():
        _common._CACHE.clear()
        if mem:  # serial parse so tracemalloc sees every rank's parsing (workers are invisible to it)
            _common.open_workload(trace_dir, parallel=False)
        tools = (idle_time, launch, counters) if suite == "idle+launch+queue" else (overlap, kernel)
        for tool in tools:
            tool.metric_cal(trace_dir)
if mem:
    import tracemalloc
    tracemalloc.start()
def cpu():
    a = resource.getrusage(resource.RUSAGE_SELF)
    b = resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime
rss0 = vm("VmRSS:")
c0 = cpu()
t0 = time.perf_counter()
work()
dt = time.perf_counter() - t0
out = {"wall_s": dt, "cpu_s": cpu() - c0, "rss_growth_mib": vm("VmHWM:") - rss0,
       "worker_maxrss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}
if mem:
    out["tracemalloc_peak_mib"] = tracemalloc.get_traced_memory()[1] / 2**20
print("RESULT " + json.dumps(out))
"""


def run_child(provider: str, trace_dir: Path, mem: bool, suite: str = SUITES[0]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if provider == "d9d_stdlib":  # our parser without msgspec (the optional dependency)
        env["D9D_TRACE_JSON"] = "stdlib"
    p = subprocess.run([sys.executable, "-c", CHILD, provider, str(trace_dir), "1" if mem else "0", suite],
                       capture_output=True, text=True, env=env, cwd=str(REPO), timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{provider} on {trace_dir} failed:\n{p.stderr[-3000:]}")


def make_datasets(data: Path, tmp: Path) -> dict:
    sets = {}
    for sub in ("hta_sampled_2rank", "nccl_rank0_of2"):
        d = tmp / sub
        shutil.copytree(data / sub, d)
        sets[sub] = d
    src = json.load(gzip.open(data / "nccl_rank0_of2" / "nccl_data.json.gz"))
    d = tmp / "nccl_x8"
    d.mkdir()
    for r in range(8):
        src["distributedInfo"]["rank"] = r
        src["distributedInfo"]["world_size"] = 8
        with gzip.open(d / f"rank{r}_trace.json.gz", "wt") as fh:
            json.dump(src, fh)
    sets["nccl_x8"] = d
    return sets


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--data", default="/work/shared/data/traces")
    ap.add_argument("--datasets", default="hta_sampled_2rank,nccl_rank0_of2,nccl_x8")
    ap.add_argument("--suite", default=SUITES[0], choices=SUITES,
                    help="analyses timed on both sides (HTA's call per analysis vs our tool)")
    ap.add_argument("--providers", default="hta,d9d,d9d_stdlib")
    args = ap.parse_args()
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=REPO).stdout.strip()
    except OSError:
        sha = ""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sets = make_datasets(Path(args.data), Path(tmp))
        for name in args.datasets.split(","):
            d = sets[name]
            n_ranks = len(list(d.iterdir()))
            res = {}
            for provider in args.providers.split(","):
                runs = [run_child(provider, d, False, args.suite) for _ in range(args.repeats)]
                walls = [r["wall_s"] for r in runs]
                cpus = [r["cpu_s"] for r in runs]
                mem = run_child(provider, d, True, args.suite)
                res[provider] = (walls, mem, cpus)
            hta_p50 = statistics.median(res["hta"][0])
            for provider, (walls, mem, cpus) in res.items():
                row = {
                    "op": "trace_parse+" + SUITES_OP[args.suite], "provider": provider,
                    "shape": f"{name}:{n_ranks}ranks", "dtype": "", "device": f"cpu{os.cpu_count()}",
                    "p20": round(pct(walls, 0.2), 4), "p50": round(statistics.median(walls), 4),
                    "p80": round(pct(walls, 0.8), 4), "cpu_s_p50": round(statistics.median(cpus), 4),
                    "tracemalloc_peak_mib": round(mem["tracemalloc_peak_mib"], 1),
                    "rss_growth_mib": round(mem["rss_growth_mib"], 1),
                    "worker_maxrss_mib": round(mem["worker_maxrss_mib"], 1),
                    "ratio_p50_vs_hta": round(hta_p50 / statistics.median(walls), 2),
                    "git_sha": sha,
                }
                rows.append(row)
                print(", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    CSV.parent.mkdir(parents=True, exist_ok=True)
    new = not CSV.exists()
    with open(CSV, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        if new:
            w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
