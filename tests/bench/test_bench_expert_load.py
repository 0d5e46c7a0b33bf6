"""bench/bench_expert_load.py in its tiny mode: runs and writes well-formed CSV / PNG (no timing asserted)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run(tmp_path):
    out = tmp_path / "bench_expert_load.csv"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_expert_load.py"), "--tiny", "--threads", "1",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["provider"] for r in rows} == {"ExpertLoad.update", "bincount_offset", "per_layer_torch", "read_floor"}
    assert all(0 < float(r["p20_us"]) <= float(r["p50_us"]) <= float(r["p80_us"]) for r in rows)
    assert out.with_suffix(".png").stat().st_size > 1000
