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

``--scale`` (the 64-rank question: does a large job fit in a minute?): a synthetic
directory of ``--ranks`` (64) Kineto traces of ``--rank-mb`` (~25) MB of JSON each, a
training step's event mix (FSDP all-gather / reduce-scatter on a comm stream, GEMM,
flash-attention and elementwise kernels with their cudaLaunchKernel calls and ac2g
flow events, python_function and aten:: CPU ops, memcpy/memset with bytes and
bandwidth, a cudaDeviceSynchronize per ProfilerStep), written once into
``--cache`` (default ``~/.cache/d9d_kernels/bench_trace``) and reused. Timed, fresh
process per run: our CLI (``python -m d9d_kernels.trace DIR``, every tool, parallel
parse over ranks, interpreter start and imports included) on all ranks, and both
sides on the first ``--hta-ranks`` ranks (HTA: ``TraceAnalysis`` parse + temporal
breakdown, overlap, kernel breakdown, idle time, launch stats, queue length and
memory bandwidth summaries, imports excluded), where HTA is too slow for all ranks;
the 64-rank HTA figure is then a per-rank extrapolation, labelled so (``provider``
``hta_extrapolated``). Peak memory: the sum of PSS over the process tree (shared pages
counted once), sampled every 0.25 s. Rows go to bench/results/bench_trace_scale.csv and
bench/results/bench_trace_scale.png.

Appends rows to bench/results/bench_trace.csv.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CSV = REPO / "bench" / "results" / "bench_trace.csv"
SCALE_CSV = REPO / "bench" / "results" / "bench_trace_scale.csv"
SCALE_PNG = REPO / "bench" / "results" / "bench_trace_scale.png"
SCALE_COLUMNS = ["op", "provider", "shape", "dtype", "device", "p20", "p50", "p80", "cpu_s_p50", "peak_pss_mib",
                 "ratio_p50_vs_hta", "git_sha"]
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


# ----------------------------------------------------------------------------- scale: synthetic ranks
SCALE_VERSION = 2  # bump when the generator changes (the cache key)

GEMM = ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_"
        "execute_segment_k_off_kernel__5x_cublas")
ELEMWISE = ("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl(at::TensorIteratorBase&, "
            "at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#1}::operator()() const::"
            "{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2> >(int, at::native::GeluCUDAKernelImpl("
            "at::TensorIteratorBase&, at::native::GeluType)::{lambda()#2}::operator()() const::{lambda()#1}::"
            "operator()() const::{lambda(c10::BFloat16)#1}, at::detail::Array<char*, 2>)")
FLASH = ("void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, "
         "cutlass::bfloat16_t>, false, true, false, false, true, true, false>(Flash_fwd_params)")
NCCL_AG = "ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
NCCL_RS = "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevComm*, unsigned long, ncclWork*)"
MEMCPY = {"HtoD": "Memcpy HtoD (Pinned -> Device)", "DtoH": "Memcpy DtoH (Device -> Pinned)",
          "DtoD": "Memcpy DtoD (Device -> Device)"}


class Writer:
    def __init__(self, fh, rank, world, seed):
        self.fh, self.rank, self.world = fh, rank, world
        self.rng = random.Random(seed)
        self.pid, self.tid = 1000 + rank, 2000 + rank
        # Kineto's ids grow through a process; small ones also trip HTA 0.5.0 (an int16 downcast)
        self.corr = 5_000_000
        self.ext = 2_000_000
        self.t = 1_700_000_000_000_000.0 + rank * 3.1  # µs, all ranks within a few µs
        self.gpu = {7: 0.0, 21: 0.0}
        self.first = True
        self.n = 0

    def w(self, s):
        self.fh.write(s if self.first else ",\n" + s)
        self.first = False
        self.n += 1

    def x(self, cat, name, pid, tid, ts, dur, args):
        self.w('{"ph": "X", "cat": "%s", "name": %s, "pid": %d, "tid": %d, "ts": %.3f, "dur": %.3f, "args": %s}'
               % (cat, json.dumps(name), pid, tid, ts, dur, args))

    def cpu_op(self, name, dur, extra=""):
        e = self.ext
        self.ext += 1
        self.x("cpu_op", name, self.pid, self.tid, self.t, dur,
               '{"External id": %d, "Record function id": %d, "Ev Idx": %d%s}' % (e, e, e, extra))
        return e

    def launch(self, ext, kname, kdur, stream=7, cat="kernel", rt="cudaLaunchKernel", kargs=""):
        c = self.corr
        self.corr += 1
        t = self.t
        rdur = 3.0 + self.rng.random() * 4
        self.x("cuda_runtime", rt, self.pid, self.tid, t, rdur,
               '{"External id": %d, "cbid": 211, "correlation": %d}' % (ext, c))
        self.w('{"ph": "s", "id": %d, "pid": %d, "tid": %d, "ts": %.3f, "cat": "ac2g", "name": "ac2g"}'
               % (c, self.pid, self.tid, t))
        start = max(t + 5.0, self.gpu[stream])
        kdur *= 0.9 + 0.2 * self.rng.random()
        self.gpu[stream] = start + kdur + 1.0
        self.x(cat, kname, 0, stream, start, kdur,
               '{"External id": %d, "queued": 0, "device": 0, "context": 1, "stream": %d, "correlation": %d%s}'
               % (ext, stream, c, kargs))
        self.w('{"ph": "f", "id": %d, "pid": 0, "tid": %d, "ts": %.3f, "cat": "ac2g", "name": "ac2g", "bp": "e"}'
               % (c, stream, start))
        self.t += rdur + 1.0

    def op(self, name, kname, kdur, cpu_us=12.0, **kw):
        ext = self.cpu_op(name, cpu_us)
        self.t += 2.0
        self.launch(ext, kname, kdur, **kw)
        self.t += cpu_us

    def memop(self, kind):
        nbytes = self.rng.choice((4096, 1 << 20, 16 << 20, 64 << 20))
        if kind == "memset":
            name, rt, cat = "Memset (Device)", "cudaMemsetAsync", "gpu_memset"
            gbps = 1500.0
        else:
            name, rt, cat = MEMCPY[kind], "cudaMemcpyAsync", "gpu_memcpy"
            gbps = 600.0 if kind == "DtoD" else 22.0
        dur = max(nbytes / (gbps * 1e3), 1.2)
        ext = self.cpu_op("aten::copy_" if kind != "memset" else "aten::zero_", 10.0)
        self.t += 2.0
        self.launch(ext, name, dur, cat=cat, rt=rt,
                    kargs=', "bytes": %d, "memory bandwidth (GB/s)": %r' % (nbytes, nbytes / (dur * 1e3)))

    def coll(self, coll, kname, nelems):
        args = (', "Collective name": "%s", "In msg nelems": %d, "Out msg nelems": %d, "Group size": %d, '
                '"dtype": "BFloat16", "Process Group Name": "0", "Process Group Description": "default_pg"'
                % (coll, nelems, nelems * (self.world if coll == "_allgather_base" else 1), self.world))
        ext = self.cpu_op("record_param_comms", 30.0, args)
        self.t += 3.0
        self.launch(ext, kname, 200.0 + nelems / 2e4, stream=21, kargs=args)
        self.t += 25.0

    def step(self, n, layers):
        t0 = self.t
        # the ProfilerStep span is written after its contents (its duration is known then)
        for layer in range(layers):  # forward
            self.coll("_allgather_base", NCCL_AG, 4_000_000)
            self.w('{"ph": "X", "cat": "python_function", "name": "nn.Module: TransformerBlock_%d", "pid": %d, '
                   '"tid": %d, "ts": %.3f, "dur": 900.0, "args": {"Python id": %d}}'
                   % (layer, self.pid, self.tid, self.t, layer))
            for name, k, d in (("aten::linear", GEMM, 180.0), ("aten::_flash_attention_forward", FLASH, 260.0),
                               ("aten::linear", GEMM, 120.0), ("aten::gelu", ELEMWISE, 40.0),
                               ("aten::linear", GEMM, 220.0), ("aten::add", ELEMWISE, 15.0)):
                self.op(name, k, d)
                self.cpu_op("aten::empty", 2.0)
                self.t += 4.0
            if layer % 4 == 0:
                self.memop(self.rng.choice(("DtoD", "memset")))
        for layer in range(layers):  # backward
            self.coll("_allgather_base", NCCL_AG, 4_000_000)
            for name, k, d in (("autograd::engine::evaluate_function: MmBackward0", GEMM, 360.0),
                               ("autograd::engine::evaluate_function: MmBackward0", GEMM, 240.0),
                               ("aten::_flash_attention_backward", FLASH, 520.0),
                               ("autograd::engine::evaluate_function: GeluBackward0", ELEMWISE, 60.0),
                               ("autograd::engine::evaluate_function: MmBackward0", GEMM, 440.0)):
                self.op(name, k, d)
                self.cpu_op("aten::view", 1.5)
                self.t += 3.0
            self.coll("_reduce_scatter_base", NCCL_RS, 4_000_000)
            if layer % 6 == 0:
                self.memop(self.rng.choice(("HtoD", "DtoH", "memset")))
        for _ in range(layers):  # optimizer
            self.op("aten::_foreach_add_", ELEMWISE, 30.0, cpu_us=6.0)
        # sync at the step end: the CPU waits for the GPU
        end = max(self.t, *self.gpu.values()) + 20.0
        self.x("cuda_runtime", "cudaDeviceSynchronize", self.pid, self.tid, self.t, end - self.t,
               '{"External id": %d, "cbid": 165, "correlation": %d}' % (self.ext, self.corr))
        self.corr += 1
        self.t = end + 30.0
        self.x("user_annotation", "ProfilerStep#%d" % n, self.pid, self.tid, t0, self.t - t0 - 5.0,
               '{"External id": %d}' % self.ext)
        self.ext += 1


def write_rank(path, rank, world, steps, layers, seed=0):
    tmp = Path(str(path) + ".part")
    with open(tmp, "w") as fh:
        doc_head = {"schemaVersion": 1,
                    "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world},
                    "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85045526528,
                                          "computeMajor": 9, "computeMinor": 0, "numSms": 132}]}
        fh.write(json.dumps(doc_head)[:-1] + ', "traceEvents": [\n')
        w = Writer(fh, rank, world, seed * 1000 + rank)
        w.w('{"name": "process_name", "ph": "M", "ts": %.3f, "pid": %d, "tid": 0, "args": {"name": "python"}}'
            % (w.t, w.pid))
        for s in range(steps):
            w.step(100 + s, layers)
        fh.write('\n], "traceName": "%s", "displayTimeUnit": "ms", "baseTimeNanoseconds": 1700000000000000000}\n'
                 % Path(path).name)
    os.replace(tmp, path)
    return w.n


def _gen_one(args):
    return write_rank(*args)


def scale_dataset(cache: Path, ranks: int, rank_mb: float) -> Path:
    """The synthetic directory (generated on first use, reused after)."""
    layers = 128
    steps = max(2, round(rank_mb / 2.5))  # ~2.5 MB of JSON per 128-layer step
    d = cache / f"scale_v{SCALE_VERSION}_{ranks}x{steps}steps"
    if (d / ".complete").exists():
        return d
    d.mkdir(parents=True, exist_ok=True)
    import multiprocessing as mp

    jobs = [(d / f"rank{r}_trace.json", r, ranks, steps, layers) for r in range(ranks)
            if not (d / f"rank{r}_trace.json").exists()]
    t0 = time.perf_counter()
    with mp.get_context("fork").Pool(min(2, os.cpu_count() or 1)) as pool:
        pool.map(_gen_one, jobs)
    (d / ".complete").write_text("ok\n")
    size = sum(f.stat().st_size for f in d.glob("*.json"))
    print(f"generated {ranks} ranks, {size / 1e6:.0f} MB in {time.perf_counter() - t0:.1f} s -> {d}", flush=True)
    return d


HTA_SCALE = r"""
import json, logging, sys, time, warnings
warnings.filterwarnings("ignore")
from hta.trace_analysis import TraceAnalysis
logging.disable(logging.WARNING)
t0 = time.perf_counter()
ta = TraceAnalysis(trace_dir=sys.argv[1])
ranks = list(ta.t.traces)
t1 = time.perf_counter()
ta.get_temporal_breakdown(visualize=False)
ta.get_comm_comp_overlap(visualize=False)
ta.get_gpu_kernel_breakdown(visualize=False)
ta.get_idle_time_breakdown(ranks=ranks, visualize=False)
ta.get_cuda_kernel_launch_stats(ranks=ranks, visualize=False)
ta.get_queue_length_summary(ranks=ranks)
ta.get_memory_bw_summary(ranks=ranks)
print("RESULT " + json.dumps({"parse_s": t1 - t0, "wall_s": time.perf_counter() - t0}))
"""


def append_csv(path: Path, columns: list, rows: list[dict]) -> None:
    """Appends ``rows`` to ``path`` (a header first when the file is new): runs accumulate."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with open(path, "a", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns)
        if new:
            w.writeheader()
        w.writerows(rows)


def _tree_pss_mib(pid: int) -> float:
    """Proportional set size summed over ``pid`` and its descendants (MiB): pages shared
    by forked workers count once in the sum, where RSS would count them in every process.
    Children come from /proc/PID/task/*/children: a walk of the tree only, so sampling
    costs little CPU."""
    total, todo = 0.0, [pid]
    while todo:
        q = todo.pop()
        try:
            for line in Path(f"/proc/{q}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) / 1024
                    break
            for task in Path(f"/proc/{q}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def timed(cmd: list, env: dict, timeout: float = 3600) -> dict:
    """Wall time (s) and peak process-tree PSS (MiB) of ``cmd``; its RESULT line if any."""
    import threading

    import resource

    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=str(REPO))
    peak = [0.0]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _tree_pss_mib(p.pid))
            done.wait(0.25)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out, err = p.communicate(timeout=timeout)
    wall = time.perf_counter() - t0
    done.set()
    th.join()
    if p.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({p.returncode}):\n{err[-3000:]}")
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime  # the child and its waited-for workers
    res = {"wall_s": wall, "cpu_s": cpu, "peak_pss_mib": peak[0]}
    for line in out.splitlines():
        if line.startswith("RESULT "):  # the child's own clock (imports excluded) replaces wall_s
            res.update(json.loads(line[7:]))
    return res


def _subset_dir(src: Path, n: int, dst: Path) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for r in range(n):
        link = dst / f"rank{r}_trace.json"
        if not link.exists():
            os.symlink(src / f"rank{r}_trace.json", link)
    return dst


def run_scale(args, sha: str):
    cache = Path(os.path.expanduser(args.cache))
    d = scale_dataset(cache, args.ranks, args.rank_mb)
    n_mb = sum(f.stat().st_size for f in d.glob("*.json")) / 1e6
    env = dict(os.environ, PYTHONPATH=str(REPO))
    ours_cmd = lambda path: [sys.executable, "-m", "d9d_kernels.trace", str(path), "--quiet",  # noqa: E731
                             "--no-progress", "--json", os.devnull]
    rows = []

    def row(provider, shape, runs, hta_p50=None, note=""):
        walls = [r["wall_s"] for r in runs]
        peak = max(r["peak_pss_mib"] for r in runs)
        p50 = statistics.median(walls)
        r = {"op": "trace_cli_all_tools" if provider.startswith("d9d") else "hta_parse+7_analyses" + note,
             "provider": provider, "shape": shape, "dtype": "json", "device": f"cpu{os.cpu_count()}",
             "p20": round(pct(walls, 0.2), 3), "p50": round(p50, 3), "p80": round(pct(walls, 0.8), 3),
             "cpu_s_p50": round(statistics.median(r["cpu_s"] for r in runs), 2), "peak_pss_mib": round(peak, 1),
             "ratio_p50_vs_hta": round(hta_p50 / p50, 2) if hta_p50 else "", "git_sha": sha}
        rows.append(r)
        print(", ".join(f"{k}={v}" for k, v in r.items()), flush=True)
        return p50

    with tempfile.TemporaryDirectory() as tmp:
        sub = _subset_dir(d, args.hta_ranks, Path(tmp) / f"first{args.hta_ranks}")
        shape_sub = f"synthetic:{args.hta_ranks}ranks,{n_mb / args.ranks:.0f}MB/rank"
        hta_runs = [timed([sys.executable, "-c", HTA_SCALE, str(sub)], env) for _ in range(args.hta_repeats)]
        hta_p50 = row("hta", shape_sub, hta_runs)
        ours_sub = [timed(ours_cmd(sub), env) for _ in range(args.repeats)]
        row("d9d", shape_sub, ours_sub, hta_p50)
    shape = f"synthetic:{args.ranks}ranks,{n_mb / args.ranks:.0f}MB/rank"
    hta_full = hta_p50 * args.ranks / args.hta_ranks
    rows.append({"op": "hta_parse+7_analyses", "provider": "hta_extrapolated", "shape": shape, "dtype": "json",
                 "device": f"cpu{os.cpu_count()}", "p20": "", "p50": round(hta_full, 1), "p80": "",
                 "cpu_s_p50": "", "peak_pss_mib": "", "ratio_p50_vs_hta": "", "git_sha": sha})
    print(f"hta on {args.ranks} ranks, extrapolated from {args.hta_ranks}: {hta_full:.1f} s", flush=True)
    ours = [timed(ours_cmd(d), env) for _ in range(args.repeats)]
    row("d9d", shape, ours, hta_full)
    append_csv(SCALE_CSV, SCALE_COLUMNS, rows)
    plot_scale(rows)


def plot_scale(rows):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    labels = [f"{r['provider']}\n{r['shape'].split(':')[1].split(',')[0]}" for r in rows]
    vals = [float(r["p50"]) for r in rows]
    colors = ["tab:gray" if r["provider"].startswith("hta") else "tab:blue" for r in rows]
    hatch = ["//" if r["provider"] == "hta_extrapolated" else "" for r in rows]
    bars = ax.bar(range(len(rows)), vals, color=colors)
    for b, h in zip(bars, hatch):
        b.set_hatch(h)
    for i, r in enumerate(rows):
        lo, hi = r["p20"], r["p80"]
        if lo != "" and hi != "":
            ax.plot([i, i], [float(lo), float(hi)], color="k", lw=1)
        ax.text(i, vals[i], f"{vals[i]:.1f} s", ha="center", va="bottom", fontsize=8)
    ax.axhline(60, color="tab:red", ls="--", lw=0.8)
    ax.text(-0.45, 63, "60 s target", color="tab:red", fontsize=7, ha="left")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("wall s (p50; bar p20-p80)")
    ax.set_yscale("log")
    ax.set_title(f"Synthetic {rows[-1]['shape'].split(':')[1]}: our CLI (all tools) vs HTA "
                 "(hatched: extrapolated)", fontsize=9)
    fig.savefig(SCALE_PNG, dpi=90, bbox_inches="tight")
    print(f"wrote {SCALE_PNG}")


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
    ap.add_argument("--scale", action="store_true", help="the synthetic many-rank directory (see module doc)")
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--rank-mb", type=float, default=25.0)
    ap.add_argument("--hta-ranks", type=int, default=8, help="ranks HTA (and ours, for the ratio) run on")
    ap.add_argument("--hta-repeats", type=int, default=1)
    ap.add_argument("--cache", default="~/.cache/d9d_kernels/bench_trace")
    ap.add_argument("--generate-only", action="store_true")
    args = ap.parse_args()
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=REPO).stdout.strip()
    except OSError:
        sha = ""
    if args.generate_only:
        scale_dataset(Path(os.path.expanduser(args.cache)), args.ranks, args.rank_mb)
        return
    if args.scale:
        run_scale(args, sha)
        return
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
    append_csv(CSV, COLUMNS, rows)


if __name__ == "__main__":
    main()
