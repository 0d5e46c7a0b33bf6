"""The main job: ``make demo`` == ``python examples/demo.py``.

A 2-rank gloo training job (spawned on 127.0.0.1, free port, timeouts: it
never hangs) of a small MLP classifier on synthetic data with UNEVEN shards
(each rank has a different shard size and batch size, epochs end on ragged
batches). A ``dk.MetricGroup`` — loss (WeightedMeanMetric), accuracy, top-5
accuracy, macro F1, multiclass AUROC, max grad norm (MaxMetric) and the
sample count (SumMetric) — is updated every step and synced every
``--log-every`` steps asynchronously::

    g.trigger_sync(ctx)      # logging step: launch the coalesced all_reduce(s)
    ...next training step... # the communication overlaps with it
    g.wait_sync(ctx); g.compute()

Rank 0 prints a table row per logging step under a tqdm progress bar. Then,
in the same run, the same loop is timed with no metrics, with torchmetrics
(MetricCollection, its defaults) and with d9d_kernels, in interleaved blocks;
the summary reports median step times and the overhead of each, checks the
final d9d values against torchmetrics fed the same batches, and says where
the results were written (``out/demo/metrics.jsonl``, ``out/demo/summary.json``).

Flags: ``--steps``, ``--world-size``, ``--quick`` (a few seconds of work, for
tests), ``--log-every``, ``--out``, ``--timeout``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

NUM_CLASSES = 20
FEATURES = 128
HIDDEN = 512
# AUROC histogram [2, C, bins] float64 = 3.2 MB at C=20. 10k bins give the
# documented 1e-3 resolution (softmax scores of an untrained model sit near
# 1/C, where coarser bins lose it); C stays small so that the histogram's
# snapshot and sync do not dominate the logging steps.
AUROC_BINS = 10_000
# exact-count metrics must agree to float32 rounding; binned AUROC to 1e-3 (docs/metrics.md)
TOL = {"auroc": 1e-3}
TOL_DEFAULT = 1e-5
KEYS = ("loss", "acc", "top5", "f1", "auroc", "gnorm_max", "samples")


# ----------------------------------------------------------------------------- setup
def _parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python examples/demo.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="training steps of the logged run (default 300; quick 40)")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--log-every", type=int, default=None, help="sync + log every N steps (default 25; quick 10)")
    p.add_argument("--quick", action="store_true", help="tiny run for tests/CI (a few seconds of work)")
    p.add_argument("--out", default="out/demo", help="output directory (default out/demo)")
    p.add_argument("--timeout", type=float, default=900.0, help="kill the job after this many seconds")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.steps is None:
        a.steps = 40 if a.quick else 300
    if a.log_every is None:
        a.log_every = 10 if a.quick else 25
    # overhead measurement: rounds x (block steps per variant), variants interleaved
    a.rounds, a.block = (2, 15) if a.quick else (6, 50)
    if a.world_size < 1 or a.steps < 1 or a.log_every < 1:
        p.error("--world-size, --steps and --log-every must be >= 1")
    return a


class Shard:
    """This rank's shard of a synthetic Gaussian-mixture classification set.

    Shard sizes and batch sizes differ per rank (uneven shards); iteration is
    epoch-wise with a ragged last batch, reshuffled each epoch.
    """

    def __init__(self, rank: int, seed: int):
        g = torch.Generator().manual_seed(seed)  # same class centres on every rank
        centres = torch.randn(NUM_CLASSES, FEATURES, generator=g) * 0.35
        g = torch.Generator().manual_seed(seed + 1000 + rank)
        self.n = 6000 + 2345 * rank
        self.batch = 96 + 32 * rank
        self.y = torch.randint(0, NUM_CLASSES, (self.n,), generator=g)
        self.x = centres[self.y] + torch.randn(self.n, FEATURES, generator=g)
        self.g = g
        self._order, self._pos = torch.randperm(self.n, generator=g), 0

    def next(self):
        if self._pos >= self.n:
            self._order, self._pos = torch.randperm(self.n, generator=self.g), 0
        idx = self._order[self._pos : self._pos + self.batch]
        self._pos += self.batch
        return self.x[idx], self.y[idx]


def _d9d_group():
    import d9d_kernels as dk

    kw = dict(task="multiclass", num_classes=NUM_CLASSES)
    return dk.MetricGroup(
        {
            "loss": dk.WeightedMeanMetric(),
            "acc": dk.Accuracy(**kw, average="micro"),
            "top5": dk.Accuracy(**kw, average="micro", top_k=5),
            "f1": dk.F1Score(**kw, average="macro"),
            "auroc": dk.AUROC(**kw, num_bins=AUROC_BINS),
            "gnorm_max": dk.MaxMetric(),
            "samples": dk.SumMetric(),
        },
        device="cpu",
    )


class _TM:
    """The same metrics with torchmetrics (AUROC exact: thresholds=None).

    ``compute_groups=False``: torchmetrics' default automatic compute groups
    compare states after the first batch, and top-k accuracy's states equal
    top-1 F1's whenever the first batch has as many top-5 as top-1 hits
    (e.g. an untrained model): it then merges them and reports top-1 accuracy
    as top-5 for the rest of the run (seen with torchmetrics 1.9.0 here).
    """

    def __init__(self):
        warnings.filterwarnings("ignore", module="torchmetrics")
        from torchmetrics import MaxMetric, MeanMetric, MetricCollection, SumMetric
        from torchmetrics.classification import MulticlassAccuracy, MulticlassAUROC, MulticlassF1Score

        C = NUM_CLASSES
        self.loss, self.gnorm, self.samples = MeanMetric(), MaxMetric(), SumMetric()
        self.col = MetricCollection(
            {
                "acc": MulticlassAccuracy(num_classes=C, average="micro"),
                "top5": MulticlassAccuracy(num_classes=C, average="micro", top_k=5),
                "f1": MulticlassF1Score(num_classes=C, average="macro"),
                "auroc": MulticlassAUROC(num_classes=C, average="macro"),
            },
            compute_groups=False,
        )

    def update(self, logits, y, loss, n, gnorm):
        self.loss.update(loss, n)
        self.gnorm.update(gnorm)
        self.samples.update(float(n))
        self.col.update(logits, y)

    def compute(self):
        out = {"loss": self.loss.compute(), "gnorm_max": self.gnorm.compute(), "samples": self.samples.compute()}
        out.update(self.col.compute())
        return out

    def reset(self):
        for m in (self.loss, self.gnorm, self.samples, self.col):
            m.reset()


def _d9d_update(g, logits, y, loss, n, gnorm):
    g["loss"].update(values=loss, weights=n)
    g["gnorm_max"].update(values=gnorm)
    g["samples"].update(values=float(n))
    g.update(preds=logits, target=y)


# ----------------------------------------------------------------------- the worker
class _Trainer:
    def __init__(self, rank: int, seed: int):
        from torch.nn.parallel import DistributedDataParallel as DDP

        torch.manual_seed(seed)  # same init on every rank
        self.model = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, NUM_CLASSES),
        )
        self.ddp = DDP(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.05, momentum=0.9)
        self.data = Shard(rank, seed)

    def step(self):
        x, y = self.data.next()
        logits = self.ddp(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=5.0)
        self.opt.step()
        return logits.detach(), y, loss.detach(), y.numel(), gnorm


def _fmt_row(step, vals, wait_ms) -> str:
    return (
        f"{step:>6d} {int(vals['samples']):>9d} {vals['loss']:>7.4f} {vals['acc']:>7.4f} {vals['top5']:>7.4f} "
        f"{vals['f1']:>7.4f} {vals['auroc']:>7.4f} {vals['gnorm_max']:>9.3f} {wait_ms:>8.2f}"
    )


HEADER = f"{'step':>6} {'samples':>9} {'loss':>7} {'acc':>7} {'top5':>7} {'f1':>7} {'auroc':>7} {'gnorm_max':>9} {'wait_ms':>8}"


def _logged_run(rank, world, args, tr: _Trainer, ctx, out_dir: Path):
    """Phase 1: the training run with d9d metrics, async sync every N steps."""
    from tqdm import tqdm

    g = _d9d_group()
    ref = _TM()  # reference only: fed the same batches, checked at the end
    rows = []
    bar = tqdm(total=args.steps, desc=f"train ({world} ranks)", disable=rank != 0, dynamic_ncols=True, file=sys.stderr, leave=False)
    if rank == 0:
        tqdm.write(HEADER)
    pending = None
    t0 = time.perf_counter()

    def finish(step):
        tw = time.perf_counter()
        g.wait_sync(ctx)
        wait_ms = (time.perf_counter() - tw) * 1e3
        vals = {k: float(v) for k, v in g.compute().items()}  # host read: logging steps only
        rows.append({"step": step, "time_s": round(time.perf_counter() - t0, 4), "sync_wait_ms": round(wait_ms, 3), **vals})
        if rank == 0:
            tqdm.write(_fmt_row(step, vals, wait_ms))

    for step in range(1, args.steps + 1):
        logits, y, loss, n, gnorm = tr.step()
        _d9d_update(g, logits, y, loss, n, gnorm)
        ref.update(logits, y, loss, n, gnorm)
        if pending is not None:  # the previous sync overlapped with this step's work
            finish(pending)
            pending = None
        if step % args.log_every == 0 or step == args.steps:
            g.trigger_sync(ctx)
            pending = step
        bar.update(1)
    if pending is not None:
        finish(pending)
    bar.close()
    final = rows[-1]
    ref_vals = {k: float(v) for k, v in ref.compute().items()}
    return rows, final, ref_vals


def _timed_variant(kind, tr: _Trainer, steps: int, log_every: int, ctx, state):
    """Runs ``steps`` training steps with metrics ``kind``.

    Returns (per-step seconds, per-step seconds spent in the metric code).
    The metrics are reset (untimed) at the start of each block, so that
    torchmetrics' exact AUROC (which stores every score) stays bounded.
    """
    times, mtimes = [], []
    g = state.get(kind)
    if g is not None:
        g.reset()
    pending = False
    for step in range(1, steps + 1):
        t = time.perf_counter()
        logits, y, loss, n, gnorm = tr.step()
        tm = time.perf_counter()
        if kind == "d9d":
            _d9d_update(g, logits, y, loss, n, gnorm)
            if pending:
                g.wait_sync(ctx)
                vals = g.compute()
                float(vals["loss"])  # what logging does: read the values
                pending = False
            if step % log_every == 0:
                g.trigger_sync(ctx)
                pending = True
        elif kind == "torchmetrics":
            g.update(logits, y, loss, n, gnorm)
            if step % log_every == 0:
                vals = g.compute()  # torchmetrics syncs inside compute(), blocking
                float(vals["loss"])
        end = time.perf_counter()
        times.append(end - t)
        mtimes.append(end - tm)
    if pending:
        g.wait_sync(ctx)
        g.compute()
    return times, mtimes


def _overhead(rank, args, tr: _Trainer, ctx):
    """Phase 2: the same loop with no metrics / torchmetrics / d9d, interleaved blocks."""
    from tqdm import tqdm

    variants = ("none", "torchmetrics", "d9d")
    state = {"d9d": _d9d_group(), "torchmetrics": _TM()}
    times: dict[str, list[float]] = {v: [] for v in variants}
    mtimes: dict[str, list[float]] = {v: [] for v in variants}
    total = {v: 0.0 for v in variants}
    bar = tqdm(total=args.rounds * len(variants), desc="overhead", disable=rank != 0, dynamic_ncols=True, file=sys.stderr, leave=False)
    # one warm-up block each (first calls allocate, torchmetrics finds compute groups)
    for v in variants:
        _timed_variant(v, tr, max(2, args.log_every + 1), args.log_every, ctx, state)
    for r in range(args.rounds):
        order = variants[r % 3 :] + variants[: r % 3]
        for v in order:
            ts, ms = _timed_variant(v, tr, args.block, args.log_every, ctx, state)
            times[v] += ts
            mtimes[v] += ms
            total[v] += sum(ts)
            bar.update(1)
    bar.close()
    out = {}
    base_med = statistics.median(times["none"])
    base_mean = total["none"] / len(times["none"])
    for v in variants:
        ts = sorted(times[v])
        q = lambda p: ts[min(len(ts) - 1, int(p * len(ts)))]  # noqa: E731
        med, mean = statistics.median(ts), total[v] / len(ts)
        out[v] = {
            "steps": len(ts),
            "median_ms": med * 1e3,
            "p20_ms": q(0.2) * 1e3,
            "p80_ms": q(0.8) * 1e3,
            "mean_ms": mean * 1e3,
            "overhead_median_pct": (med / base_med - 1) * 100,
            "overhead_mean_pct": (mean / base_mean - 1) * 100,
            # time inside the metric code itself (update, and at logging steps
            # sync + compute), relative to a no-metrics step: robust to the
            # step-time noise of a shared machine
            "metric_code_median_ms": statistics.median(mtimes[v]) * 1e3,
            "metric_code_mean_ms": sum(mtimes[v]) / len(mtimes[v]) * 1e3,
            "metric_code_mean_pct": sum(mtimes[v]) / len(mtimes[v]) / base_med * 100,
        }
    return out


def _rank_main(rank, world, args):
    """One rank of the demo (``d9d_kernels.spawn``: gloo already initialised)."""
    import d9d_kernels as dk

    ctx = dk.DistributedContext()
    out_dir = Path(args.out)
    tr = _Trainer(rank, args.seed)
    rows, final, ref_vals = _logged_run(rank, world, args, tr, ctx, out_dir)
    overhead = _overhead(rank, args, tr, ctx)
    shard = {"rank": rank, "shard_size": tr.data.n, "batch": tr.data.batch}
    return {"rows": rows, "final": final, "ref": ref_vals, "overhead": overhead, "shard": shard}


# ------------------------------------------------------------------------ the parent
def _check(final: dict, ref: dict) -> list[dict]:
    out = []
    for k in KEYS:
        a, b = final[k], ref[k]
        tol = TOL.get(k, TOL_DEFAULT) * max(1.0, abs(b))
        ok = math.isfinite(a) and abs(a - b) <= tol
        out.append({"metric": k, "d9d": a, "torchmetrics": b, "abs_diff": abs(a - b), "tol": tol, "ok": ok})
    return out


def _summary(args, res: dict, started: float) -> tuple[dict, str]:
    r0 = res[0]
    ov = r0["overhead"]
    checks = _check(r0["final"], r0["ref"])
    lines = ["", "== summary " + "=" * 60]
    shards = ", ".join(f"rank {s['shard']['rank']}: {s['shard']['shard_size']} samples, batch {s['shard']['batch']}" for s in res.values())
    lines.append(f"uneven shards: {shards}")
    lines.append(
        f"step-time overhead, rank 0, {ov['none']['steps']} steps per variant "
        f"(interleaved blocks, sync every {args.log_every} steps):"
    )
    lines.append(f"  {'metrics':<14}{'metric code ms/step':>21}{'overhead':>10}   |{'step ms median':>15}{'p20':>8}{'p80':>8}"
                 f"{'vs none':>9}")
    for v in ("none", "torchmetrics", "d9d"):
        o = ov[v]
        name = {"none": "none", "torchmetrics": "torchmetrics", "d9d": "d9d_kernels"}[v]
        lines.append(
            f"  {name:<14}{o['metric_code_mean_ms']:>21.3f}{o['metric_code_mean_pct']:>+9.2f}%   |"
            f"{o['median_ms']:>15.3f}{o['p20_ms']:>8.3f}{o['p80_ms']:>8.3f}{o['overhead_median_pct']:>+8.2f}%"
        )
    lines.append("  overhead = mean time inside the metric calls per step (updates, and at logging steps sync +")
    lines.append("  compute) / median step without metrics. The step medians on the right carry the noise of")
    lines.append("  2 gloo ranks sharing this machine's cores (p20-p80 spans ~2x): their difference is noise-bound.")
    lines.append(f"final global metrics ({args.world_size} ranks) vs torchmetrics on the same batches:")
    for c in checks:
        lines.append(
            f"  {c['metric']:<10} d9d {c['d9d']:>14.6f}  torchmetrics {c['torchmetrics']:>14.6f}  "
            f"|diff| {c['abs_diff']:.2e}  {'OK' if c['ok'] else 'MISMATCH (tol %.1e)' % c['tol']}"
        )
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, torch {torch.__version__}, CPU only".strip(),
        "world_size": args.world_size,
        "steps": args.steps,
        "log_every": args.log_every,
        "quick": args.quick,
        "shards": [res[r]["shard"] for r in sorted(res)],
        "step_time": ov,
        "check": checks,
        "all_match": all(c["ok"] for c in checks),
        "wall_s": round(time.perf_counter() - started, 2),
    }
    return summary, "\n".join(lines)


def main(argv=None) -> int:
    args = _parse(argv)
    started = time.perf_counter()
    from d9d_kernels.spawn import spawn_gloo

    threads = max(1, (os.cpu_count() or 2) // args.world_size)
    out = spawn_gloo(_rank_main, args.world_size, args, timeout=args.timeout, pg_timeout=120,
                     threads=threads, stop_on_error=True)
    res: dict = {r: v for r, (status, v) in out.items() if status == "ok"}
    errors = {r: v for r, (status, v) in out.items() if status == "error"}
    if errors or len(res) < args.world_size:
        for r, m in sorted(errors.items()):
            print(f"[rank {r}] {m}", file=sys.stderr)
        missing = sorted(r for r, (status, _) in out.items() if status == "timeout")
        if missing:
            print(f"demo: ranks {missing} did not finish within {args.timeout:.0f}s (killed)", file=sys.stderr)
        return 1
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary, text = _summary(args, res, started)
    with open(out_dir / "metrics.jsonl", "w") as f:
        for row in res[0]["rows"]:
            f.write(json.dumps(row) + "\n")
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(text)
    print(f"results: {out_dir / 'metrics.jsonl'} (one line per logging step), {out_dir / 'summary.json'}")
    print(f"wall time {summary['wall_s']:.1f}s")
    if not summary["all_match"]:
        print("demo: d9d_kernels and torchmetrics DISAGREE (see above)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
