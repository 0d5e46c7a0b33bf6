"""Where does a d9d_kernels update / sync spend its time? One layer added at a time.

Not a benchmark of peers (see bench_update.py / bench_sync.py): it times the
raw compiled op, then each Python layer above it, so that a missed target can
be routed to the layer that costs it (bench/analysis.md).

    python bench/profile_layers.py update [--shapes 10x32 1000x32 10x65536]
    python bench/profile_layers.py sync [--ks 1 16 64] [--world 2]

Prints p10 / p50 in µs per call (p10: least disturbed by other load).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import providers as pv  # noqa: E402


def _p(f, n: int) -> tuple[float, float]:
    f()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return round(ts[len(ts) // 10] * 1e6, 1), round(ts[len(ts) // 2] * 1e6, 1)


def update_layers(shapes: list[str]) -> None:
    import d9d_kernels as dk

    for s in shapes:
        C, N = (int(v) for v in s.split("x"))
        n = max(5, min(3000, int(2e8 / (N * C + 1e5))))
        logits, target, loss, nn = pv.update_inputs(N, C)
        d = pv.make_update_group("d9d", C)
        pt = pv.make_update_group("plain_torch", C)
        f64 = dict(dtype=torch.float64)
        stats, ex, bad, cm = torch.zeros(2, 3, C, **f64), torch.zeros(2, **f64), torch.zeros(2, **f64), torch.zeros(C, C, **f64)
        wm, wb = torch.zeros(9, **f64), torch.zeros(1, **f64)
        x, w = loss.reshape(1), torch.full((1,), float(nn))
        k = min(5, C)
        rows = {
            "raw op class_stats (top-1, top-k, confmat)": lambda: torch.ops.d9d_kernels.class_stats(
                logits, target, None, C, None, [1, k] if k > 1 else [1], False, stats[: 2 if k > 1 else 1], cm, ex, bad),
            "dk.ops.class_stats wrapper": lambda: dk.ops.class_stats(
                logits, target, None, num_classes=C, stats=stats[: 2 if k > 1 else 1], extras=ex, bad=bad, confmat=cm,
                top_ks=(1, k) if k > 1 else (1,)),
            "MetricGroup.update(preds, target) (6 members)": lambda: d.g.update(preds=logits, target=target),
            "raw op weighted_moments": lambda: torch.ops.d9d_kernels.weighted_moments(x, None, w, None, False, wm, wb, None),
            "WeightedMeanMetric.update(values, weights=int)": lambda: d.loss.update(values=loss, weights=nn),
            "d9d: whole step update": lambda: d.update(logits, target, loss, nn),
            "plain torch: whole step update": lambda: pt.update(logits, target, loss, nn),
        }
        print(f"C={C} N={N} ({n} calls)")
        for name, f in rows.items():
            p10, p50 = _p(f, n)
            print(f"  {name:<50s} p10 {p10:>10.1f}  p50 {p50:>10.1f} us")


def gather_reduce(buf, n_sum: int, world: int):
    """The one-collective alternative for small states: gather every rank's packed
    [sum | max] buffer, reduce locally (sum over ranks, max over ranks)."""
    import torch.distributed as dist

    out = torch.empty(world * buf.numel(), dtype=buf.dtype)
    dist.all_gather_into_tensor(out, buf)
    v = out.view(world, -1)
    return v[:, :n_sum].sum(0), v[:, n_sum:].amax(0)


def _sync_rank(rank, world, ks):
    import torch.distributed as dist

    import d9d_kernels as dk

    torch.set_num_threads(1)
    lg, tg, loss, n = pv.update_inputs(64, pv.SYNC_C, seed=rank)
    out = {}

    def rec(f, reps=60):
        ts = []
        for i in range(reps + 5):
            dist.barrier()
            t = time.perf_counter()
            f()
            if i >= 5:
                ts.append(time.perf_counter() - t)
        ts.sort()
        return round(ts[len(ts) // 10] * 1e6), round(ts[len(ts) // 2] * 1e6)

    def split(g, rec):
        ts = []
        for i in range(65):
            dist.barrier()
            t = time.perf_counter()
            g.g.trigger_sync(None)
            if i >= 5:
                ts.append(time.perf_counter() - t)
            g.g.wait_sync(None)
        ts.sort()
        return round(ts[len(ts) // 10] * 1e6), round(ts[len(ts) // 2] * 1e6)

    for K in ks:
        g = pv.make_sync_group("d9d", K)
        g.update(lg, tg, loss, n)
        local = g.g._storage.local
        nb = sum(local[k].numel() for k in ("sum", "max"))
        raw = torch.zeros(nb, dtype=torch.float64)
        ctx = dk.DistributedContext()
        half = max(1, nb // 2)
        out[K] = {
            "buffers (doubles)": {k: v.numel() for k, v in local.items()},
            "raw: one all_reduce of our bytes": rec(lambda: dist.all_reduce(raw)),
            "raw: two async all_reduces (sum + max)": rec(lambda: [h.wait() for h in (
                dist.all_reduce(raw[:half], async_op=True),
                dist.all_reduce(raw[half:], op=dist.ReduceOp.MAX, async_op=True))]),
            "raw: ONE all_gather of [sum|max] + local reduce": rec(lambda: gather_reduce(raw, half, world)),
            "DistributedContext.all_reduce + wait": rec(lambda: ctx.all_reduce(raw, "sum").wait()),
            "ours: trigger_sync alone (wait untimed)": split(g, rec),
            "ours: trigger_sync + wait_sync": rec(lambda: (g.g.trigger_sync(None), g.g.wait_sync(None))),
            "ours: compute() after the sync": rec(lambda: g.g.compute()),
        }
    return out


def sync_layers(ks: list[int], world: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from dist_utils import run_distributed

    res = run_distributed(_sync_rank, world, ks, timeout=600)[0]
    for K, rows in res.items():
        print(f"world={world} K={K}")
        for name, v in rows.items():
            print(f"  {name:<50s} {v if isinstance(v, dict) else f'p10 {v[0]:>7d}  p50 {v[1]:>7d} us'}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    u = sub.add_parser("update")
    u.add_argument("--shapes", nargs="*", default=["10x32", "1000x32", "10x65536", "1000x16384"], help="CxN")
    s = sub.add_parser("sync")
    s.add_argument("--ks", type=int, nargs="*", default=[1, 16, 64])
    s.add_argument("--world", type=int, default=2)
    a = p.parse_args(argv)
    if a.what == "update":
        update_layers(a.shapes)
    else:
        sync_layers(a.ks, a.world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
