"""Every dk Metric / MetricGroup is a d9d.metric.Metric once both are imported,
in either import order, and d9d's ComposeMetric refuses a group's members as
separate children at construction; without d9d, ``import d9d_kernels`` never imports it.
Each case runs in a fresh interpreter (import order matters)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("d9d.metric")  # "d9d" alone could be this test folder (a namespace package)

_CHECK = r"""
import d9d.metric
from d9d.metric.impl.container import ComposeMetric
g = dk.MetricGroup({"loss": dk.WeightedMeanMetric(), "acc": dk.Accuracy(task="multiclass", num_classes=3)})
for m in (g, g["loss"], dk.SumMetric(), dk.AUROC(task="binary", num_bins=16), dk.Metric):
    assert isinstance(m, d9d.metric.Metric) if not isinstance(m, type) else issubclass(m, d9d.metric.Metric), m
c = ComposeMetric({"g": g})
g["loss"].update(values=torch.tensor([1.0, 3.0]), weights=torch.tensor([1.0, 1.0]))
assert c.compute()["g"]["loss"].item() == 2.0
assert not isinstance(object(), d9d.metric.Metric)
try:  # members of one group as separate children: refused at construction, not at bind()
    ComposeMetric({"loss": g["loss"], "acc": g["acc"]})
except ValueError as e:
    assert "child 'loss' is MetricGroup['loss'] (WeightedMeanMetric), a member" in str(e), e
else:
    raise AssertionError("ComposeMetric took the members of a group as children")
print("ok")
"""

CASES = {
    # dk first, its metric classes first
    "dk_then_d9d": "import torch, d9d_kernels as dk\ndk.MetricGroup\n" + _CHECK,
    # dk imported, its metric classes only after d9d.metric
    "dk_lazy_then_d9d": "import torch, d9d_kernels as dk\nimport d9d.metric\n" + _CHECK,
    # d9d first
    "d9d_then_dk": "import d9d.metric, torch\nimport d9d_kernels as dk\n" + _CHECK,
    # d9d's submodule imported first (d9d.metric comes in through it)
    "d9d_impl_then_dk": "from d9d.metric.impl.aggregation import SumMetric\nimport torch, d9d_kernels as dk\n" + _CHECK,
}

ABSENT = r"""
import sys
sys.modules["d9d"] = None  # d9d unimportable: any import of it raises
import torch
import d9d_kernels as dk
g = dk.MetricGroup({"s": dk.SumMetric(), "acc": dk.Accuracy(task="multiclass", num_classes=3)})
g["s"].update(torch.tensor([1.0, 2.0]))
g.sync(dk.DistributedContext.local())
g.sync(None)
assert g.compute()["s"].item() == 3.0
from d9d_kernels.distributed import as_context
class Fake:  # a d9d look-alike, without d9d
    class _P:
        is_distributed = False
    mesh_params = _P()
    def mesh_for(self, domain):
        raise AssertionError("not distributed: no mesh needed")
assert as_context(Fake()).is_local
assert sys.modules["d9d"] is None
assert not [m for m in sys.modules if m.startswith("d9d.")], [m for m in sys.modules if m.startswith("d9d.")]
print("ok")
"""


def _run(code: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd="/")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@pytest.mark.parametrize("case", sorted(CASES))
def test_dk_metrics_are_d9d_metrics(case):
    _run(CASES[case])


def test_import_without_d9d_never_imports_it():
    _run(ABSENT)


def test_import_d9d_kernels_imports_neither_d9d_nor_torch():
    _run(
        "import sys\nimport d9d_kernels\n"
        "assert 'torch' not in sys.modules and 'd9d' not in sys.modules, sorted(sys.modules)\nprint('ok')"
    )
