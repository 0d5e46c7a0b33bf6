"""Throughput of the five kernels: C++ (cpp) or CUDA / Triton vs the plain-PyTorch
reference (torch) vs a memory-read floor, plus the per-call overhead of tiny inputs.

    python bench/bench_kernels.py [--quick] [--device cpu|cuda] [--out bench/results/bench_kernels.csv]

Providers: ``cpp`` = dk.ops wrapper on the C++ kernel, ``cpp_raw`` = the
``torch.ops.d9d_kernels.<op>.default`` call alone (N=1 only), ``torch`` = the
dk.ops wrapper on ``d9d_kernels.reference``, ``floor`` = ``x.sum()`` over as
many bytes as the op's inputs (what reading them once costs). The reference is
skipped where its float64 [N, C] temporaries would not fit in memory.

``--device cuda`` (a GPU machine): providers ``cuda`` / ``cuda_raw`` (the CUDA
kernels of ``_C``) and ``triton``, timed with ``torch.cuda.synchronize``; the
table adds GB/s of the op's input bytes and the fraction of the measured read
floor (the HBM estimates of bench/analysis.md, "Kernel figures", measured), and the plan adds the
issue's sizes (1e8-element 1-D inputs, 10k-bin histograms, [16384, 128000]
bfloat16 logits with top-5 + NLL). Default output there:
bench/results/bench_kernels_cuda.csv.
Writes the CSV, a PNG next to it, and prints a table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

import d9d_kernels as dk  # noqa: E402

BENCH = "bench_kernels"
REF_BYTES_LIMIT = 6e9  # skip the reference when its temporaries exceed this
QUICK_REF_MAX_N = 10**6  # --quick: the reference takes seconds per call beyond this


DEV = torch.device("cpu")  # set by main() from --device
DTYPE = torch.float32  # inputs of the float cases (class_stats logits may override)


def f64(*shape, fill=0.0):
    return torch.full(shape, fill, dtype=torch.float64, device=DEV)


def randn(*shape, dtype=None):
    return torch.randn(*shape, device=DEV, dtype=dtype or DTYPE)


def rand(*shape):
    return torch.rand(*shape, device=DEV, dtype=DTYPE)


def randint(hi, shape):
    return torch.randint(0, hi, shape, device=DEV)


def case_weighted_moments(N, C):
    x, y, w = randn(N), randn(N), rand(N)
    st, bad = f64(9), f64(1)
    run = lambda b: dk.ops.weighted_moments(x, y, w, state=st, bad=bad, backend=b)  # noqa: E731
    raw = lambda: torch.ops.d9d_kernels.weighted_moments.default(x, y, w, None, False, st, bad, None)  # noqa: E731
    return run, raw, 3 * N * 4, 12 * N * 8


def case_running_extrema(N, C):
    x = randn(N)
    st, bad = f64(2, fill=float("-inf")), f64(1)
    run = lambda b: dk.ops.running_extrema(x, state=st, bad=bad, backend=b)  # noqa: E731
    raw = lambda: torch.ops.d9d_kernels.running_extrema.default(x, None, False, st, bad)  # noqa: E731
    return run, raw, N * 4, 4 * N * 8


def case_class_stats_indices(N, C):
    p, t = randint(C, (N,)), randint(C, (N,))
    st, ex, bad = f64(1, 3, C), f64(2), f64(2)
    run = lambda b: dk.ops.class_stats(p, t, num_classes=C, stats=st, extras=ex, bad=bad, backend=b)  # noqa: E731
    raw = lambda: torch.ops.d9d_kernels.class_stats.default(p, t, None, C, None, [1], False, st, None, ex, bad)  # noqa: E731
    return run, raw, 2 * N * 8, 3 * N * C * 8


def case_class_stats_logits(N, C):
    # the GPU plan's vocabulary-sized rows are bfloat16, as a language model's logits
    p, t = randn(N, C, dtype=torch.bfloat16 if C >= 100_000 else None), randint(C, (N,))
    ks = (1, 5) if C >= 5 else (1,)
    st, ex, bad = f64(len(ks), 3, C), f64(2), f64(2)
    run = lambda b: dk.ops.class_stats(p, t, num_classes=C, stats=st, extras=ex, bad=bad, top_ks=ks, nll=True, backend=b)  # noqa: E731
    raw = lambda: torch.ops.d9d_kernels.class_stats.default(p, t, None, C, None, list(ks), True, st, None, ex, bad)  # noqa: E731
    return run, raw, N * C * p.element_size() + N * 8, 7 * N * C * 8


def case_binary_stats(N, C):
    p, t = randn(N), randint(2, (N,))
    st, bad = f64(1, 4), f64(2)
    run = lambda b: dk.ops.binary_stats(p, t, state=st, bad=bad, backend=b)  # noqa: E731
    raw = lambda: torch.ops.d9d_kernels.binary_stats.default(p[:, None], t[:, None], None, 0.5, None, 2, st, bad)  # noqa: E731
    return run, raw, N * 12, 10 * N * 8


def case_score_histogram(N, C):
    p, t = rand(N), randint(2, (N,))
    h, bad = f64(2, 1, C), f64(2)
    run = lambda b: dk.ops.score_histogram(p, t, hist=h, bad=bad, backend=b)  # noqa: E731
    raw = lambda: torch.ops.d9d_kernels.score_histogram.default(p[:, None], t[:, None], None, None, 2, False, h, bad)  # noqa: E731
    return run, raw, N * 12, 10 * N * 8


def case_expert_histogram(N, C):
    # MoE routing: N slots over L = 48 layers (fewer when N is tiny), C experts
    L = max(1, min(48, N))
    E = C or 128
    idx = randint(E, (L, max(1, N // L)))
    load, bad = f64(L, E), f64(1)
    layers = list(range(L))
    run = lambda b: dk.ops.expert_histogram(idx, layers, load=load, bad=bad, backend=b)  # noqa: E731
    raw = lambda: torch.ops.d9d_kernels.expert_histogram.default(idx, layers, None, load, None, bad)  # noqa: E731
    return run, raw, idx.numel() * 8, 6 * idx.numel() * 8


def tiny_classes(case: str) -> int:
    """C of the N=1 (per-call overhead) row of ``case``."""
    return 10 if case.startswith("class_stats") or case in ("score_histogram", "expert_histogram") else 0


CASES = {
    "weighted_moments": case_weighted_moments,
    "running_extrema": case_running_extrema,
    "class_stats_indices": case_class_stats_indices,
    "class_stats_logits": case_class_stats_logits,
    "binary_stats": case_binary_stats,
    "score_histogram": case_score_histogram,
    "expert_histogram": case_expert_histogram,
}


def plan_cuda(quick: bool):
    """(case, N, C) triples on a GPU: sizes where HBM bandwidth, not launch latency, decides."""
    ns = [10**6, 10**8] if quick else [10**5, 10**6, 10**7, 10**8]
    out = []
    for case in ("weighted_moments", "running_extrema", "binary_stats"):
        out += [(case, n, 0) for n in ns]
    out += [("score_histogram", n, B) for n in ns for B in (1000, 10_000)]
    out += [("expert_histogram", n, 128) for n in ns]
    for C in (10, 1000):
        out += [("class_stats_indices", n, C) for n in ns]
    logits = [(4096, 32000), (16384, 128000)] if quick else [(16384, 1000), (4096, 32000), (3, 50257), (16384, 128000)]
    out += [("class_stats_logits", n, c) for n, c in logits]
    return out


def plan(quick: bool):
    """(case, N, C) triples."""
    ns = [10**3, 10**5, 10**7] if quick else [10**3, 10**4, 10**5, 10**6, 10**7]
    out = []
    for case in ("weighted_moments", "running_extrema", "binary_stats"):
        out += [(case, n, 0) for n in ns]
    out += [("score_histogram", n, 1000) for n in ns]
    out += [("expert_histogram", n, 128) for n in ns]
    for C in (10, 1000):
        out += [("class_stats_indices", n, C) for n in ns]
    logits = [(256, 1000), (2048, 1000), (128, 32000)] if quick else [(1024, 1000), (16384, 1000), (1024, 32000), (16384, 32000)]
    out += [("class_stats_logits", n, c) for n, c in logits]
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats (< 3 min on 2 cores)")
    p.add_argument("--tiny", action="store_true", help="alias of --quick")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", default=None, help="CSV path (default bench/results/bench_kernels[_cuda].csv)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--skip", nargs="*", default=[], choices=list(CASES), help="cases left out (bench/cuda_probe.py "
                   "names those that fault)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    global DEV
    a = parse(argv)
    quick = a.quick or a.tiny
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.device == "cuda":
        return main_cuda(a, quick)
    a.out = a.out or str(harness.RESULTS / f"{BENCH}.csv")
    timing = harness.Timing.quick() if quick else harness.Timing()
    have_cpp = "cpp" in dk.ops.backends()
    rows, table = [], []

    def record(op, provider, shape, dtype, st):
        rows.append(harness.row(BENCH, op=op, provider=provider, shape=shape, dtype=dtype, device="cpu", stats=st))
        table.append((op, shape, provider, st.p50 * 1e6))

    # per-call overhead at N=1: the raw op and the wrapper
    for case, make in CASES.items():
        C = tiny_classes(case)
        run, raw, _, _ = make(1, C)
        shape = f"N=1,C={C}"
        if have_cpp:
            record(case, "cpp_raw", shape, "float32", harness.measure(raw, timing))
            record(case, "cpp", shape, "float32", harness.measure(lambda: run("cpp"), timing))
        record(case, "torch", shape, "float32", harness.measure(lambda: run("torch"), timing))

    for case, n, C in plan(quick):
        run, _, in_bytes, ref_bytes = CASES[case](n, C)
        shape = f"N={n},C={C}"
        if have_cpp:
            record(case, "cpp", shape, "float32", harness.measure(lambda: run("cpp"), timing))
        if ref_bytes <= REF_BYTES_LIMIT and not (quick and n > QUICK_REF_MAX_N):
            slow = harness.Timing(warmup=1, repeats=3, min_repeat_s=0.0) if n >= 10**6 else timing
            record(case, "torch", shape, "float32", harness.measure(lambda: run("torch"), slow))
        floor = torch.randn(max(1, in_bytes // 4))
        record(case, "floor", shape, "float32", harness.measure(lambda: floor.sum(), timing))
        del run, floor
        print(f"{BENCH}: {case:<20s} {shape:<16s} done", flush=True)

    path = harness.write_csv(a.out, rows)
    harness.plot(path, Path(a.out).with_suffix(".png"), x="N", title="d9d_kernels CPU ops (p50 per call)")
    print_table(table)
    print(f"{BENCH}: wrote {path} ({len(rows)} rows)")
    return 0


def main_cuda(a, quick: bool) -> int:
    """The GPU run: cuda / cuda_raw / triton vs the reference and a read floor."""
    global DEV
    if not torch.cuda.is_available():
        print(f"{BENCH}: --device cuda needs a visible GPU", file=sys.stderr)
        return 2
    DEV = torch.device("cuda")
    a.out = a.out or str(harness.RESULTS / f"{BENCH}_cuda.csv")
    sync = torch.cuda.synchronize
    timing = harness.Timing.quick() if quick else harness.Timing()
    providers = [b for b in ("cuda", "triton") if b in dk.ops.backends()]
    free = torch.cuda.mem_get_info()[0]
    rows, table = [], []

    def record(op, provider, shape, dtype, st, in_bytes=None):
        rows.append(harness.row(BENCH, op=op, provider=provider, shape=shape, dtype=dtype, device="cuda", stats=st))
        table.append((op, shape, provider, st.p50 * 1e6, in_bytes))

    cases = {k: v for k, v in CASES.items() if k not in a.skip}
    for case, make in cases.items():  # per-call overhead (launch + wrapper) at N=1
        C = tiny_classes(case)
        run, raw, _, _ = make(1, C)
        shape = f"N=1,C={C}"
        if "cuda" in providers:
            record(case, "cuda_raw", shape, "float32", harness.measure(raw, timing, sync))
        for b in providers:
            record(case, b, shape, "float32", harness.measure(lambda: run(b), timing, sync))

    for case, n, C in plan_cuda(quick):
        if case in a.skip:
            continue
        run, _, in_bytes, ref_bytes = CASES[case](n, C)
        shape = f"N={n},C={C}"
        dtype = "bfloat16" if case == "class_stats_logits" and C >= 100_000 else "float32"
        for b in providers:
            record(case, b, shape, dtype, harness.measure(lambda: run(b), timing, sync), in_bytes)
        if ref_bytes <= min(REF_BYTES_LIMIT, free / 2) and not (quick and n > QUICK_REF_MAX_N):
            record(case, "torch", shape, dtype, harness.measure(lambda: run("torch"), timing, sync), in_bytes)
        floor = torch.randn(max(1, in_bytes // 4), device=DEV)
        record(case, "floor", shape, "float32", harness.measure(lambda: floor.sum(), timing, sync), in_bytes)
        del run, floor
        torch.cuda.empty_cache()
        print(f"{BENCH}: {case:<20s} {shape:<18s} done", flush=True)

    path = harness.write_csv(a.out, rows)
    harness.plot(path, Path(a.out).with_suffix(".png"), x="N",
                 title=f"d9d_kernels CUDA ops on {torch.cuda.get_device_name()} (p50 per call)")
    print_table_cuda(table)
    print(f"{BENCH}: wrote {path} ({len(rows)} rows)")
    return 0


def print_table_cuda(table):
    """µs per call, GB/s of the op's input bytes, and the fraction of the read floor's GB/s."""
    by = {}
    for op, shape, prov, us, nbytes in table:
        by.setdefault((op, shape), {})[prov] = (us, nbytes)
    provs = ("cuda", "triton", "torch", "floor")
    hdr = f"| {'op':<20s} | {'shape':<18s} | " + " | ".join(f"{p + ' µs':>10s}" for p in provs)
    hdr += f" | {'cuda GB/s':>9s} | {'cuda/floor':>10s} | {'triton/floor':>12s} |"
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    for (op, shape), d in by.items():
        us = {p: d[p][0] for p in d}
        nbytes = next((v[1] for v in d.values() if v[1]), None)
        cells = " | ".join(f"{us[p]:10.1f}" if p in us else f"{'-':>10s}" for p in provs)
        gbs = f"{nbytes / us['cuda'] / 1e3:9.0f}" if nbytes and "cuda" in us else f"{'-':>9s}"
        frac = lambda p, w: f"{us['floor'] / us[p]:{w}.2f}" if p in us and "floor" in us else f"{'-':>{w}s}"  # noqa: E731
        print(f"| {op:<20s} | {shape:<18s} | {cells} | {gbs} | {frac('cuda', 10)} | {frac('triton', 12)} |")


def print_table(table):
    by = {}
    for op, shape, prov, us in table:
        by.setdefault((op, shape), {})[prov] = us
    hdr = f"| {'op':<20s} | {'shape':<16s} | {'cpp µs':>10s} | {'torch µs':>10s} | {'floor µs':>9s} | {'torch/cpp':>9s} | {'cpp/floor':>9s} |"
    print(hdr)
    print("|" + "|".join("-" * (len(c)) for c in hdr.split("|")[1:-1]) + "|")
    for (op, shape), d in by.items():
        cpp, ref, fl = d.get("cpp"), d.get("torch"), d.get("floor")
        raw = d.get("cpp_raw")
        fmt = lambda v: f"{v:10.1f}" if v is not None else f"{'-':>10s}"  # noqa: E731
        ratio = lambda a, b: f"{a / b:9.1f}" if a and b else f"{'-':>9s}"  # noqa: E731
        extra = f"  (raw op {raw:.2f} µs)" if raw is not None else ""
        print(f"| {op:<20s} | {shape:<16s} | {fmt(cpp)} | {fmt(ref)} | {fl if fl is None else round(fl, 1)!s:>9} | "
              f"{ratio(ref, cpp)} | {ratio(cpp, fl)} |{extra}")


if __name__ == "__main__":
    sys.exit(main())
