"""Runs every benchmark, then the report (``make bench`` == ``run_all.py --quick``).

    python bench/run_all.py [--quick | --tiny] [--results DIR] [--doc PATH] [--only update sync ...]

Each benchmark runs in its own process (a fresh interpreter, no state shared
between benchmarks) with a time limit; one failing does not stop the others,
but makes the exit status non-zero. ``--quick`` keeps the whole suite under
10 minutes on a 2-core CPU machine; ``--tiny`` is the smoke-test mode used by
tests/bench/test_bench_smoke.py (seconds, numbers meaningless).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BENCHES = ("kernels", "update", "sync", "ring", "training", "scale", "lm", "d9d")
# seconds allowed per benchmark in --quick mode (sum < 10 min with the report)
QUICK_LIMIT = {"kernels": 180, "update": 150, "sync": 150, "ring": 45, "training": 60,
               "scale": 60, "lm": 120, "d9d": 90}  # took 27, 19, 107, 22, 18, 3, ~30, ~30 s


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true")
    mode.add_argument("--tiny", action="store_true")
    p.add_argument("--results", default=str(HERE / "results"))
    p.add_argument("--doc", default=str(ROOT / "docs" / "performance.md"))
    p.add_argument("--only", nargs="*", default=None, help="benchmark names (bench_<name>.py)")
    p.add_argument("--no-report", action="store_true")
    return p.parse_args(argv)


def others() -> list[str]:
    """Other bench_*.py scripts (written by other owners), run by name."""
    return sorted(p.stem[len("bench_"):] for p in HERE.glob("bench_*.py") if p.stem[len("bench_"):] not in BENCHES)


def command(name: str, a) -> list[str] | None:
    script = HERE / f"bench_{name}.py"
    if not script.exists():
        return None
    cmd = [sys.executable, str(script)]
    if name not in BENCHES:  # unknown flags: --quick if it has one, its own output path
        if a.quick or a.tiny:
            return cmd + ["--quick"] if "--quick" in script.read_text() else None
        return cmd
    if a.tiny:
        cmd.append("--tiny" if name != "kernels" else "--quick")
    elif a.quick:
        cmd.append("--quick")
    cmd += ["--out", str(Path(a.results) / f"bench_{name}.csv")]
    return cmd


def run(cmd: list[str], env: dict, limit: float):
    """Runs ``cmd`` in its own session; on timeout kills it and every process it spawned."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timeout"


def main(argv=None) -> int:
    a = parse(argv)
    Path(a.results).mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    failed, t_all = [], time.perf_counter()
    for name in a.only or (list(BENCHES) + others()):
        cmd = command(name, a)
        if cmd is None:
            print(f"run_all: bench_{name}.py not found or has no --quick mode, skipped", flush=True)
            continue
        limit = QUICK_LIMIT.get(name, 120) * (2 if a.tiny else 1) if (a.quick or a.tiny) else 3600
        print(f"run_all: {' '.join(cmd[1:])} (limit {limit}s)", flush=True)
        t = time.perf_counter()
        rc = run(cmd, env, limit)
        dt = time.perf_counter() - t
        print(f"run_all: bench_{name} -> {rc} in {dt:.1f}s", flush=True)
        if rc != 0:
            failed.append(f"{name} ({rc})")
    if not a.no_report:
        rc = subprocess.run([sys.executable, str(HERE / "report.py"), "--results", a.results, "--doc", a.doc],
                            cwd=ROOT, env=env, timeout=300).returncode
        if rc != 0:
            failed.append(f"report ({rc})")
    print(f"run_all: done in {time.perf_counter() - t_all:.1f}s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
