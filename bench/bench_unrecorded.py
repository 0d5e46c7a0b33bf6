"""A group with one member whose update cannot be recorded (CPU).

Question: does one member that runs its checked path at every call (an
``add_state`` log-loss, written the torchmetrics way) slow the members that
record? Target (issue #43): the group with it costs <= 1.5x (the group
without it + that member's own torch ops run bare) per step.

Contenders, interleaved in rounds (one ``measure`` each per round; the ratio
is the median of per-round ratios): ``group`` (Accuracy + AUROC, binary),
``group+logloss`` (the same group with the log-loss member), ``logloss_bare``
(the log-loss's torch ops on plain float64 tensors, no metric around them).

    python bench/bench_unrecorded.py [--quick] [--tiny]
    -> bench/results/bench_unrecorded.csv, .png
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import d9d_kernels as dk  # noqa: E402
from bench.harness import RESULTS, Timing, measure, plot, row, write_csv  # noqa: E402


class LogLoss(dk.Metric):
    """Binary log-loss from add_state slots: its update runs checked (it writes with torch ops)."""

    def __init__(self):
        super().__init__()
        self.add_state("total", kind="sum", shape=())
        self.add_state("count", kind="sum", shape=())

    def _update(self, preds, target):
        self.total += _logloss_sum(preds, target)
        self.count += target.numel()

    def _compute(self, state):
        return state["total"] / state["count"]


def _logloss_sum(preds, target):
    p = preds.double().clamp(1e-15, 1 - 1e-15)
    t = target.double()
    return -(t * p.log() + (1 - t) * torch.log1p(-p)).sum()


def _group(with_logloss: bool):
    members = {"acc": dk.Accuracy(task="binary"), "auroc": dk.AUROC(task="binary")}
    if with_logloss:
        members["logloss"] = LogLoss()
    return dk.MetricGroup(members)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "bench_unrecorded.csv"))
    a = ap.parse_args()
    timing = Timing.tiny() if a.tiny else Timing.quick() if a.quick else Timing()
    rounds = 2 if a.tiny else 5 if a.quick else 9
    torch.set_num_threads(1)
    rows, report = [], []
    for n in ((256,) if a.tiny else (256, 4096, 65536)):
        g = torch.Generator().manual_seed(n)
        p, t = torch.rand(n, generator=g), torch.randint(0, 2, (n,), generator=g)
        base, full = _group(False), _group(True)
        total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)

        def bare():
            total.add_(_logloss_sum(p, t))
            count.add_(t.numel())

        fns = {"group": lambda: base.update(preds=p, target=t), "group+logloss": lambda: full.update(preds=p, target=t),
               "logloss_bare": bare}
        per = {k: [] for k in fns}
        for _ in range(rounds):
            for k, fn in fns.items():  # interleaved
                per[k].append(measure(fn, timing))
        ratios = [f.p50 / (b.p50 + l.p50) for f, b, l in zip(per["group+logloss"], per["group"], per["logloss_bare"])]
        for k, sts in per.items():
            med = sorted(sts, key=lambda s: s.p50)[len(sts) // 2]
            rows.append(row("unrecorded", op="group_update", provider=k, shape=f"N={n}", dtype="float32",
                            device="cpu", stats=med))
        report.append((n, statistics.median(ratios), {k: statistics.median(s.p50 for s in v) * 1e6
                                                      for k, v in per.items()}))
        assert full.explain()["logloss"].startswith("checked"), full.explain()
        assert full.explain()["acc"].startswith("recorded"), full.explain()
    out = write_csv(a.out, rows)
    plot(out, Path(a.out).with_suffix(".png"), x="N", title="group update with one unrecorded member (CPU, 1 thread)")
    for n, ratio, us in report:
        parts = ", ".join(f"{k} {v:.1f} us" for k, v in us.items())
        print(f"N={n}: {parts}; group+logloss / (group + logloss_bare) = {ratio:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
