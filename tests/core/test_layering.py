"""The core never imports the catalogue: d9d_kernels.core.* loads, and a group
of custom metrics runs its whole lifecycle, without d9d_kernels.metrics."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CODE = r"""
import sys, torch
import d9d_kernels.core.group as group
from d9d_kernels.core import metric, plan, statistic, storage, sync  # noqa: F401

class Total(metric.Metric):
    def __init__(self):
        super().__init__()
        self.add_state("total", kind="sum", shape=())
    def _update(self, values):
        self.total += values.double().sum()
    def _compute(self, state):
        return state["total"]

g = group.MetricGroup({"a": Total(), "b": Total()})
g.update(values=torch.tensor([1.0, 2.0]))
g.trigger_sync(); g.wait_sync()
assert g.compute() == {"a": 3.0, "b": 3.0}, g.compute()
assert g.compute_to_host().result() == {"a": 3.0, "b": 3.0}
loaded = sorted(m for m in sys.modules if m.startswith("d9d_kernels.metrics"))
assert not loaded, loaded
print("ok")
"""


def test_core_runs_without_the_catalogue():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]


def test_catalogue_uses_only_the_public_op_layer():
    """metrics/* reach kernels through d9d_kernels.ops' public names, never
    its private modules or torch.ops.d9d_kernels directly."""
    bad = []
    for path in sorted((ROOT / "d9d_kernels" / "metrics").rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "torch.ops.d9d_kernels" in line or "d9d_kernels.ops._" in line or "_extension" in line:
                bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)
