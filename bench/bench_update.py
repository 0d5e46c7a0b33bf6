"""Per-step update latency of a typical metric group (CPU).

Question: what does updating loss mean + accuracy + top-5 + macro F1 + macro
precision + macro recall + confusion matrix cost per training step, for
C = 10 and 1000 classes and batch 32 ... 65536, with d9d_kernels versus
torchmetrics (defaults; fastest settings), torcheval and a hand-written
plain-torch update (bench/providers.py)?

Targets: >= 20x faster than torchmetrics default, >= 3x faster than
torcheval, no slower than plain torch.

    python bench/bench_update.py [--quick] [--out bench/results/update.csv]
    python bench/bench_update.py --segmentation only  # -> bench/results/bench_update_segmentation.csv
    python bench/bench_update.py --hostcost only     # -> bench/results/bench_update_hostcost.csv

``--forward``: the same group's ``forward`` (``g(preds=..., target=...)`` and
``loss(values=..., weights=...)``: update AND batch values) against its
update, measured interleaved (update, forward, update, ... in rounds; the
ratio is the median of per-round ratios), for d9d_kernels and torchmetrics;
``group_forward_state`` is d9d's forward without the batch-value formulas
(scratch reset, update on it, fold); ``group_update_result`` is the update
followed by making a result like forward's from Python, the cheapest way
known here: as many fresh float64 tensors in two dicts, on new
zero-filled outputs of the result's size (one ``torch.zeros`` and one
``unbind`` per dict; no value computed, the [C, C] matrix's bytes
written once but not as a matrix view): how much of forward's cost is the
result itself. ``group_update_views`` is the update followed by the same
tensor objects and dicts as views of buffers made once (no allocation, no
value, no arithmetic): the least any forward that returns fresh tensors
adds to the update, the floor of the forward / update ratio at small N.
The ``*_percall`` rows time each update, forward and (d9d) that floor call
alone, the contenders of both libraries round-robin with a 1 MiB write
between two calls (as ``--hostcost``): the caches as a training step leaves
them, where the block rows above time loops of one call. Target: forward
<= 1.2x update. Writes ``bench/results/bench_update_forward.csv``.

One CSV row per (provider, C, batch): median/p20/p80 of the update call.
Plot + table: ``python bench/report.py``.

Segmentation section (``segmentation_rows``): pixel accuracy + mean IoU on
one channel-first batch, scores ``[8, 21, 512, 512]`` float32 with targets
``[8, 512, 512]`` (``--quick``: ``[4, 21, 128, 128]``), d9d vs torchmetrics
(defaults; validate_args=False) vs hand-written torch (argmax + bincount),
and d9d fed a ``movedim(1, -1).contiguous()`` copy (what channel-last-only
input costs). Besides the times, the peak memory one update adds over its
inputs goes to ``bench_update_segmentation_memory.csv`` beside ``--out`` (CPU: the process's
resident high-water mark, reset before the call; CUDA: the allocator's peak).

Host-cost section (``hostcost_rows``, ``bench_update_hostcost.csv``): what one
training step's metric update costs the host at C = 10, B = 256 (launch-bound
sizes), the loss weight as a Python number and as a 0-d tensor, for d9d
(recorded plans), torchmetrics, hand-written torch,
d9d's parts alone and the raw custom-op calls d9d makes (the floor). Two
modes: hot (each contender in its own loop; the loops take turns) and interleaved (contenders
round-robin in a random order per round, as inside a training loop; a second
pass also writes ``--flush-kib`` KiB between calls, a model step's cache
traffic).
"""

from __future__ import annotations

import argparse
import subprocess
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import providers as pv  # noqa: E402

BENCH = "bench_update"
FULL_BATCHES = (32, 128, 512, 2048, 8192, 32768, 65536)
QUICK_BATCHES = (32, 1024, 16384)
CLASSES = (10, 1000)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batch sizes and repeats (CI, run_all --quick)")
    p.add_argument("--tiny", action="store_true", help="smoke test: 2 tiny shapes, 2 repeats (tests only)")
    p.add_argument("--classes", type=int, nargs="*", default=None)
    p.add_argument("--batches", type=int, nargs="*", default=None)
    p.add_argument("--providers", nargs="*", default=list(pv.UPDATE_PROVIDERS), choices=pv.UPDATE_PROVIDERS)
    p.add_argument("--out", default=str(harness.RESULTS / f"{BENCH}.csv"))
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--segmentation", choices=("with", "only", "off"), default="with",
                   help="the [8, 21, 512, 512] segmentation section: with the group rows (default), only it, or off")
    p.add_argument("--seg-peak", default=None, choices=SEG_PROVIDERS, help=argparse.SUPPRESS)  # child process
    p.add_argument("--seg-shape", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hostcost", choices=("with", "only", "off"), default="with",
                   help="the host-cost section (C = 10, B = 256, hot and interleaved): with the rest, only it, or off")
    p.add_argument("--flush-kib", type=int, default=FLUSH_KIB, help="host-cost section: KiB written between two "
                   "calls of the second interleaved pass (the first writes none)")
    p.add_argument("--forward", action="store_true", help="forward vs update rows, interleaved "
                   "(writes bench_update_forward.csv unless --out is given)")
    p.add_argument("--rounds", type=int, default=None, help="--forward: interleaved rounds (default 15, quick 7)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: on cuda the d9d update is also "
                   "run under torch.cuda.set_sync_debug_mode('error') and its host syncs per step recorded")
    a = p.parse_args(argv)
    if a.forward and a.out == str(harness.RESULTS / f"{BENCH}.csv"):
        a.out = str(harness.RESULTS / f"{BENCH}_forward.csv")
    if a.tiny:
        a.classes = a.classes or [10, 50]
        a.batches = a.batches or [32, 256]
    a.classes = a.classes or list(CLASSES)
    a.batches = a.batches or list(QUICK_BATCHES if a.quick else FULL_BATCHES)
    return a


def host_sync_check(g, inputs, out_csv, C, N) -> None:
    """GPU only: the d9d update + trigger_sync must not synchronise with the host.

    Runs 3 steps under ``torch.cuda.set_sync_debug_mode("error")`` (any
    host-device sync raises) and appends the verdict to
    ``<results>/update_host_syncs.jsonl`` (syncs_per_step = 0, or the error).
    """
    import json

    rec = {"C": C, "N": N, "device": torch.cuda.get_device_name(0)}
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            g.update(*inputs)
        rec["syncs_per_step"] = 0
    except RuntimeError as e:
        rec["syncs_per_step"] = ">= 1"
        rec["error"] = str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with open(Path(out_csv).with_name("update_host_syncs.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"{BENCH}: d9d host syncs per step on GPU (C={C}, N={N}): {rec['syncs_per_step']}", flush=True)


def forward_calls(prov: str, grp, inputs):
    """(update, forward, forward without batch values, update + a result made from Python,
    update + the result's tensor objects over kept buffers) callables of one provider's group;
    the last three are None for torchmetrics."""
    logits, target, loss, n = inputs
    if prov == "d9d":
        from d9d_kernels.core.forward import run as run_forward

        g, lm = grp.g, grp.loss
        st = g._storage
        result = g(preds=logits, target=target)
        keys, n_out = list(result), sum(v.numel() for v in result.values())  # the group forward's result
        views, f64 = (lambda t: t.unbind(0)), torch.float64

        def fwd():
            lm(values=loss, weights=n)
            return g(preds=logits, target=target)

        def state_only():  # forward's state work: scratch reset, update on it, fold
            run_forward(st, lambda: (lm.update(values=loss, weights=n), g.update(preds=logits, target=target)),
                        lambda views: None)

        def update_result():  # the update, then as many fresh tensors as forward returns
            grp.update(*inputs)
            out = torch.zeros(n_out, dtype=f64)
            return views(torch.zeros(1, dtype=f64))[0], dict(zip(keys, views(out[:len(keys)])))

        one, kept = torch.zeros(1, dtype=f64), torch.zeros(len(keys), dtype=f64)

        def update_views():  # the update, then forward's tensor objects and dicts, nothing allocated
            grp.update(*inputs)
            return views(one)[0], dict(zip(keys, views(kept)))

        return (lambda: grp.update(*inputs)), fwd, state_only, update_result, update_views
    if prov in ("torchmetrics", "torchmetrics_fast"):
        def fwd():
            grp.loss(loss, n)
            return grp.col(logits, target)

        return (lambda: grp.update(*inputs)), fwd, None, None, None
    raise ValueError(f"--forward compares d9d and torchmetrics, not {prov}")


def interleaved(fns: dict, rounds: int, min_repeat_s: float, sync=None) -> dict:
    """Times each callable in turn, ``rounds`` times; returns per-name
    per-call times (lists) measured in the same rounds."""
    sync = sync or (lambda: None)
    numbers = {}
    for name, fn in fns.items():
        for _ in range(3):
            fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        one = time.perf_counter() - t0
        numbers[name] = max(1, int(min_repeat_s / max(one, 1e-9)))
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            k = numbers[name]
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) / k)
    return times


#: rounds of the per-call forward rows (each round calls every contender once), at most; fewer
#: (down to PERCALL_MIN_ROUNDS) where a round would take longer than PERCALL_BUDGET_S / rounds
PERCALL_ROUNDS = {"full": 60, "quick": 20, "tiny": 2}
PERCALL_MIN_ROUNDS, PERCALL_BUDGET_S = 7, 20.0


def main_forward(a) -> int:
    rounds = a.rounds or (2 if a.tiny else 7 if a.quick else 15)
    min_s = 0.0 if a.tiny else 0.005 if a.quick else 0.02
    percall = PERCALL_ROUNDS["tiny" if a.tiny else "quick" if a.quick else "full"]
    provs = [p for p in a.providers if p in ("d9d", "torchmetrics", "torchmetrics_fast")]
    rows, dev = [], torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None

    def add_rows(times: dict, prov: str, C: int, N: int, suffix: str = "") -> None:
        for op, ts in times.items():
            rows.append(harness.row(BENCH, op=op + suffix, provider=prov, shape=f"C={C},N={N}", dtype="float32",
                                    device=dev.type, stats=ts if isinstance(ts, harness.Stats) else harness.stats(ts)))

    for C in a.classes:
        for N in a.batches:
            inputs = pv.update_inputs(N, C, device=dev)
            cold = {}  # (provider, op) -> callable: the per-call rows
            groups, one_round = [], 0.0  # one_round: seconds of one call of each of them
            for prov in provs:
                grp = pv.make_update_group(prov, C, device=dev)
                groups.append(grp)
                upd, fwd, state_only, upd_result, upd_views = forward_calls(prov, grp, inputs)
                fns = {"group_update": upd, "group_forward": fwd}
                cold[(prov, "group_update")], cold[(prov, "group_forward")] = upd, fwd
                if state_only is not None:
                    fns["group_forward_state"] = state_only
                    fns["group_update_result"] = upd_result
                    fns["group_update_views"] = cold[(prov, "group_update_views")] = upd_views
                times = interleaved(fns, rounds, min_s, sync)
                add_rows(times, prov, C, N)
                one_round += statistics.median(times["group_update"]) + statistics.median(times["group_forward"])
                ratio = lambda op: statistics.median(f / u for f, u in zip(times[op], times["group_update"]))  # noqa: E731
                extra = (f", state only {ratio('group_forward_state'):.2f}x, update + result from Python "
                         f"{ratio('group_update_result'):.2f}x, update + result objects {ratio('group_update_views'):.2f}x"
                         if "group_forward_state" in times else "")
                print(f"{BENCH}: C={C:<5d} N={N:<6d} {prov:<18s} update {statistics.median(times['group_update']) * 1e6:9.1f} us"
                      f"  forward {statistics.median(times['group_forward']) * 1e6:9.1f} us  "
                      f"forward/update {ratio('group_forward'):.2f}x{extra}", flush=True)
            # each call alone, after the other contenders' calls and a 1 MiB write (as --hostcost): the caches
            # as a training step leaves them, not warmed by a loop of the same call
            n_rounds = max(min(percall, PERCALL_MIN_ROUNDS), min(percall, int(PERCALL_BUDGET_S / max(one_round, 1e-9))))
            per = hostcost_interleaved(cold, n_rounds, dev)
            for prov in provs:
                add_rows({op: st for (p, op), st in per.items() if p == prov}, prov, C, N, "_percall")
                u, f = per[(prov, "group_update")].p50, per[(prov, "group_forward")].p50
                v = per.get((prov, "group_update_views"))
                floor = f"  update + result objects {v.p50 / u:.2f}x" if v else ""
                print(f"{BENCH}: C={C:<5d} N={N:<6d} {prov:<18s} per call: update {u * 1e6:9.1f} us  "
                      f"forward {f * 1e6:9.1f} us  forward/update {f / u:.2f}x{floor}", flush=True)
            del groups, cold
    harness.write_csv(a.out, rows)
    print(f"{BENCH}: wrote {a.out} ({len(rows)} rows)")
    if not a.tiny:
        png = harness.plot(a.out, Path(a.out).with_suffix(".png"), x="N", panels="op",
                           title="group update vs forward (update + batch values), interleaved")
        print(f"{BENCH}: wrote {png}")
    return 0


def main(argv=None) -> int:
    a = parse(argv)
    if a.seg_peak:
        return segmentation_peak_child(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.forward:
        return main_forward(a)
    timing = harness.Timing.tiny() if a.tiny else (harness.Timing.quick() if a.quick else harness.Timing())
    rows, dev = [], torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    if a.hostcost == "only":
        hostcost_rows(a, timing, dev)
        return 0
    for C in a.classes if a.segmentation != "only" else ():
        for N in a.batches:
            inputs = pv.update_inputs(N, C, device=dev)
            for prov in a.providers:
                g = pv.make_update_group(prov, C, device=dev)
                g.update(*inputs)  # first call: allocation, torchmetrics compute-group detection
                if prov == "d9d" and dev.type == "cuda":
                    host_sync_check(g, inputs, a.out, C, N)
                st = harness.measure(lambda: g.update(*inputs), timing, sync=sync)
                rows.append(harness.row(BENCH, op="group_update", provider=prov, shape=f"C={C},N={N}",
                                        dtype="float32", device=dev.type, stats=st))
                print(f"{BENCH}: C={C:<5d} N={N:<6d} {prov:<18s} {st.p50 * 1e6:>12.1f} us  "
                      f"[p20 {st.p20 * 1e6:.1f}, p80 {st.p80 * 1e6:.1f}]", flush=True)
                del g
    if a.segmentation != "off":  # its own CSV beside --out, as the memory and host-cost ones
        seg = harness.write_csv(Path(a.out).with_name(f"{BENCH}_segmentation.csv"), segmentation_rows(a, timing, dev))
        print(f"{BENCH}: wrote {seg}")
    if a.hostcost != "off" and a.segmentation != "only":
        hostcost_rows(a, timing, dev)
    if rows:
        harness.write_csv(a.out, rows)
        print(f"{BENCH}: wrote {a.out} ({len(rows)} rows)")
    return 0


# ---------------------------------------------------------------- segmentation
SEG_FULL = (8, 21, 512, 512)
SEG_QUICK = (4, 21, 128, 128)
SEG_TINY = (2, 5, 8, 8)
SEG_PROVIDERS = ("d9d", "d9d_movedim_copy", "torchmetrics", "torchmetrics_fast", "plain_torch")


def segmentation_update(provider: str, C: int, device):
    """``(update(preds, target), compute() -> (pixel accuracy, mean IoU))`` of one provider."""
    if provider.startswith("d9d"):
        import d9d_kernels as dk

        copy = provider == "d9d_movedim_copy"
        kw = dict(task="multiclass", num_classes=C, class_dim=-1 if copy else None)
        g = dk.MetricGroup({"acc": dk.Accuracy(**kw), "miou": dk.JaccardIndex(**kw)}, device=device)

        def update(p, t):
            g.update(preds=p.movedim(1, -1).contiguous() if copy else p, target=t)

        return update, lambda: tuple(g.compute().values())
    if provider.startswith("torchmetrics"):
        from torchmetrics import MetricCollection
        from torchmetrics.classification import MulticlassAccuracy, MulticlassJaccardIndex

        kw = dict(num_classes=C, validate_args=provider == "torchmetrics")
        col = MetricCollection({"acc": MulticlassAccuracy(**kw, average="micro"),
                                "miou": MulticlassJaccardIndex(**kw)}).to(device)
        return col.update, lambda: tuple(col.compute().values())
    confmat = torch.zeros(C * C, dtype=torch.int64, device=device)  # plain torch: rows = target

    def update(p, t):
        confmat.add_(torch.bincount((t * C + p.argmax(1)).reshape(-1), minlength=C * C))

    def compute():
        cm = confmat.reshape(C, C).double()
        tp = cm.diagonal()
        union = cm.sum(0) + cm.sum(1) - tp
        return tp.sum() / cm.sum(), (tp / union)[union > 0].mean()

    return update, compute


def _resident_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    raise KeyError(key)


def _fresh_pages_for_large_allocations() -> None:
    """glibc serves a freed block again from resident pages, invisible to the
    high-water mark: a fixed 64 KiB mmap threshold maps every larger block
    afresh (and unmaps it when freed), so each one shows in the mark."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
    except OSError:
        pass


def peak_extra_mib(fn, device) -> float:
    """Peak memory that one ``fn()`` adds on top of what exists before it (MiB)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5" resets the resident high-water mark (Linux)
            f.write("5")
        base = _resident_kib("VmRSS")
        fn()
        return (_resident_kib("VmHWM") - base) / 1024
    except OSError:
        return float("nan")


def _segmentation_inputs(N, C, H, W, dev):
    g = torch.Generator(device=dev).manual_seed(0)
    return torch.randn(N, C, H, W, device=dev, generator=g), torch.randint(0, C, (N, H, W), device=dev, generator=g)


def segmentation_peak_child(a) -> int:
    """Child process: prints the least of 3 peaks of one warm update (MiB)."""
    _fresh_pages_for_large_allocations()
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    N, C, H, W = (int(v) for v in a.seg_shape.split(","))
    preds, target = _segmentation_inputs(N, C, H, W, dev)
    update, _ = segmentation_update(a.seg_peak, C, dev)
    update(preds, target)
    print("peak_extra_mib", min(peak_extra_mib(lambda: update(preds, target), dev) for _ in range(3)))
    return 0


def segmentation_rows(a, timing, dev) -> list[dict]:
    import csv

    N, C, H, W = SEG_TINY if a.tiny else (SEG_QUICK if a.quick else SEG_FULL)
    shape = f"N={N},C={C},H={H},W={W}"
    preds, target = _segmentation_inputs(N, C, H, W, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    input_mib = (preds.numel() * preds.element_size() + target.numel() * target.element_size()) / 2**20
    rows, mem, values = [], [], {}
    for prov in SEG_PROVIDERS:
        update, compute = segmentation_update(prov, C, dev)
        update(preds, target)  # warm-up: allocation, compute-group detection
        values[prov] = [float(v) for v in compute()]
        st = harness.measure(lambda: update(preds, target), timing, sync=sync)
        rows.append(harness.row(BENCH, op="segmentation_update", provider=prov, shape=shape, dtype="float32",
                                device=dev.type, stats=st))
        print(f"{BENCH}: segmentation {shape} {prov:<18s} {st.p50 * 1e3:>10.2f} ms  "
              f"[p20 {st.p20 * 1e3:.2f}, p80 {st.p80 * 1e3:.2f}]", flush=True)
        del update, compute
    del preds, target
    for prov in SEG_PROVIDERS:  # each in a fresh process: no freed memory of another provider to reuse
        cmd = [sys.executable, __file__, "--seg-peak", prov, "--seg-shape", f"{N},{C},{H},{W}", "--device", a.device]
        if a.threads:
            cmd += ["--threads", str(a.threads)]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
        peak = float(out.strip().splitlines()[-1].split()[-1])
        mem.append({"provider": prov, "shape": shape, "device": dev.type, "input_mib": f"{input_mib:.1f}",
                    "peak_extra_mib": f"{peak:.1f}", "git_sha": harness.git_sha()})
        print(f"{BENCH}: segmentation {shape} {prov:<18s} peak +{peak:.1f} MiB over {input_mib:.1f} MiB of inputs",
              flush=True)
    ref = values["torchmetrics"]
    for prov, v in values.items():  # the same numbers, or the timing compares different work
        if max(abs(x - y) for x, y in zip(v, ref)) > 1e-5:
            raise AssertionError(f"{BENCH}: segmentation {prov} gives {v}, torchmetrics {ref}")
    path = Path(a.out).with_name(f"{BENCH}_segmentation_memory.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(mem[0]))
        w.writeheader()
        w.writerows(mem)
    print(f"{BENCH}: wrote {path}")
    return rows


# ------------------------------------------------------------------ host cost
HOST_C, HOST_B = 10, 256
HOST_ROUNDS = {"full": 400, "quick": 150, "tiny": 5}
#: bytes written between two interleaved calls (--flush-kib): a model step's cache traffic
FLUSH_KIB = 1024


def hostcost_contenders(C: int, B: int, dev) -> dict:
    """``{(provider, weights): fn()}``: one training step's metric update of the
    bench group (loss weighted mean + acc, top-5, macro F1/P/R, confmat) per
    provider, with the loss weight (the batch's token count) as a Python
    number and as a 0-d tensor; d9d's parts alone; the raw custom-op calls
    the d9d step makes (the floor)."""
    import d9d_kernels as dk

    logits, target, loss, n = pv.update_inputs(B, C, device=dev)
    n_t = torch.tensor(float(n), device=dev)  # 0-d, loss's dtype: e.g. (labels != ignore).sum().float()
    out = {}
    for weights, w in (("number", n), ("tensor", n_t)):
        for prov in ("d9d", "torchmetrics", "torchmetrics_fast", "plain_torch"):
            g = pv.make_update_group(prov, C, device=dev)
            out[(prov, weights)] = (lambda g=g, w=w: g.update(logits, target, loss, w))
    g = pv.make_update_group("d9d", C, device=dev).g
    out[("d9d_loss_member", "tensor")] = lambda: g["loss"].update(values=loss, weights=n_t)
    out[("d9d_group_update", "-")] = lambda: g.update(preds=logits, target=target)
    m = dk.WeightedMeanMetric().to(dev)
    out[("d9d_weighted_mean", "tensor")] = lambda: m.update(values=loss, weights=n_t)
    out[("d9d_weighted_mean", "number")] = lambda: m.update(values=loss, weights=n)
    # the floor: the op calls the d9d step makes, from Python, on a copy of its state
    st = pv.make_update_group("d9d", C, device=dev).g._storage
    by_type = {type(s).__name__: j for j, s in enumerate(st.layout.stats)}
    cs, wm = st.layout.stats[by_type["ClassStatistic"]], st.local_views[by_type["ClassStatistic"]]
    mv = st.local_views[by_type["MomentsStatistic"]]
    op_cs, op_wm = torch.ops.d9d_kernels.class_stats.default, torch.ops.d9d_kernels.weighted_moments.default
    ks, loss1, n1 = list(cs.top_ks), loss.reshape(-1), n_t.reshape(-1)

    def raw_cs():
        op_cs(logits, target, None, C, cs.ignore_index, ks, cs.nll, wm["stats"], wm.get("confmat"), wm["extras"], wm["bad"])

    def raw_wm():
        op_wm(loss1, None, n1, None, False, mv["moments"], mv["bad"], mv["pivot"])

    out[("raw_class_stats", "-")] = raw_cs
    out[("raw_weighted_moments", "tensor")] = raw_wm
    out[("raw_ops", "tensor")] = lambda: (raw_wm(), raw_cs())
    return out


def hostcost_interleaved(fns: dict, rounds: int, dev, flush_kib: int = FLUSH_KIB) -> dict:
    """Per-call times of every contender called round-robin (a new random
    order each round: no contender always follows the same one), with
    ``flush_kib`` KiB written between two calls: each call finds the caches
    as a training step leaves them, not warmed by its own loop."""
    import random

    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    flush = torch.empty(max(1, flush_kib * 256), dtype=torch.float32, device=dev)
    keys = list(fns)
    times = {k: [] for k in keys}
    for fn in fns.values():
        fn()
    rng = random.Random(0)
    for r in range(rounds):
        order = keys[:]
        rng.shuffle(order)
        for k in order:
            flush.fill_(float(r))
            sync()
            t0 = time.perf_counter()
            fns[k]()
            sync()
            times[k].append(time.perf_counter() - t0)
    return {k: harness.stats(v) for k, v in times.items()}


def hot_blocks(fns: dict, timing, sync) -> dict:
    """Per-call times of each contender in its own loop (hot caches), the
    loops of all contenders taking turns (a random order per round): a slow
    period of a shared machine hits every contender, not just one."""
    import random

    sync = sync or (lambda: None)
    number = {}
    for k, fn in fns.items():  # warm up, then size each block to ~min_repeat_s
        for _ in range(max(1, timing.warmup)):
            fn()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        one = time.perf_counter() - t0
        number[k] = max(1, int(timing.min_repeat_s / max(one, 1e-9))) if timing.min_repeat_s > 0 else 1
    times = {k: [] for k in fns}
    rng, keys = random.Random(1), list(fns)
    for _ in range(max(3, timing.repeats)):
        rng.shuffle(keys)
        for k in keys:
            fn, n = fns[k], number[k]
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            times[k].append((time.perf_counter() - t0) / n)
    return {k: harness.stats(v) for k, v in times.items()}


def hostcost_rows(a, timing, dev) -> list[dict]:
    """Writes ``bench_update_hostcost.csv`` beside ``--out``: hot (each
    contender in its own loop) and interleaved medians."""
    C, B = HOST_C, HOST_B
    fns = hostcost_contenders(C, B, dev)
    rows = []
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    for (prov, weights), st in hot_blocks(fns, timing, sync).items():
        rows.append(harness.row(BENCH, op="host_update_hot", provider=prov, shape=f"C={C},N={B},weights={weights}",
                                dtype="float32", device=dev.type, stats=st))
        print(f"{BENCH}: hot         {prov:<22s} weights={weights:<7s} {st.p50 * 1e6:8.2f} us", flush=True)
    rounds = HOST_ROUNDS["tiny" if a.tiny else "quick" if a.quick else "full"]
    for op, kib in (("host_update_interleaved", 0), ("host_update_interleaved_flush", a.flush_kib)):
        for (prov, weights), st in hostcost_interleaved(fns, rounds, dev, kib).items():
            rows.append(harness.row(BENCH, op=op, provider=prov, shape=f"C={C},N={B},weights={weights}",
                                    dtype="float32", device=dev.type, stats=st))
            print(f"{BENCH}: {op} {prov:<22s} weights={weights:<7s} {st.p50 * 1e6:8.2f} us", flush=True)
    path = Path(a.out).with_name(f"{BENCH}_hostcost.csv")
    harness.write_csv(path, rows)
    print(f"{BENCH}: wrote {path}")
    return rows


if __name__ == "__main__":
    sys.exit(main())
