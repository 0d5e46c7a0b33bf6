"""Per catalogue class: a standalone ``update`` against the op calls it makes.

For every metric class ``d9d_kernels`` exports (standalone, hot, C = 10,
B = 256 rows; regression and aggregation: 256 values), one ``update`` is
recorded under a ``TorchDispatchMode``: the ``d9d_kernels`` op calls it
makes (``ops``) and every dispatched op (``all_ops``: the kernels plus the
torch ops the metric's Python issues, e.g. a ``reshape`` or a cast). The
contenders, interleaved in the same rounds:

* ``update``: ``m.update(*inputs)``, the way users call it (new input
  tensors at each call, from a ring of four copies);
* ``ops``: the recorded ``d9d_kernels`` calls replayed with the same
  arguments (the floor of a metric built on the kernels);
* ``all_ops``: every recorded op replayed (the floor of any implementation
  that issues the same work; a metric with no kernel of its own is measured
  against it).

The row's ``ratio`` is ``update`` over ``all_ops``; the target is
``ratio <= 2`` (the Python around the work at most as much as the work).

Usage: ``python bench/bench_catalogue.py [--quick] [--out bench/results/bench_catalogue.csv]``
"""

from __future__ import annotations

import argparse
import csv
import datetime
import itertools
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import d9d_kernels as dk  # noqa: E402
from d9d_kernels.core.plan import _Recorder as Recorder  # noqa: E402  (what an update plan is recorded from)
from bench_update import interleaved  # noqa: E402
from harness import git_sha  # noqa: E402

C, B = 10, 256
TARGET = 2.0


def cases() -> dict:
    """``{class name: (constructor kwargs, update inputs)}`` for every exported metric class."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, C, generator=g)
    labels = torch.randint(0, C, (B,), generator=g)
    prob = torch.rand(B, generator=g)
    binary = torch.randint(0, 2, (B,), generator=g)
    x = torch.randn(B, generator=g)
    y = x + 0.3 * torch.randn(B, generator=g)
    pos, pos_t = x.abs() + 0.1, y.abs() + 0.1
    dist_p = torch.softmax(torch.randn(B // C, C, generator=g), 1)
    dist_q = torch.softmax(torch.randn(B // C, C, generator=g), 1)
    seg_p = torch.randint(0, C, (1, 16, 16), generator=g)
    seg_t = torch.randint(0, C, (1, 16, 16), generator=g)
    one_hot = lambda t: torch.nn.functional.one_hot(t, C).permute(0, 3, 1, 2).contiguous()  # noqa: E731
    mc = dict(task="multiclass", num_classes=C)
    bi = dict(task="binary")
    cls = (logits, labels)
    out = {}
    for name in ("Accuracy", "CohenKappa", "ConfusionMatrix", "F1Score", "HammingDistance", "JaccardIndex",
                 "MatthewsCorrCoef", "Precision", "Recall", "Specificity", "StatScores", "NegativePredictiveValue",
                 "CalibrationError"):
        out[name] = (mc, cls)
    out["FBetaScore"] = (dict(mc, beta=2.0), cls)
    out["ExactMatch"] = (dict(task="multilabel", num_labels=C), ((logits > 0).long(), (labels[:, None] == 0).long()
                                                                  .expand(B, C).contiguous()))
    for name in ("AUROC", "AveragePrecision", "ROC", "PrecisionRecallCurve"):
        out[name] = (bi, (prob, binary))
    out["LogAUC"] = (bi, (prob, binary))
    out["PrecisionAtFixedRecall"] = (dict(bi, min_recall=0.5), (prob, binary))
    out["RecallAtFixedPrecision"] = (dict(bi, min_precision=0.5), (prob, binary))
    out["SensitivityAtSpecificity"] = (dict(bi, min_specificity=0.5), (prob, binary))
    out["SpecificityAtSensitivity"] = (dict(bi, min_sensitivity=0.5), (prob, binary))
    out["Perplexity"] = ({}, (logits[None], labels[None]))
    for name in ("ConcordanceCorrCoef", "ExplainedVariance", "LogCoshError", "MeanAbsoluteError", "MeanSquaredError",
                 "NormalizedRootMeanSquaredError", "PearsonCorrCoef", "R2Score", "RelativeSquaredError",
                 "SymmetricMeanAbsolutePercentageError", "WeightedMeanAbsolutePercentageError",
                 "MeanAbsolutePercentageError"):
        out[name] = ({}, (x, y))
    out["CriticalSuccessIndex"] = (dict(threshold=0.5), (x, y))
    out["MinkowskiDistance"] = (dict(p=3.0), (x, y))
    out["MeanSquaredLogError"] = ({}, (pos, pos_t))
    out["TweedieDevianceScore"] = (dict(power=1.5), (pos, pos_t))
    out["CosineSimilarity"] = ({}, (dist_p, dist_q))
    out["KLDivergence"] = ({}, (dist_p, dist_q))
    out["JensenShannonDivergence"] = ({}, (dist_p, dist_q))
    for name in ("DiceScore", "GeneralizedDiceScore", "MeanIoU"):
        out[name] = (dict(num_classes=C, input_format="index"), (seg_p, seg_t))
    out["Dice"] = (dict(num_classes=C), (one_hot(seg_p), one_hot(seg_t)))
    for name in ("SumMetric", "MeanMetric", "MaxMetric", "MinMetric", "WeightedMeanMetric", "RunningMean",
                 "RunningSum"):
        out[name] = ({"window": 5} if name.startswith("Running") else {}, (x,))
    out["Running"] = (dict(base_metric=dk.SumMetric(), window=5), (x,))
    out["ExponentialMovingAverage"] = (dict(decay=0.9), (x,))
    out["ExpertLoad"] = (dict(num_experts=C, num_layers=2, top_k=2), (torch.randint(-1, C, (2, B, 2), generator=g),))
    out[None] = [(mc, cls), ({}, (x, y)), (bi, (prob, binary)), ({}, (x,))]  # tried in turn for any other class
    return out


def make(name: str, made: dict):
    """``(metric, inputs)`` of class ``name``: its case, else the first generic one it takes."""
    for kwargs, inputs in [made[name]] if name in made else made[None]:
        try:
            m = getattr(dk, name)(**kwargs)
            m.update(*inputs)
            return m, inputs
        except (TypeError, ValueError):
            continue
    raise SystemExit(f"bench_catalogue: no case for {name}; add one to cases()")


def replay(calls):
    def run():
        for func, args, kwargs, _ in calls:
            func(*args, **kwargs)

    return run


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="", help="comma-separated class names")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_catalogue.csv"))
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    rounds, min_s = (5, 0.01) if a.quick else (15, 0.03)
    only = set(filter(None, a.only.split(",")))
    rows = []
    made = cases()
    exported = sorted(n for n in dir(dk) if isinstance(getattr(dk, n), type) and issubclass(getattr(dk, n), dk.Metric)
                      and n not in ("Metric", "MetricGroup"))
    built = {name: make(name, made) for name in exported}  # every class has a case
    for name in exported:
        if only and name not in only:
            continue
        m, inputs = built[name]
        # new input tensors at every call, as a training loop passes them (a metric
        # may memoise work on the last inputs it saw, e.g. CalibrationError's binning)
        ring = itertools.cycle([tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)
                                for _ in range(4)])
        for _ in range(4):
            m.update(*next(ring))
        fresh = tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in inputs)
        rec = Recorder()
        with rec:
            m.update(*fresh)
        kernels = [c for c in rec.calls if c[0].namespace == "d9d_kernels"]
        fns = {"update": lambda: m.update(*next(ring)), "all_ops": replay(rec.calls)}
        if kernels:
            fns["ops"] = replay(kernels)
        times = interleaved(fns, rounds, min_s)
        med = {k: statistics.median(v) for k, v in times.items()}
        floor = med["all_ops"]
        rows.append({"metric": name, "update_us": round(med["update"] * 1e6, 2),
                     "ops_us": round(med["ops"] * 1e6, 2) if "ops" in med else "",
                     "all_ops_us": round(med["all_ops"] * 1e6, 2),
                     "kernels": "+".join(sorted({str(c[0].name()).split("::")[1].split(".")[0] for c in kernels})),
                     "n_ops": len(rec.calls), "ratio": round(med["update"] / floor, 2),
                     "target": TARGET, "ok": med["update"] / floor <= TARGET,
                     "rounds": rounds, "threads": 1, "machine": os.uname().nodename})
        print(f"{name:40s} update {rows[-1]['update_us']:8.1f} us  ops {rows[-1]['ops_us']!s:>8} us  "
              f"all {rows[-1]['all_ops_us']:8.1f} us  x{rows[-1]['ratio']:5.2f}  {rows[-1]['kernels']}", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"git_sha": git_sha(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[*rows[0], *stamp])
        w.writeheader()
        w.writerows({**r, **stamp} for r in rows)
    bad = [r["metric"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} within {TARGET}x; over: {bad}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
