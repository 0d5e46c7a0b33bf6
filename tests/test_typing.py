"""Types: the package ships ``py.typed`` and mypy (pinned in requirements-dev.txt)
accepts examples/ and a d9d task returning a ``dk.MetricGroup`` from ``create_metrics``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")
pytest.importorskip("d9d.metric")

ROOT = Path(__file__).resolve().parents[1]

TASK = '''
import d9d_kernels as dk
from d9d.loop.control import CreateMetricsContext, CreateMetricsResult, TrainTask


class Task(TrainTask):
    def create_metrics(self, ctx: CreateMetricsContext) -> CreateMetricsResult:
        g = dk.MetricGroup({"loss": dk.WeightedMeanMetric(), "acc": dk.Accuracy(task="multiclass", num_classes=5)})
        return CreateMetricsResult(metrics={"train": g, "tokens": dk.SumMetric()})
'''

#: the same task with a value that is not a metric: the check must reject it
BAD_TASK = TASK.replace('"tokens": dk.SumMetric()', '"tokens": 3')


def _mypy(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(cache), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_py_typed_is_shipped():
    assert (ROOT / "d9d_kernels" / "py.typed").is_file()
    assert 'package_data={"d9d_kernels": ["py.typed"]}' in (ROOT / "setup.py").read_text()


def test_mypy_accepts_examples_and_a_group_in_create_metrics(tmp_path):
    task = tmp_path / "task.py"
    task.write_text(TASK)
    proc = _mypy("examples", str(task), cache=tmp_path / "cache")  # the config: pyproject.toml [tool.mypy]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Success: no issues found" in proc.stdout, proc.stdout


def test_mypy_rejects_a_value_that_is_not_a_metric(tmp_path):
    """dk.MetricGroup is checked as a d9d Metric, not as Any: a wrong value fails."""
    task = tmp_path / "task.py"
    task.write_text(BAD_TASK)
    proc = _mypy(str(task), cache=tmp_path / "cache")
    assert proc.returncode == 1 and 'expected "str": "Metric[Any]"' in proc.stdout, proc.stdout
