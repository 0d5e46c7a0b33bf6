"""examples/d9d_moe_task.py: the router statistics logged through the d9d task equal
numpy's, from the indices d9d's routers chose in the logging window."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.example_loader import load_example

pytest.importorskip("d9d.module.block.moe")

ROOT = Path(__file__).resolve().parents[1]


def _example():
    return load_example("d9d_moe_task.py", "d9d_moe_task_example")


def _summary(load: np.ndarray) -> dict:
    E = load.shape[1]
    a = load[load.sum(1) > 0]
    mean = a.mean(1)
    p = a / a.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.where(p > 0, p * np.log(p), 0.0).sum(1) / math.log(E)
    return dict(max_violation=(a.max(1) / mean - 1).max(), dead_experts=float((a == 0).sum()),
                cv=(a.std(1) / mean).mean(), entropy=ent.mean())


def test_router_statistics_match_numpy():
    ex = _example()
    r = ex.run(steps=4, microbatches=2, log_every=2, layers=3, experts=6, top_k=2)
    assert [s for s, _ in r.logged] == [2, 4]
    for (_, values), routing in zip(r.logged, r.routing):
        load = np.stack([sum(np.bincount(i.reshape(-1).numpy(), minlength=6) for i in per_layer)
                         for per_layer in routing]).astype(float)
        got = values["train"]["router"]
        for k, v in _summary(load).items():
            assert got[k].item() == pytest.approx(v, rel=1e-12), k
        assert math.isfinite(values["train"]["loss"].item())


def test_cli():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "examples/d9d_moe_task.py", "--steps", "2", "--log-every", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["step", "loss", "max_violation", "dead_experts", "cv", "entropy"]
    assert [int(line.split()[0]) for line in lines[1:]] == [1, 2]
