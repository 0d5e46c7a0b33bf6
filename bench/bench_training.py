"""End-to-end step-time overhead of per-step metrics in a small CPU training loop.

Question: how much slower is a training step when the bench_update metric
group (loss mean, accuracy, top-5, macro F1/precision/recall, confusion
matrix) is updated every step (and computed every ``--log-every`` steps),
with d9d_kernels vs torchmetrics (default; fastest settings) vs no metrics?

Target: <= 2 % for d9d_kernels; torchmetrics' is reported.

The loop: an MLP (in 256 -> 1024 -> 1024 -> C), batch 256, SGD, single
process, torch's default intra-op threads. The variants run in interleaved
blocks (rotating order) on the same model so drift and background load hit
all of them alike; the ``p20/p50/p80`` columns are per-step times, and the
``overhead`` in the report is ``p50(variant) / p50(none) - 1``. Rows with
``op=train_step_paired`` pair each variant's block with the baseline's block
of the same round: per round, ``median(block) / median(none block)`` times
the overall ``p50(none)``; their median over rounds minus 1 is the overhead
with slow periods of the machine cancelled (the target's figure). Rows with
``op=metric_code`` time the metric calls alone inside each step (update, and
compute at logging steps); ``p50(metric_code) / p50(none step)`` is a second,
noise-robust overhead figure on a shared machine.

    python bench/bench_training.py [--quick] [--classes 100]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import providers as pv  # noqa: E402

BENCH = "bench_training"
PROVIDERS = ("none", "d9d", "torchmetrics", "torchmetrics_fast")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="smoke test (tests only)")
    p.add_argument("--classes", type=int, nargs="*", default=None, help="default 100 1000 (quick: 100)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--features", type=int, default=256)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 10; quick 8)")
    p.add_argument("--block", type=int, default=None, help="steps per variant per round (default 50; quick 25)")
    p.add_argument("--providers", nargs="*", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--out", default=str(harness.RESULTS / f"{BENCH}.csv"))
    a = p.parse_args(argv)
    if a.tiny:
        a.classes = a.classes or [10]
        a.batch, a.hidden, a.features = 32, 32, 16
        a.rounds, a.block, a.log_every = a.rounds or 1, a.block or 4, 2
    a.classes = a.classes or ([100] if a.quick else [100, 1000])
    # --quick measures the same loop as the full run (fewer steps, C=100 only): with
    # hidden 512 it asked another question (a 2x shorter step, where the cache-cold
    # metric calls after optimizer.step weigh 2.4-3.7 %); a quick run takes ~30 s
    a.rounds = a.rounds or (8 if a.quick else 10)
    a.block = a.block or (25 if a.quick else 50)
    if "none" not in a.providers:
        a.providers = ["none"] + list(a.providers)
    return a


class Loop:
    """The training loop with one metrics variant plugged in."""

    def __init__(self, a, C: int):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(a.features, a.hidden), torch.nn.ReLU(),
            torch.nn.Linear(a.hidden, a.hidden), torch.nn.ReLU(),
            torch.nn.Linear(a.hidden, C),
        )
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        g = torch.Generator().manual_seed(1)
        n = a.batch * 8
        self.x = torch.randn(n, a.features, generator=g)
        self.y = torch.randint(0, C, (n,), generator=g)
        self.batch, self.i, self.C, self.log_every = a.batch, 0, C, a.log_every

    def step(self, metrics) -> float:
        """One training step; returns the seconds spent in the metric code."""
        lo = (self.i % 8) * self.batch
        x, y = self.x[lo : lo + self.batch], self.y[lo : lo + self.batch]
        self.i += 1
        logits = self.model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        if metrics is None:
            return 0.0
        t = time.perf_counter()
        metrics.update(logits.detach(), y, loss.detach(), y.numel())
        if self.i % self.log_every == 0:
            float(metrics.compute()["loss"])  # what logging does
        return time.perf_counter() - t


def run(a, C: int) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, list[float]]]:
    """Per-step times, per-step metric-code times and per-round block medians of every variant."""
    loop = Loop(a, C)
    groups = {p: (None if p == "none" else pv.make_update_group(p, C)) for p in a.providers}
    for p in a.providers:  # warm-up block each
        for _ in range(max(3, a.block // 5)):
            loop.step(groups[p])
    times = {p: [] for p in a.providers}
    mtimes = {p: [] for p in a.providers}
    rounds = {p: [] for p in a.providers}
    n = len(a.providers)
    for r in range(a.rounds):
        order = a.providers[r % n :] + a.providers[: r % n]
        for p in order:
            g = groups[p]
            for _ in range(a.block):
                t = time.perf_counter()
                mtimes[p].append(loop.step(g))
                times[p].append(time.perf_counter() - t)
            rounds[p].append(statistics.median(times[p][-a.block:]))
    return times, mtimes, rounds


def main(argv=None) -> int:
    a = parse(argv)
    rows = []
    for C in a.classes:
        times, mtimes, rounds = run(a, C)
        base = harness.stats(times["none"]).p50
        shape = f"C={C},N={a.batch},hidden={a.hidden}"
        for p, ts in times.items():
            st = harness.stats(ts)
            rows.append(harness.row(BENCH, op="train_step", provider=p, shape=shape,
                                    dtype="float32", device="cpu", stats=st))
            msg = ""
            if p != "none":
                # time inside the metric code per step: robust to a busy machine
                ms = harness.stats(mtimes[p])
                rows.append(harness.row(BENCH, op="metric_code", provider=p, shape=shape,
                                        dtype="float32", device="cpu", stats=ms))
                paired = harness.stats([base * m / m0 for m, m0 in zip(rounds[p], rounds["none"])])
                rows.append(harness.row(BENCH, op="train_step_paired", provider=p, shape=shape,
                                        dtype="float32", device="cpu", stats=paired))
                msg = f"  paired by round {100 * (paired.p50 / base - 1):+6.2f} %"
                mean = sum(mtimes[p]) / len(mtimes[p])
                msg += f"  metric code p50 {ms.p50 * 1e3:.3f} ms, mean {mean * 1e3:.3f} ms ({100 * mean / base:.2f} % of a step)"
            print(f"{BENCH}: C={C:<5d} {p:<18s} step {st.p50 * 1e3:8.3f} ms [p20 {st.p20 * 1e3:.3f}, "
                  f"p80 {st.p80 * 1e3:.3f}]  overhead {100 * (st.p50 / base - 1):+6.2f} %{msg}", flush=True)
    harness.write_csv(a.out, rows)
    print(f"{BENCH}: wrote {a.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
