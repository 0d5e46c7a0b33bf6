"""The README's code: the migration example (the torchmetrics loop and its
d9d_kernels version differ only in the import and the class names, and give
the same values) and the "Inside d9d" block (plain torch's values)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

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


D9D_SECTION = "## Inside d9d"


def _d9d_local_context():
    """A non-distributed d9d DistributedContext: its constructor calls torch.cuda.set_device, so set its fields."""
    import logging

    from d9d.core.dist_context import DeviceMeshParameters, DistributedContext

    ctx = object.__new__(DistributedContext)
    ctx._params, ctx._meshes, ctx._num_nodes = DeviceMeshParameters(), {}, 1
    ctx._logger = logging.getLogger("test_readme")
    ctx._local_rank = ctx._global_rank = ctx._node_rank = 0
    ctx._master_addr, ctx._current_device = "127.0.0.1", torch.device("cpu")
    return ctx


def test_d9d_section_is_short_and_runs_against_torch():
    """The "Inside d9d" block, run as written with small inputs and a non-distributed d9d context,
    gives plain torch's loss mean, token count, accuracy and perplexity, and d9d's own metrics' loss/count."""
    pytest.importorskip("d9d")
    from d9d.metric import Metric
    from d9d.metric.impl.aggregation import SumMetric, WeightedMeanMetric

    text = (ROOT / "README.md").read_text()
    section = text.split(D9D_SECTION, 1)[1].split("\n## ", 1)[0]
    assert len((D9D_SECTION + section).rstrip("\n").splitlines()) <= 15
    (block,) = re.findall(r"```python\n(.*?)```", section, re.S)
    assert 'ComposeMetric({"train": g})' in block

    g = torch.Generator().manual_seed(3)
    V = 11
    logits = torch.randn(3, 6, V, generator=g)
    labels = torch.randint(0, V, (3, 6), generator=g)
    labels[0, 4:] = labels[2, 1:] = -100
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    ns = {"V": V, "logits": logits, "labels": labels, "loss": loss, "dist_context": _d9d_local_context()}
    exec(compile(block, "README.md", "exec"), ns)
    assert isinstance(ns["g"], Metric) and isinstance(ns["metrics"], Metric)
    values = ns["values"]
    keep = labels != -100
    want = {
        "loss": loss.double(),
        "tokens": keep.sum().double(),
        "acc": (logits.argmax(-1)[keep] == labels[keep]).double().mean(),
        "ppl": F.cross_entropy(logits[keep].double(), labels[keep]).exp(),
    }
    assert set(values) == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(values[k].double().numpy(), v.numpy(), rtol=1e-6, err_msg=k)
    mean, total = WeightedMeanMetric(), SumMetric()  # d9d's own built-ins on the same microbatch
    mean.update(loss, keep.sum())
    total.update(keep.sum())
    np.testing.assert_allclose(values["loss"].item(), mean.compute().item(), rtol=1e-6)
    assert values["tokens"].item() == total.compute().item() == 11
    # reset() after compute(): the logged values are copies, the state starts again from zero
    assert ns["metrics"].compute()["train"]["tokens"].item() == 0
