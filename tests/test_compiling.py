"""A process that never compiles never imports torch._dynamo (d9d_kernels/_compiling.py),
and what skips Dynamo still does once it is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

FIRST_UPDATE = r"""
import sys, torch
import d9d_kernels as dk
x, w = torch.randn(100), torch.rand(100)
labels = torch.randint(0, 10, (100,))
m = dk.WeightedMeanMetric()
g = dk.MetricGroup({"acc": dk.Accuracy(task="multiclass", num_classes=10)})
assert "torch._dynamo" not in sys.modules, "imported before the update"
m.update(x, w)
g.update(labels, labels)
m.update(x, w)  # the planned replay
g.update(labels, labels)
assert abs(m.compute().item() - ((x * w).sum() / w.sum()).item()) < 1e-5
assert g.compute()["acc"].item() == 1.0
print(sorted(k for k in sys.modules if k == "torch._dynamo" or k.startswith("torch._dynamo.")))
"""


def test_first_update_of_a_process_does_not_import_dynamo():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", FIRST_UPDATE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]", r.stdout


def test_skip_dynamo_runs_outside_a_compiled_graph():
    from d9d_kernels._compiling import skip_dynamo

    seen = []

    def f(x):
        seen.append(torch.compiler.is_compiling())
        return x + 1

    x = torch.ones(3)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(lambda t: f(t) * 2, backend="eager")(x), (x + 1) * 2)
    assert seen == [True]  # traced when called as it is: the check below can tell
    seen.clear()
    g = skip_dynamo(f)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(lambda t: g(t) * 2, backend="eager")(x), (x + 1) * 2)
    assert seen == [False]
    seen.clear()
    torch.testing.assert_close(g(x), x + 1)  # eager: called as it is
    assert seen == [False]


@pytest.mark.parametrize("wrapped", [True, False], ids=["DispatchMode", "TorchDispatchMode"])
def test_dispatch_mode_keeps_torch_dispatch_out_of_dynamo(wrapped):
    """The subclass's ``__torch_dispatch__`` is wrapped by ``skip_dynamo``, not by
    torch (whose wrapper imports torch._dynamo on the first op)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from d9d_kernels._compiling import DispatchMode

    class Ops(DispatchMode if wrapped else TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    raw = Ops.__dict__["__torch_dispatch__"]
    wrapper_module = raw.__code__.co_filename
    assert wrapper_module.endswith(os.path.join("d9d_kernels", "_compiling.py") if wrapped
                                   else os.path.join("torch", "_compile.py")), wrapper_module
    mode = Ops()
    mode.ops = []
    with mode:
        y = torch.ones(2) + 1
    torch.testing.assert_close(y, torch.full((2,), 2.0))
    assert torch.ops.aten.add.Tensor in mode.ops
