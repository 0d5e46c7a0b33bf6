"""What does the first ``update`` of a process cost beyond its kernel (#43)?

Question: a process's first ``update`` plans the call (core/plan.py records
it under a TorchDispatchMode) and may import what later calls never need.
Each repeat is a fresh interpreter that imports torch and d9d_kernels, builds
the metric and its inputs (not timed), times its first ``update``, then times
the same ``update`` after warm-up (``harness.measure``: the planned replay of
the same kernel). ``first_minus_warm`` is the difference per process: the
one-off cost of the first call. Cases: a ``WeightedMeanMetric`` and a
``MetricGroup`` holding an ``Accuracy``, CPU, N=1000. Quantiles are over
processes. Writes ``bench/results/bench_first_update.csv``; the printout also
says in how many processes the first update imported ``torch._dynamo``.

    python bench/bench_first_update.py [--quick | --tiny] [--repeats K]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import harness  # noqa: E402

BENCH = "bench_first_update"
N = 1000
CASES = ("WeightedMeanMetric", "MetricGroup[Accuracy]")

# Runs in the fresh interpreter: argv[1] is the case, argv[2] the Timing preset.
CHILD = r"""
import json, sys, time
sys.path.insert(0, {bench!r})
import torch
import d9d_kernels as dk
import harness

case, preset = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(0)
if case == "WeightedMeanMetric":
    m = dk.WeightedMeanMetric()
    inputs = (torch.randn({n}, generator=g), torch.rand({n}, generator=g))
else:
    m = dk.MetricGroup({{"acc": dk.Accuracy(task="multiclass", num_classes=10)}})
    inputs = (torch.randint(0, 10, ({n},), generator=g), torch.randint(0, 10, ({n},), generator=g))
dynamo_before = "torch._dynamo" in sys.modules
t0 = time.perf_counter()
m.update(*inputs)
first = time.perf_counter() - t0
dynamo_after = "torch._dynamo" in sys.modules
warm = harness.measure(lambda: m.update(*inputs), getattr(harness.Timing, preset)()).p50
print(json.dumps({{"first": first, "warm": warm, "dynamo": dynamo_after and not dynamo_before}}))
"""


def run_one(case: str, preset: str) -> dict:
    root = HERE.parent
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = CHILD.format(bench=str(HERE), n=N)
    out = subprocess.run([sys.executable, "-c", code, case, preset], cwd=root, env=env, capture_output=True,
                         text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{BENCH}: {case} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--tiny", action="store_true")
    p.add_argument("--repeats", type=int, default=None, help="fresh processes per case")
    p.add_argument("--out", default=str(harness.RESULTS / f"{BENCH}.csv"))
    a = p.parse_args(argv)
    preset = "tiny" if a.tiny else "quick"  # the warm update is microseconds: quick is enough
    repeats = a.repeats or (2 if a.tiny else 5 if a.quick else 11)
    rows = []
    for case in CASES:
        runs = [run_one(case, preset) for _ in range(repeats)]
        series = {
            "first": [r["first"] for r in runs],
            "warm": [r["warm"] for r in runs],
            "first_minus_warm": [r["first"] - r["warm"] for r in runs],
        }
        for provider, ts in series.items():
            st = harness.stats(ts)
            rows.append(harness.row(BENCH, op=case, provider=provider, shape=f"N={N}", dtype="float32",
                                    device="cpu", stats=st))
            print(f"{BENCH}: {case:22s} {provider:16s} {st.p50 * 1e3:9.3f} ms "
                  f"[p20 {st.p20 * 1e3:.3f}, p80 {st.p80 * 1e3:.3f}] over {len(ts)} processes", flush=True)
        print(f"{BENCH}: {case}: first update imported torch._dynamo in "
              f"{sum(r['dynamo'] for r in runs)}/{len(runs)} processes", flush=True)
    harness.write_csv(a.out, rows)
    print(f"{BENCH}: wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
