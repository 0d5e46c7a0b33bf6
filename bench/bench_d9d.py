"""d9d_kernels inside d9d against d9d 0.24's built-in metrics (``d9d.metric.impl``).

Questions, on the metrics a d9d train task logs (loss mean, token count,
top-1 accuracy, macro F1, binary AUROC):

1. update: one training step's metric update, members updated one by one
   as a d9d task's ``update_metrics`` writes it (op ``update``, CPU, one
   intra-op thread, N tokens x C classes); in the d9d_kernels group
   accuracy and F1 share one class statistic, so one call feeds both;
2. sync + compute: ``ComposeMetric.sync(ctx)`` + ``compute()`` at 2 and 4
   spawned gloo ranks, both contenders given the same d9d
   ``DistributedContext`` (CPU meshes; op ``sync_compute``; rank 0's median);
3. collectives per sync: ``torch.distributed.all_reduce`` calls counted in
   every rank during the first and a steady sync;
4. token sums past 2^24: float32 (d9d's built-ins) against float64
   (d9d_kernels);
5. tensor parallelism: dp_shard 2 x tp 2, every tp rank updating the same
   (replicated) token count.

Targets: update >= 5x faster than d9d's built-ins; sync + compute >= 3x
faster at 4 ranks; 1 collective per steady group sync (the built-ins: 2 per
mean, 1 per sum, 4 per confusion-matrix metric, 2 per AUROC).

Providers (the ``provider`` column; ``d9d`` is d9d_kernels, as in every bench):
    d9d_builtin    d9d's impl classes in a ``ComposeMetric``: ``WeightedMeanMetric``,
                   ``SumMetric``, ``confusion_matrix_metric()`` (multiclass top_k=1
                   accuracy; multiclass macro F1), ``BinaryAUROCMetric`` (10k bins)
    d9d            one ``dk.MetricGroup`` of the same metrics (AUROC: 10k bins),
                   inside ``ComposeMetric({"train": g})`` as d9d's loop holds it
    d9d_f32_count  ``d9d`` with the token count given as a float32 0-d tensor
                   instead of the int64 ``(labels != -100).sum()`` (update only)

Inputs as a task passes them: logits ``[N, C]`` float32, labels ``[N]``
int64, the loss a 0-d float32 tensor, the token count the 0-d int64 tensor
``(labels != -100).sum()``, binary scores ``[N]`` float32 in [0, 1] with 0/1
int64 labels. Contenders are interleaved within every repeat.

Writes ``bench_d9d.csv`` (harness rows) and ``bench_d9d_checks.csv`` (checks
3-5: check, provider, shape, value, expected, note); ``bench/report.py``
draws ``bench_d9d.png`` and the report section from them.

    python bench/bench_d9d.py [--quick | --tiny] [--out bench/results/bench_d9d.csv]
"""

from __future__ import annotations

import argparse
import csv
import logging
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

BENCH = "bench_d9d"
IGNORE = -100
AUROC_BINS = 10_000  # d9d's BinaryAUROCMetric default
UPDATE_SHAPES = ((1024, 10), (1024, 1000), (8192, 10))
SYNC_C = (10, 1000)
CHECK_COLUMNS = ("check", "provider", "shape", "value", "expected", "note")
REGULAR_DIMS = ("pp", "dp_replicate", "dp_shard", "cp_shard", "cp_replicate", "tp")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--tiny", action="store_true", help="smoke test: one small shape, world 2, 2 repeats")
    p.add_argument("--out", default=str(harness.RESULTS / f"{BENCH}.csv"))
    p.add_argument("--timeout", type=float, default=600.0, help="per spawned world, seconds")
    return p.parse_args(argv)


# ------------------------------------------------------------------- contenders
def builtin_metrics(C: int):
    """d9d's built-ins for the five metrics, in the ComposeMetric d9d's loop holds."""
    from d9d.metric.impl.aggregation import SumMetric, WeightedMeanMetric
    from d9d.metric.impl.classification import BinaryAUROCMetric, confusion_matrix_metric
    from d9d.metric.impl.container import ComposeMetric

    return ComposeMetric({
        "loss": WeightedMeanMetric(),
        "tokens": SumMetric(),
        # top_k=1: multiclass() without top_k one-hot encodes, and its micro accuracy counts true negatives
        "acc": confusion_matrix_metric().multiclass(C, top_k=1).with_accuracy().build(),
        "f1": confusion_matrix_metric().multiclass(C).with_f1().macro().build(),
        "auroc": BinaryAUROCMetric(num_bins=AUROC_BINS),
    })


def dk_metrics(C: int):
    """The same five metrics as one dk.MetricGroup, as ``create_metrics`` returns it."""
    from d9d.metric.impl.container import ComposeMetric

    import d9d_kernels as dk

    kw = dict(task="multiclass", num_classes=C)
    g = dk.MetricGroup({
        "loss": dk.WeightedMeanMetric(),
        "tokens": dk.SumMetric(),
        "acc": dk.Accuracy(**kw),
        "f1": dk.F1Score(**kw, average="macro"),
        "auroc": dk.AUROC(task="binary", num_bins=AUROC_BINS),
    })
    return ComposeMetric({"train": g})


def update_builtin(m, b):
    m["loss"].update(b["loss"], b["tokens"])
    m["tokens"].update(b["tokens"])
    m["acc"].update(b["logits"], b["labels"])
    m["f1"].update(b["logits"], b["labels"])
    m["auroc"].update(b["probs"], b["binary"])


def update_dk(m, b, tokens="tokens"):
    g = m["train"]
    g["loss"].update(values=b["loss"], weights=b[tokens])
    g["tokens"].update(values=b[tokens])
    # acc and f1 share one class statistic (same task, classes and inputs): this call fills both, and a
    # second one through g["f1"] would count the batch twice (README, "Members that share a statistic")
    g["acc"].update(preds=b["logits"], target=b["labels"])
    g["auroc"].update(preds=b["probs"], target=b["binary"])  # not g.update: the binary AUROC takes preds/target too


UPDATE = {"d9d_builtin": (builtin_metrics, update_builtin), "d9d": (dk_metrics, update_dk),
          "d9d_f32_count": (dk_metrics, lambda m, b: update_dk(m, b, "tokens_f32"))}


def batch(N: int, C: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, C, (N,), generator=g)
    probs = torch.rand(N, generator=g)
    b = {
        "logits": torch.randn(N, C, generator=g),
        "labels": labels,
        "loss": torch.rand((), generator=g) + 1.0,
        "tokens": (labels != IGNORE).sum(),  # int64, as a task counts its tokens
        "probs": probs,
        "binary": (torch.rand(N, generator=g) < probs).long(),
    }
    b["tokens_f32"] = b["tokens"].float()
    return b


def flat(values) -> dict[str, float]:
    """{name: float} of a ComposeMetric's compute() (d9d: flat; dk: under "train")."""
    values = values.get("train", values)
    return {k: float(v) for k, v in values.items()}


# ----------------------------------------------------------------------- update
def bench_update(timing: harness.Timing, shapes) -> list[dict]:
    torch.set_num_threads(1)
    rows = []
    for N, C in shapes:
        b = batch(N, C)
        ms = {p: make(C) for p, (make, _) in UPDATE.items()}
        fns = {p: (lambda p=p: UPDATE[p][1](ms[p], b)) for p in UPDATE}
        for fn in fns.values():  # warmup; the first dk update plans the input signature
            for _ in range(timing.warmup):
                fn()
        got = {p: flat(m.compute()) for p, m in ms.items()}
        _check_values(got, f"update N={N} C={C}")
        number = {}
        for p, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            one = time.perf_counter() - t0
            number[p] = max(1, int(timing.min_repeat_s / max(one, 1e-9)))
        times = {p: [] for p in fns}
        start = time.perf_counter()
        for _ in range(timing.repeats):  # contenders interleaved within each repeat
            for p, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(number[p]):
                    fn()
                times[p].append((time.perf_counter() - t0) / number[p])
            if time.perf_counter() - start > timing.max_total_s * len(fns) and len(times["d9d"]) >= 3:
                break
        for p, ts in times.items():
            st = harness.stats(ts)
            rows.append(harness.row(BENCH, op="update", provider=p, shape=f"N={N},C={C}", dtype="float32",
                                    device="cpu", stats=st))
        ratio = harness.stats(times["d9d_builtin"]).p50 / harness.stats(times["d9d"]).p50
        print(f"{BENCH}: update N={N:<5d} C={C:<5d} " + "  ".join(
            f"{p} {harness.stats(ts).p50 * 1e6:9.1f} us" for p, ts in times.items())
            + f"  built-in / d9d_kernels {ratio:.2f}x", flush=True)
    return rows


def _check_values(got: dict, where: str) -> None:
    """d9d_kernels' values equal the built-ins' where those are defined
    (their macro F1 is NaN when a class has no tp, fp or fn)."""
    for k, v in got["d9d_builtin"].items():
        for p in got:
            w = got[p][k]
            if v != v:
                continue
            tol = 1e-5 * max(1.0, abs(v)) * (10 if k == "tokens" else 1)
            if abs(w - v) > tol:
                raise AssertionError(f"{BENCH}: {where} {k}: {p} {w} != d9d_builtin {v}")


# ------------------------------------------------------------- distributed part
def d9d_cpu_context(**degrees):
    """A distributed d9d ``DistributedContext`` on CPU (gloo): its constructor
    calls ``torch.cuda.set_device`` and builds CUDA meshes, so this sets the
    attributes it sets, with the regular-domain mesh built on CPU."""
    from d9d.core.dist_context import DeviceMeshParameters, DistributedContext
    from torch.distributed.device_mesh import init_device_mesh

    params = DeviceMeshParameters(**degrees)
    shape = (params.pipeline_parallel, params.data_parallel_replicate, params.data_parallel_shard,
             params.context_parallel_shard, params.context_parallel_replicate, params.tensor_parallel)
    ctx = object.__new__(DistributedContext)
    ctx._params = params
    ctx._meshes = {"regular": init_device_mesh("cpu", shape, mesh_dim_names=REGULAR_DIMS)}
    ctx._num_nodes = 1
    ctx._logger = logging.getLogger(BENCH)
    ctx._local_rank = ctx._global_rank = int(os.environ.get("RANK", "0"))
    ctx._node_rank = 0
    ctx._master_addr = "127.0.0.1"
    ctx._current_device = torch.device("cpu")
    return ctx


class _AllReduceCounter:
    """Counts ``torch.distributed.all_reduce`` calls (d9d and d9d_kernels both call it by attribute)."""

    def __init__(self):
        import torch.distributed as dist

        self.n, self._dist, self._orig = 0, dist, dist.all_reduce

        def counted(*a, **k):
            self.n += 1
            return self._orig(*a, **k)

        dist.all_reduce = counted

    def close(self):
        self._dist.all_reduce = self._orig


def _rank_sync(rank: int, world: int, tiny: bool, warmup: int, repeats: int, samples: int):
    import torch.distributed as dist

    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    if world <= len(cpus):  # one core per rank: no migrations mid-collective
        os.sched_setaffinity(0, {cpus[rank]})
    ctx = d9d_cpu_context(data_parallel_shard=world)
    out = {"rows": [], "checks": []}
    for C in (SYNC_C[:1] if tiny else SYNC_C):
        b = batch(256 + 17 * rank, C, seed=rank)
        ms = {"d9d_builtin": builtin_metrics(C), "d9d": dk_metrics(C)}
        upd = {"d9d_builtin": update_builtin, "d9d": update_dk}
        counts = {}
        for p in ms:  # first sync (dk: + its one-time schema handshake), then a steady one
            for phase in ("first", "steady"):
                upd[p](ms[p], b)
                dist.barrier()
                counter = _AllReduceCounter()
                try:
                    ms[p].sync(ctx)
                finally:
                    counter.close()
                counts[(p, phase)] = counter.n
                ms[p].compute()
        vals = {p: flat(m.compute()) for p, m in ms.items()}
        times = {p: [] for p in ms}
        for i in range(warmup + repeats):
            for p in ms:  # interleaved
                for _ in range(samples):
                    upd[p](ms[p], b)
                    dist.barrier()
                    t0 = time.perf_counter()
                    ms[p].sync(ctx)
                    ms[p].compute()
                    t1 = time.perf_counter()
                    if i >= warmup:
                        times[p].append(t1 - t0)
        out["rows"] += [{"C": C, "provider": p, "times": ts} for p, ts in times.items()]
        out["checks"] += [{"C": C, "provider": p, "phase": ph, "count": n} for (p, ph), n in counts.items()]
        out.setdefault("values", {})[C] = vals
    if world == 4:
        out["tp"] = _tp_check(rank)
    return out


def _tp_check(rank: int) -> dict:
    """dp_shard 2 x tp 2: the tp ranks of a dp rank see the same microbatch, so
    each updates the same token count; the global count is the dp ranks' sum."""
    ctx = d9d_cpu_context(data_parallel_shard=2, tensor_parallel=2)
    mesh = ctx.mesh_for("regular")
    dp = mesh.get_local_rank("dp_shard")
    n = torch.tensor(1000 + 7 * dp)  # replicated over tp
    builtin, ours = builtin_metrics(10), dk_metrics(10)
    builtin["tokens"].update(n)
    ours["train"]["tokens"].update(values=n)
    builtin.sync(ctx)  # MetricAccumulator.sync: all_reduce over the default group, every rank
    ours.sync(ctx)  # d9d_kernels: over pp, dp_replicate, dp_shard, cp_shard (API.md section 8)
    return {"truth": 1000 + 1007, "d9d_builtin": float(builtin["tokens"].compute()),
            "d9d": float(ours["train"]["tokens"].compute())}


def _rank_result(rank, world, *args):
    res = _rank_sync(rank, world, *args)
    return res if rank == 0 else {"checks": res["checks"]}


def bench_sync(world: int, timing: harness.Timing, tiny: bool, timeout: float):
    from d9d_kernels.spawn import spawn_gloo

    samples = 1 if tiny else 4
    out = spawn_gloo(_rank_result, world, tiny, timing.warmup, timing.repeats, samples, timeout=timeout,
                     pg_timeout=120, stop_on_error=True)
    errors = {r: m for r, (status, m) in out.items() if status != "ok"}
    if errors:
        msg = "\n".join(f"[rank {r}] {m}" for r, m in sorted(errors.items()))
        raise RuntimeError(f"{BENCH} world={world} failed:\n{msg}")
    res = out[0][1]
    # every rank issues the same collectives; the check row keeps the largest count seen
    for r in range(1, world):
        for c0, cr in zip(res["checks"], out[r][1]["checks"]):
            c0["count"] = max(c0["count"], cr["count"])
    return res


# ------------------------------------------------------------ float32 exactness
def exactness_checks(k: int = 1000, steps: int = 8192) -> list[dict]:
    """Token sums past 2^24 in d9d's float32 SumMetric and dk's float64 one."""
    from d9d.metric.impl.aggregation import SumMetric

    import d9d_kernels as dk

    rows = []
    # (a) 2^24 tokens, then k microbatches of one token each
    d, m = SumMetric(), dk.SumMetric()
    ones = torch.ones(2**24)
    d.update(ones)
    m.update(values=ones)
    one = torch.ones(1)
    for _ in range(k):
        d.update(one)
        m.update(values=one)
    truth = 2**24 + k
    for p, v in (("d9d_builtin", float(d.compute())), ("d9d", float(m.compute()))):
        rows.append({"check": "token_sum_exact", "provider": p, "shape": f"2^24+{k} ones", "value": f"{v:.0f}",
                     "expected": str(truth), "note": f"error {v - truth:+.0f}"})
    # (b) a training run's token counts: int64 (labels != -100).sum() per microbatch, 3000-4096 each
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(3000, 4097, (steps,), generator=g)
    d, m = SumMetric(), dk.SumMetric()
    for n in counts:
        d.update(n)
        m.update(values=n)
    truth = int(counts.sum())
    for p, v in (("d9d_builtin", float(d.compute())), ("d9d", float(m.compute()))):
        rows.append({"check": "token_sum_exact", "provider": p, "shape": f"{steps} microbatches of 3000-4096",
                     "value": f"{v:.0f}", "expected": str(truth), "note": f"error {v - truth:+.0f}"})
    return rows


# ------------------------------------------------------------------------- main
def main(argv=None) -> int:
    a = parse(argv)
    timing = harness.Timing.tiny() if a.tiny else (harness.Timing.quick() if a.quick else harness.Timing())
    out = Path(a.out)
    rows = bench_update(timing, UPDATE_SHAPES[:1] if a.tiny else UPDATE_SHAPES)
    checks = []
    sync_timing = timing if a.tiny else harness.Timing(warmup=timing.warmup, repeats=timing.repeats * 2)
    for world in ((2,) if a.tiny else (2, 4)):
        res = bench_sync(world, sync_timing, a.tiny, a.timeout)
        for r in res["rows"]:
            st = harness.stats(r["times"])
            rows.append(harness.row(BENCH, op="sync_compute", provider=r["provider"],
                                    shape=f"C={r['C']},world={world}", dtype="mixed",
                                    device="cpu", stats=st))
            print(f"{BENCH}: sync+compute world={world} C={r['C']:<5d} {r['provider']:<11s} "
                  f"{st.p50 * 1e6:9.1f} us [p20 {st.p20 * 1e6:.1f}, p80 {st.p80 * 1e6:.1f}]", flush=True)
        for C, vals in res["values"].items():
            _check_values(vals, f"sync world={world} C={C}")
        for c in res["checks"]:
            if c["provider"] == "d9d":
                expected = "2 (1 + the one-time schema handshake)" if c["phase"] == "first" else "1"
            else:
                expected = "13 (2 mean + 1 sum + 4 + 4 confusion matrix + 2 AUROC)"
            checks.append({"check": "all_reduce_per_sync", "provider": c["provider"],
                           "shape": f"C={c['C']},world={world},sync={c['phase']}", "value": str(c["count"]),
                           "expected": expected, "note": ""})
        if "tp" in res:
            tp = res["tp"]
            for p in ("d9d_builtin", "d9d"):
                checks.append({"check": "tp_token_count", "provider": p, "shape": "dp_shard=2,tp=2",
                               "value": f"{tp[p]:.0f}", "expected": str(tp["truth"]),
                               "note": f"{tp[p] / tp['truth']:.2f}x the true count"})
    checks += exactness_checks(k=10 if a.tiny else 1000, steps=256 if a.tiny else 8192)
    for c in checks:
        print(f"{BENCH}: {c['check']:<20s} {c['provider']:<11s} {c['shape']:<32s} {c['value']:>10s} "
              f"(expected {c['expected']}) {c['note']}")
    harness.write_csv(out, rows)
    check_path = out.with_name(out.stem + "_checks.csv")
    with open(check_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CHECK_COLUMNS)
        w.writeheader()
        w.writerows(checks)
    print(f"{BENCH}: wrote {out} ({len(rows)} rows) and {check_path} ({len(checks)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
