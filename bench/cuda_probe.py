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
    C = 10 if case.startswith("class_stats") or case == "score_histogram" else 0
    run, raw, _, _ = bk.CASES[case](n, C)
    calls = [("raw", raw)] + [(b, lambda b=b: run(b)) for b in ("cuda", "triton", "torch") if b in dk.ops.backends()]
    for name, fn in calls:
        fn()
        torch.cuda.synchronize()
        print(f"  {case} N={n} {name}: ok", flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # child process
    p.add_argument("--sanitize", action="store_true")
    p.add_argument("--failed-to", default=None, help="file that gets the failing case names")
    a = p.parse_args()
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
