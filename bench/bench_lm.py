"""Language-model metrics per step: Perplexity + top-1 + top-5 token accuracy
over logits [N, V], d9d_kernels vs its peers, interleaved in one run.

    python bench/bench_lm.py [--quick | --tiny] [--out bench/results/bench_lm.csv]
    python bench/bench_lm.py --tp 2 [--quick | --tiny]     # vocab-parallel: bench/results/bench_lm_tp.csv

Providers, each one update of the three metrics on the same logits/targets
(10 % ignore_index):
  d9d          MetricGroup(Perplexity(num_classes=V), Accuracy, Accuracy(top_k=5)): one class_stats call
  d9d_lse      the same with lse= (the per-token logsumexp the loss already computed, made outside the timing)
  torch        hand-written: F.cross_entropy(sum) + argmax + topk(5), accumulated in tensors
  torchmetrics Perplexity + MulticlassAccuracy(top_k=1) + MulticlassAccuracy(top_k=5), micro
               (first shape only: ~8 s an update at [2048, 32000] on the 2-core bench machine)
  floor        x.amax(-1): one read of the logits
Rounds interleave the providers (same load on each); medians over rounds.
--tp T (gloo, T processes of 1 thread each, the vocabulary split as tp_splits):
  d9d_unsharded  the d9d group update of the whole [N, V] on rank 0 with T threads
  d9d_tp         the same group given each rank's shard and vocab=dk.VocabShard, from
                 the last rank's start to the last rank's end: the same total work,
                 plus one all_gather (op "... incl. barrier skew": the slowest rank
                 from its own start, which counts the barrier's release skew too)
  d9d_tp_lse     the same given lse= (the loss's logsumexp): no exp pass on the shards
  (op "... cpu-seconds": CPU time of the unsharded update / summed over the tp ranks;
  OMP_WAIT_POLICY=PASSIVE in every rank: idle OpenMP workers do not spin on the shared cores)
Bytes allocated by one update (profiler; an upper bound on its peak extra
memory) go to bench_lm_memory.json beside the CSV.

    python bench/bench_lm.py --hidden [--quick | --tiny]   # hidden states: bench/results/bench_lm_hidden.csv

--hidden: the same three metrics from hidden states h [N, D] and an LM head w [V, D]
(op "ppl+acc+top5 from hidden"), one update each:
  d9d_linear     g.update(preds=dk.LinearLogits(h, w), target=t): no logits materialised
  d9d_linear_lse the same with lse= (the loss's logsumexp): no exp work
  materialise    logits = h @ w.T, then today's g.update(preds=logits, target=t)
  torch_chunked  hand-written torch: chunked h @ w_c.T, online logsumexp, argmax, "> z_t" counts
  mm_floor       one torch.mm(h, w.T) producing the logits (the floor)
Peak extra memory (bench_lm_hidden_memory.json): the scratch of ops.linear_logits
(analytic: its blocks), and the bytes allocated during one update (profiler,
frees not subtracted: an upper bound), against the float32 logits' size.

    python bench/bench_lm.py --hidden --busy [--quick | --tiny]   # bench/results/bench_lm_hidden_busy.csv / .png

--busy: d9d_linear and mm_floor above (float32, torch's default threads), each
condition's rounds interleaved: "busy=0" as they are, "busy=1" with one
spinning Python process beside them (unpinned: the scheduler places it, as it
places a data-loader worker), which takes a core from the torch threads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import RESULTS, row, stats, write_csv  # noqa: E402

import d9d_kernels as dk  # noqa: E402

IGNORE = -100
FULL = [(2048, 32000), (8192, 32000), (1024, 128000)]
QUICK = [(512, 32000)]
TINY = [(64, 2000)]
OP = "ppl+acc+top5"


def interleaved(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each provider: one warm-up call each (plans,
    first-touch), then ``rounds`` rounds calling every provider in turn."""
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times

def batch(N, V, dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(N, V, generator=g) * 3).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[torch.rand(N, generator=g) < 0.1] = IGNORE
    return x, t


def providers(x, t, with_torchmetrics: bool):
    V = x.shape[1]
    g = dk.MetricGroup({"ppl": dk.Perplexity(ignore_index=IGNORE, num_classes=V),
                        "acc": dk.Accuracy(task="multiclass", num_classes=V, ignore_index=IGNORE),
                        "top5": dk.Accuracy(task="multiclass", num_classes=V, top_k=5, ignore_index=IGNORE)})
    gl = dk.MetricGroup({"ppl": dk.Perplexity(ignore_index=IGNORE, num_classes=V),
                         "acc": dk.Accuracy(task="multiclass", num_classes=V, ignore_index=IGNORE),
                         "top5": dk.Accuracy(task="multiclass", num_classes=V, top_k=5, ignore_index=IGNORE)})
    lse = torch.logsumexp(x.float(), dim=-1)  # as the loss computed it
    acc = torch.zeros(4, dtype=torch.float64)

    def hand():
        keep = t != IGNORE
        acc[0] += F.cross_entropy(x, t, ignore_index=IGNORE, reduction="sum").double()
        acc[1] += ((x.argmax(-1) == t) & keep).sum()
        acc[2] += ((x.topk(5, -1).indices == t[:, None]).any(-1) & keep).sum()
        acc[3] += keep.sum()

    out = {"d9d": lambda: g.update(preds=x, target=t), "d9d_lse": lambda: gl.update(preds=x, target=t, lse=lse),
           "torch": hand, "floor": lambda: x.amax(-1)}
    if not with_torchmetrics:
        return out
    try:
        from torchmetrics.classification import MulticlassAccuracy
        from torchmetrics.text import Perplexity as TMPerplexity

        tm = [TMPerplexity(ignore_index=IGNORE),
              MulticlassAccuracy(V, top_k=1, average="micro", ignore_index=IGNORE),
              MulticlassAccuracy(V, top_k=5, average="micro", ignore_index=IGNORE)]

        def tmu():
            tm[0].update(x[None], t[None])
            tm[1].update(x, t)
            tm[2].update(x, t)

        out["torchmetrics"] = tmu
    except ImportError:
        pass
    return out


def allocated_bytes(fn) -> int:
    """Bytes allocated during one call of fn (profiler self memory of every op,
    frees not subtracted): an upper bound on its peak extra memory."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0)


def bars(rows, case, label, provs, png: Path, title: str, width: float, log: bool = False) -> None:
    """p50 (ms) per case (``case(row)``, in the order first seen; ticks ``label(case)``) and provider, as grouped bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(case(r) for r in rows))
    fig, ax = plt.subplots(figsize=(width * len(cases) + 2, 3.8))
    w = 0.8 / len(provs)
    for i, p in enumerate(provs):
        ys = [next((float(r["p50_us"]) / 1e3 for r in rows if case(r) == c and r["provider"] == p), 0.0) for c in cases]
        ax.bar([k + i * w for k in range(len(cases))], ys, w, label=p)
    ax.set_xticks([k + 0.4 - w / 2 for k in range(len(cases))])
    ax.set_xticklabels([label(c) for c in cases], fontsize=7)
    if log:
        ax.set_yscale("log")
    ax.set_ylabel("ms per update (p50)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot(rows, mem, png: Path):
    bars(rows, lambda r: (r["shape"], r["dtype"]), lambda c: f"{c[0]}\n{c[1]}",
         ["floor", "d9d_lse", "d9d", "torch", "torchmetrics"], png, f"{OP} update, CPU, interleaved rounds", 2.2,
         log=True)


def tp_splits(V: int, tp: int) -> list[tuple[int, int]]:
    """Shard bounds as Megatron splits: V // tp columns each, the last rank also the remainder."""
    cuts = [r * (V // tp) for r in range(tp)] + [V]
    return list(zip(cuts[:-1], cuts[1:]))


def _tp_rank(rank, tp, N, V, dtype_name, rounds):
    import torch.distributed as dist

    x, t = batch(N, V, getattr(torch, dtype_name))
    lo, hi = tp_splits(V, tp)[rank]
    shard = dk.VocabShard(lo, hi - lo, dk.DistributedContext())
    xs = x[:, lo:hi].contiguous()

    def group():
        return dk.MetricGroup({"ppl": dk.Perplexity(ignore_index=IGNORE, num_classes=V),
                               "acc": dk.Accuracy(task="multiclass", num_classes=V, ignore_index=IGNORE),
                               "top5": dk.Accuracy(task="multiclass", num_classes=V, top_k=5, ignore_index=IGNORE)})

    full, part, part_lse = group(), group(), group()
    lse = torch.logsumexp(x.float(), dim=-1)  # the loss's (outside the timing)

    def unsharded():
        torch.set_num_threads(tp)  # the whole machine for the unsharded update
        try:
            full.update(preds=x, target=t)
        finally:
            torch.set_num_threads(1)

    def sharded():
        part.update(preds=xs, target=t, vocab=shard)

    def sharded_lse():
        part_lse.update(preds=xs, target=t, lse=lse, vocab=shard)

    # wall times, and CPU seconds (process_time: every thread of the process),
    # which a machine shared with other jobs distorts less. A tp update's wall
    # time runs from the moment the LAST rank enters it to the moment the last
    # one leaves (CLOCK_MONOTONIC is one clock for every process of the
    # machine): gloo's barrier releases the ranks up to a few ms apart, and
    # that wait is the barrier's, not the update's ("skew": the slowest
    # rank's time from its own start, which includes it)
    clock = lambda: time.clock_gettime(time.CLOCK_MONOTONIC)  # noqa: E731
    tp_fns = {"d9d_tp": sharded, "d9d_tp_lse": sharded_lse}
    times = {k: [] for k in ("d9d_unsharded", *tp_fns, "cpu:d9d_unsharded", *(f"cpu:{k}" for k in tp_fns),
                             *(f"skew:{k}" for k in tp_fns))}
    for r in range(rounds + 1):  # round 0 warms up (plans, the metadata check)
        dist.barrier()
        if rank == 0:
            t0, c0 = clock(), time.process_time()
            unsharded()
            dt, dc = clock() - t0, time.process_time() - c0
            if r:
                times["d9d_unsharded"].append(dt)
                times["cpu:d9d_unsharded"].append(dc)
        for k, fn in tp_fns.items():
            dist.barrier()
            t0, c0 = clock(), time.process_time()
            fn()
            t1, c1 = clock(), time.process_time()
            last = torch.tensor([t0, t1, t1 - t0], dtype=torch.float64)
            total = torch.tensor([c1 - c0], dtype=torch.float64)
            dist.all_reduce(last, op=dist.ReduceOp.MAX)
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            if r:
                times[k].append((last[1] - last[0]).item())
                times[f"skew:{k}"].append(last[2].item())
                times[f"cpu:{k}"].append(total.item())
    if rank:
        return times, True
    import warnings

    with warnings.catch_warnings():  # rank 0's own values: the unsharded update ran there only
        warnings.simplefilter("ignore")
        want, got = full.compute(), part.compute()
        got_lse = part_lse.compute()
    return times, all(torch.allclose(g[k], want[k], rtol=1e-6, atol=0) for g in (got, got_lse) for k in want)


def main_tp(a, shapes, rounds) -> int:
    from d9d_kernels.spawn import spawn_gloo

    # The ranks share the machine's cores with rank 0's T-thread pool of the
    # unsharded update: libgomp's idle workers spin-wait by default and take
    # the other ranks' cores after it. Idle workers sleep instead (read by
    # libgomp when torch loads, so set before the ranks start); in training
    # each tp rank has cores of its own.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    rows = []
    out = Path(a.out).with_name("bench_lm_tp.csv") if a.out == str(RESULTS / "bench_lm.csv") else Path(a.out)
    for N, V in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            dt = str(dtype).replace("torch.", "")
            res = spawn_gloo(_tp_rank, a.tp, N, V, dt, rounds, threads=1, timeout=1800.0, pg_timeout=300.0)
            bad = {r: v for r, v in res.items() if v[0] != "ok"}
            if bad:
                print(f"bench_lm --tp: ranks failed: {bad}", file=sys.stderr)
                return 1
            times, same = res[0][1]
            shape = f"N={N},V={V},tp={a.tp}"
            for k, ts in times.items():
                kind, _, provider = k.rpartition(":")
                op = OP + {"": "", "cpu": " cpu-seconds", "skew": " incl. barrier skew"}[kind]
                rows.append(row("lm", op=op, provider=provider, shape=shape, dtype=dt, device="cpu", stats=stats(ts)))
            med = {k: sorted(ts)[len(ts) // 2] for k, ts in times.items()}
            print(f"{shape} {dt}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items())
                  + f" | tp / unsharded: wall {med['d9d_tp'] / med['d9d_unsharded']:.2f}, cpu "
                  f"{med['cpu:d9d_tp'] / med['cpu:d9d_unsharded']:.2f} (target <= 1.5); with lse: wall "
                  f"{med['d9d_tp_lse'] / med['d9d_unsharded']:.2f}, cpu "
                  f"{med['cpu:d9d_tp_lse'] / med['cpu:d9d_unsharded']:.2f}; incl. barrier skew: wall "
                  f"{med['skew:d9d_tp'] / med['d9d_unsharded']:.2f}"
                  + ("" if same else " | RESULTS DIFFER"), flush=True)
            write_csv(out, rows)
    return 0


HIDDEN_FULL = [(2048, 512, 32000)]
HIDDEN_QUICK = [(512, 256, 32000)]
HIDDEN_TINY = [(64, 32, 2000)]
HIDDEN_OP = OP + " from hidden"


def hidden_batch(N, D, V, dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) / D**0.5 * 3).to(dtype)
    z = (h @ w.T).float()
    t = z.topk(8, -1).indices[torch.arange(N), torch.randint(0, 8, (N,), generator=g)]  # a model that is often right
    t[torch.rand(N, generator=g) < 0.1] = IGNORE
    return h, w, t, torch.logsumexp(z, -1)


def hidden_providers(h, w, t, lse):
    V = w.shape[0]

    def group():
        return dk.MetricGroup({"ppl": dk.Perplexity(ignore_index=IGNORE, num_classes=V),
                               "acc": dk.Accuracy(task="multiclass", num_classes=V, ignore_index=IGNORE),
                               "top5": dk.Accuracy(task="multiclass", num_classes=V, top_k=5, ignore_index=IGNORE)})

    gl, gll, gm = group(), group(), group()
    acc = torch.zeros(4, dtype=torch.float64)
    keep = t != IGNORE
    tc = torch.where(keep, t, 0)

    def chunked(cols=4096):
        zt = torch.linalg.vecdot(h.float(), w[tc].float())
        m = torch.full((h.shape[0],), float("-inf"))
        s = torch.zeros(h.shape[0])
        ahead = torch.zeros(h.shape[0])
        best = torch.full((h.shape[0],), float("-inf"))
        for c0 in range(0, V, cols):
            z = (h @ w[c0 : c0 + cols].T).float()
            cm = z.amax(1)
            nm = torch.maximum(m, cm)
            s = s * torch.exp(m - nm) + torch.exp(z - nm[:, None]).sum(1)
            m = nm
            ahead += (z > zt[:, None]).sum(1)
            best = torch.maximum(best, cm)
        acc[0] += torch.where(keep, m + torch.log(s) - zt, 0).sum()
        acc[1] += (keep & (ahead < 1)).sum()
        acc[2] += (keep & (ahead < 5)).sum()
        acc[3] += keep.sum()

    return {"d9d_linear": lambda: gl.update(preds=dk.LinearLogits(h, w), target=t),
            "d9d_linear_lse": lambda: gll.update(preds=dk.LinearLogits(h, w), target=t, lse=lse),
            "materialise": lambda: gm.update(preds=h @ w.T, target=t),
            "torch_chunked": chunked,
            "mm_floor": lambda: torch.mm(h, w.T)}


def main_hidden(a, shapes, rounds) -> int:
    import importlib

    L = importlib.import_module("d9d_kernels.ops.linear_logits")

    rows, mem = [], {}
    name = f"bench_lm_hidden_t{torch.get_num_threads()}.csv"
    out = Path(a.out).with_name(name) if a.out == str(RESULTS / "bench_lm.csv") else Path(a.out)
    for N, D, V in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            h, w, t, lse = hidden_batch(N, D, V, dtype)
            fns = hidden_providers(h, w, t, lse)
            times = interleaved(fns, rounds)
            shape, dt = f"N={N},D={D},V={V},threads={torch.get_num_threads()}", str(dtype).replace("torch.", "")
            for k, ts in times.items():
                rows.append(row("lm", op=HIDDEN_OP, provider=k, shape=shape, dtype=dt, device="cpu", stats=stats(ts)))
            med = {k: sorted(ts)[len(ts) // 2] for k, ts in times.items()}
            scratch = L.scratch_bytes(N, D, V, dtype)
            logits32 = N * V * 4
            mem[f"{shape},{dt}"] = {"logits_fp32_bytes": logits32, "linear_logits_scratch_bytes": scratch,
                                    **{f"allocated:{k}": allocated_bytes(fn) for k, fn in fns.items()}}
            print(f"{shape} {dt}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items())
                  + f" | d9d_linear/mm {med['d9d_linear'] / med['mm_floor']:.2f} (target <= 1.3), "
                  f"d9d_linear_lse/mm {med['d9d_linear_lse'] / med['mm_floor']:.2f}, "
                  f"materialise/d9d_linear {med['materialise'] / med['d9d_linear']:.2f}"
                  f" | scratch {scratch / 2**20:.2f} MiB = {100 * scratch / logits32:.2f} % of the fp32 logits "
                  f"(target <= 2 %), allocated by d9d_linear {mem[f'{shape},{dt}']['allocated:d9d_linear'] / 2**20:.2f} MiB",
                  flush=True)
            write_csv(out, rows)
            out.with_name(out.stem + "_memory.json").write_text(json.dumps(mem, indent=1))
    return 0


HIDDEN_BUSY_FULL = [(2048, 256, 32000)]
HIDDEN_BUSY_QUICK = [(512, 256, 32000)]


def main_busy(a, shapes, rounds) -> int:
    import subprocess

    rows = []
    out = Path(a.out).with_name("bench_lm_hidden_busy.csv") if a.out == str(RESULTS / "bench_lm.csv") else Path(a.out)
    threads = torch.get_num_threads()
    for N, D, V in shapes:
        h, w, t, lse = hidden_batch(N, D, V, torch.float32)
        fns = {k: f for k, f in hidden_providers(h, w, t, lse).items() if k in ("d9d_linear", "mm_floor")}
        for busy in (0, 1):
            spin = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                time.sleep(0.5 * busy)  # the spinner is running before the first call
                times = interleaved(fns, rounds)
            finally:
                if spin is not None:
                    spin.kill()
                    spin.wait()
            shape = f"N={N},D={D},V={V},threads={threads},busy={busy}"
            for k, ts in times.items():
                rows.append(row("lm", op=HIDDEN_OP, provider=k, shape=shape, dtype="float32", device="cpu",
                                stats=stats(ts)))
            med = {k: sorted(ts)[len(ts) // 2] for k, ts in times.items()}
            print(f"{shape} float32: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items())
                  + f" | d9d_linear/mm {med['d9d_linear'] / med['mm_floor']:.2f}"
                  + (" (target <= 1.5)" if busy else "") + f" | load average {os.getloadavg()[0]:.1f}", flush=True)
            write_csv(out, rows)
    try:
        plot_busy(rows, out.with_suffix(".png"))
    except Exception as e:  # a plot failing must not lose the CSV
        print(f"bench_lm: plot failed: {e}", file=sys.stderr)
    return 0


def plot_busy(rows, png: Path):
    bars(rows, lambda r: r["shape"], lambda s: s.replace(",", "\n", 3), ["mm_floor", "d9d_linear"], png,
         f"{HIDDEN_OP}, float32, CPU; busy=1: a spinning process beside it", 2.4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "bench_lm.csv"))
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--tp", type=int, default=0, help="vocab-parallel mode over this many gloo ranks")
    p.add_argument("--hidden", action="store_true", help="from hidden states (dk.LinearLogits)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (--hidden; 0: torch's default)")
    p.add_argument("--busy", action="store_true", help="--hidden beside a spinning process, and without it")
    a = p.parse_args(argv)
    if a.hidden and a.busy:
        if a.threads:
            torch.set_num_threads(a.threads)
        hs = HIDDEN_TINY if a.tiny else HIDDEN_BUSY_QUICK if a.quick else HIDDEN_BUSY_FULL
        return main_busy(a, hs, a.rounds or (2 if a.tiny else 7))
    if a.hidden:
        if a.threads:
            torch.set_num_threads(a.threads)
        hs = HIDDEN_TINY if a.tiny else HIDDEN_QUICK if a.quick else HIDDEN_FULL
        return main_hidden(a, hs, a.rounds or (2 if a.tiny else 5))
    shapes = TINY if a.tiny else QUICK if a.quick else FULL
    # --tp: each round's slowest rank is noisier on the shared 2-core machine: more rounds
    rounds = a.rounds or (2 if a.tiny else 15 if a.tp else 5)
    if a.tp:
        return main_tp(a, shapes, rounds)
    rows, mem = [], {}
    out = Path(a.out)
    for N, V in shapes:
        for dtype in (torch.bfloat16, torch.float32):
            x, t = batch(N, V, dtype)
            fns = providers(x, t, with_torchmetrics=(N, V) == shapes[0])
            times = interleaved(fns, rounds)
            shape, dt = f"N={N},V={V}", str(dtype).replace("torch.", "")
            for k, ts in times.items():
                rows.append(row("lm", op=OP, provider=k, shape=shape, dtype=dt, device="cpu", stats=stats(ts)))
            med = {k: sorted(ts)[len(ts) // 2] for k, ts in times.items()}
            mem[f"{shape},{dt}"] = {"logits_bytes": x.numel() * x.element_size(),
                                    **{k: allocated_bytes(fn) for k, fn in fns.items() if k != "floor"}}
            print(f"{shape} {dt}: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items())
                  + f" | d9d/floor {med['d9d'] / med['floor']:.2f}, torch/d9d {med['torch'] / med['d9d']:.2f}, "
                  f"d9d_lse/floor {med['d9d_lse'] / med['floor']:.2f} | allocated "
                  + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in mem[f'{shape},{dt}'].items()), flush=True)
            del x, t, fns
            write_csv(out, rows)  # after each case: a run cut short keeps what it measured
            out.with_name(out.stem + "_memory.json").write_text(json.dumps(mem, indent=1))
    try:
        plot(rows, mem, out.with_suffix(".png"))
    except Exception as e:  # a plot failing must not lose the CSV
        print(f"bench_lm: plot failed: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
