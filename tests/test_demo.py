"""`make demo` (examples/demo.py) in its quick mode: runs, writes well-formed results, agrees with torchmetrics.

No timing is asserted (the overhead figures are reported, not tested).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.example_loader import load_example

ROOT = Path(__file__).resolve().parents[1]


def _demo_module():
    return load_example("demo.py", "d9d_demo")


@pytest.mark.timeout(600)
def test_demo_quick(tmp_path):
    out = tmp_path / "demo"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "examples/demo.py", "--quick", "--steps", "20", "--log-every", "5",
         "--out", str(out), "--timeout", "400"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=500,
    )
    assert proc.returncode == 0, f"demo failed:\nSTDOUT:\n{proc.stdout[-4000:]}\nSTDERR:\n{proc.stderr[-4000:]}"
    text = proc.stdout + proc.stderr
    # a table row per logging step, then the summary
    for word in ("step", "loss", "acc", "top5", "f1", "auroc", "gnorm_max", "== summary", "torchmetrics", "overhead"):
        assert word in text, word
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [5, 10, 15, 20]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2
    # uneven shards: the global sample count is the sum of the per-rank batches
    b0, b1 = (s["batch"] for s in summary["shards"])
    assert b0 != b1
    assert rows[-1]["samples"] == 20 * (b0 + b1)
    # our final global values equal torchmetrics' on the same batches
    checks = {c["metric"]: c for c in summary["check"]}
    assert set(checks) >= {"loss", "acc", "top5", "f1", "auroc", "gnorm_max"}
    assert summary["all_match"], checks
    for c in checks.values():
        assert c["abs_diff"] <= c["tol"], c
    # the overhead table was measured for the three variants
    for v in ("none", "torchmetrics", "d9d"):
        st = summary["step_time"][v]
        assert st["steps"] > 0 and st["p20_ms"] <= st["median_ms"] <= st["p80_ms"]


def test_demo_rejects_bad_flags(tmp_path):
    """The CLI stops at argument parsing: usage error (exit 2) naming the flag, no traceback, nothing written."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "examples/demo.py", "--world-size", "0", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "usage: python examples/demo.py" in proc.stderr
    assert "--world-size" in proc.stderr.splitlines()[-1] and ">= 1" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


@pytest.mark.parametrize("argv,flag", [
    (["--world-size", "0"], "--world-size"),
    (["--steps", "0"], "--steps"),
    (["--log-every", "-3"], "--log-every"),
    (["--steps", "ten"], "--steps"),
    (["--timeout", "soon"], "--timeout"),
    (["--no-such-flag"], "--no-such-flag"),
])
def test_demo_flag_errors_name_the_flag(argv, flag, capsys):
    demo = _demo_module()

    with pytest.raises(SystemExit) as e:
        demo._parse(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage:") and flag in err.splitlines()[-1], err


def test_demo_good_flags_parse():
    demo = _demo_module()

    a = demo._parse(["--quick", "--world-size", "3"])
    assert (a.world_size, a.steps, a.log_every, a.quick) == (3, 40, 10, True)
    a = demo._parse([])
    assert (a.world_size, a.steps, a.log_every, a.quick) == (2, 300, 25, False)
