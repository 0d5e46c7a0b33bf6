"""The README's migration example: the torchmetrics loop and its d9d_kernels
version differ only in the import and the class names, and give the same values."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SECTION = "### Migrating from torchmetrics is a rename"


def _blocks() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 2, "the migration section holds the torchmetrics block, then the d9d_kernels block"
    return blocks[0], blocks[1]


def test_migration_example_is_a_rename():
    before, after = _blocks()
    changed = [d for d in difflib.ndiff(before.splitlines(), after.splitlines()) if d[:2] in ("- ", "+ ")]
    assert changed, "the two blocks are identical"
    # normalise what a migration may change; every changed line must then be equal
    rename = [("import torchmetrics as tm", "import d9d_kernels as dk"), ("tm.MetricCollection", "dk.MetricGroup"),
              ("tm.", "dk.")]

    def norm(line: str) -> str:
        for a, b in rename:
            line = line.replace(a, b)
        return line

    assert [norm(x) for x in before.splitlines()] == after.splitlines(), changed


def _run(src: str) -> dict:
    ns: dict = {}
    exec(compile(src, "README.md", "exec"), ns)
    return ns


def test_migration_example_gives_torchmetrics_values():
    before, after = _blocks()
    tm_ns, dk_ns = _run(before), _run(after)
    assert len(tm_ns["history"]) == len(dk_ns["history"]) == 3
    for theirs, ours in zip(tm_ns["history"], dk_ns["history"]):
        assert set(ours) == set(theirs) == {"train/acc", "train/f1", "train/iou"}
        for k in theirs:
            np.testing.assert_allclose(ours[k].double().numpy(), theirs[k].double().numpy(), rtol=1e-5, err_msg=k)
    for k, v in tm_ns["final"].items():
        np.testing.assert_allclose(dk_ns["final"][k].double().numpy(), v.double().numpy(), rtol=1e-5, err_msg=k)
