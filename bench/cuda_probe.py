"""Runs every bench_kernels case once per provider on a GPU, each case in its own
process (a faulting kernel poisons its CUDA context), and names the first call
that fails. With --sanitize, a failing case is run again under compute-sanitizer.

    python bench/cuda_probe.py [--n 1] [--sanitize]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def one_case(case: str, n: int) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    import bench_kernels as bk

    import d9d_kernels as dk

    bk.DEV = torch.device("cuda")
    run, raw, _, _ = bk.CASES[case](n, bk.tiny_classes(case))
    calls = [("raw", raw)] + [(b, lambda b=b: run(b)) for b in ("cuda", "triton", "torch") if b in dk.ops.backends()]
    for name, fn in calls:
        fn()
        torch.cuda.synchronize()
        print(f"  {case} N={n} {name}: ok", flush=True)


def class_stats_variants(out: str) -> None:
    """Where the scores pass spends its time, on vocabulary rows (a block per
    row) and [131072, 1000] (a warp per row): the same logits with top-1
    alone, + NLL, + top-5, against a read of the same bytes (to the
    CSV ``out``: median µs per call, ``top_ks`` = "floor" for the read)."""
    import csv

    import torch
    from triton.testing import do_bench

    import d9d_kernels  # noqa: F401  (registers torch.ops.d9d_kernels)

    dev = torch.device("cuda")
    op = torch.ops.d9d_kernels.class_stats.default
    rows = []
    for (n, C), dtype in (((16384, 128000), torch.bfloat16), ((4096, 128000), torch.float32),
                          ((16384, 32000), torch.bfloat16), ((131072, 1000), torch.bfloat16)):
        x = torch.randn(n, C, device=dev).to(dtype)
        t = torch.randint(0, C, (n,), device=dev)
        floor = do_bench(lambda: x.sum(), return_mode="median")
        gb = x.numel() * x.element_size() / 1e9
        print(f"  class_stats [{n}, {C}] {dtype}: read floor {floor * 1e3:.0f} us ({gb / floor * 1e3:.0f} GB/s)")
        name = str(dtype).removeprefix("torch.")
        rows.append(dict(n=n, C=C, dtype=name, top_ks="floor", nll="", p50_us=round(floor * 1e3)))
        for ks, nll in (((1,), False), ((1,), True), ((1, 5), False), ((1, 5), True), ((1, 5, 10), True)):
            st, ex, bad = (torch.zeros(s, dtype=torch.float64, device=dev) for s in ((len(ks), 3, C), (2,), (2,)))
            ms = do_bench(lambda: op(x, t, None, C, None, list(ks), nll, st, None, ex, bad), return_mode="median")
            print(f"    top_ks={ks} nll={nll}: {ms * 1e3:.0f} us = {floor / ms:.2f} of the read floor", flush=True)
            rows.append(dict(n=n, C=C, dtype=name, top_ks=",".join(map(str, ks)), nll=nll, p50_us=round(ms * 1e3)))
        del x
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]), lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # child process
    p.add_argument("--sanitize", action="store_true")
    p.add_argument("--failed-to", default=None, help="file that gets the failing case names")
    p.add_argument("--class-stats-variants", action="store_true", help="time the scores pass by feature")
    p.add_argument("--out", default=str(HERE / "results" / "class_stats_variants_cuda.csv"),
                   help="--class-stats-variants: CSV path")
    a = p.parse_args()
    if a.class_stats_variants:
        class_stats_variants(a.out)
        return 0
    if a.case:
        one_case(a.case, a.n)
        return 0
    sys.path.insert(0, str(HERE))
    import bench_kernels as bk

    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    failed = []
    for case in bk.CASES:
        r = subprocess.run([sys.executable, __file__, "--case", case, "--n", str(a.n)], env=env,
                           capture_output=True, text=True, timeout=120)
        print(r.stdout, end="")
        if r.returncode:
            failed.append(case)
            print(f"  {case} N={a.n}: FAILED\n" + "\n".join(r.stderr.strip().splitlines()[-6:]), flush=True)
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if a.sanitize and failed and os.path.exists(sanitizer):
        r = subprocess.run([sanitizer, "--print-limit", "3", sys.executable, __file__, "--case", failed[0],
                            "--n", str(a.n)], capture_output=True, text=True, timeout=180)
        print("\n".join((r.stdout + r.stderr).splitlines()[:60]))
    print(f"cuda_probe: {len(failed)} of {len(bk.CASES)} cases failed: {failed}")
    if a.failed_to:
        Path(a.failed_to).write_text(" ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
