"""CONTRIBUTING.md's recipes are followed as written: every python block
runs (they assert against scikit-learn), and each example metric works in a
MetricGroup, through forward, a 2-rank gloo sync and a state_dict round
trip, equal to scikit-learn over all the data."""

from __future__ import annotations

import math
import pathlib
import re

import numpy as np
import pytest
import torch
from sklearn.metrics import balanced_accuracy_score, log_loss

import d9d_kernels as dk
from tests.dist_utils import run_distributed

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _recipes() -> dict:
    """The namespace the CONTRIBUTING.md blocks build (their asserts run)."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    ns: dict = {}
    for code in blocks:
        exec(compile(code, "CONTRIBUTING.md", "exec"), ns)
    return ns


def _data(seed: int, n: int):
    g = torch.Generator().manual_seed(seed)
    probs = torch.rand(n, generator=g, dtype=torch.float64) * 0.98 + 0.01
    labels = torch.randint(0, 2, (n,), generator=g)
    classes = torch.randint(0, 3, (n,), generator=g)
    guesses = torch.where(torch.rand(n, generator=g) < 0.6, classes, torch.randint(0, 3, (n,), generator=g))
    values = torch.randn(n, generator=g, dtype=torch.float64) * 3
    return probs, labels, guesses, classes, values


def _group(ns):
    return dk.MetricGroup({"logloss": ns["BinaryLogLoss"](), "bacc": ns["BalancedAccuracy"](num_classes=3),
                           "rms": ns["RootMeanSquare"](), "acc": dk.Accuracy(task="multiclass", num_classes=3)})


def _feed(g, batch, forward=False):
    probs, labels, guesses, classes, values = batch
    call = (lambda m, *a: m(*a)) if forward else (lambda m, *a: m.update(*a))
    out = {"logloss": call(g["logloss"], probs, labels), "bacc": call(g["bacc"], guesses, classes),
           "rms": call(g["rms"], values), "acc": call(g["acc"], guesses, classes)}
    return out


def _reference(batches) -> dict:
    probs, labels, guesses, classes, values = (torch.cat(x) for x in zip(*batches))
    return {"logloss": log_loss(labels.numpy(), probs.numpy(), labels=[0, 1]),
            "bacc": balanced_accuracy_score(classes.numpy(), guesses.numpy()),
            "rms": math.sqrt((values.numpy() ** 2).mean()),
            "acc": (guesses == classes).double().mean().item()}


def _close(got: dict, want: dict, what: str) -> None:
    for k, w in want.items():
        assert float(got[k]) == pytest.approx(w, rel=1e-12), (what, k, float(got[k]), w)


def test_recipes_run_and_work_in_a_group_forward_and_a_round_trip():
    ns = _recipes()
    g = _group(ns)
    batches = [_data(s, n) for s, n in ((0, 17), (1, 40), (2, 9))]
    for b in batches[:2]:
        _feed(g, b)
    batch_values = _feed(g, batches[2], forward=True)
    _close(batch_values, _reference(batches[2:]), "forward's batch value")
    _close(g.compute(), _reference(batches), "accumulated")
    restored = _group(ns)
    restored.load_state_dict(g.state_dict())
    _close(restored.compute(), _reference(batches), "state_dict round trip")
    assert restored.explain()["acc"] == "not updated yet"
    assert g.explain()["rms"].startswith("checked") and g.explain()["acc"].startswith("recorded")
    empty = ns["BinaryLogLoss"]()
    assert torch.isnan(empty.compute())


def _sync_worker(rank, world):
    ns = _recipes()
    g = _group(ns)
    batches = [_data(10 * rank + s, 11 + 5 * rank + s) for s in range(3)]
    for b in batches:
        _feed(g, b)
    got = {k: float(v) for k, v in g.sync_and_compute(None).items()}
    return got, [[t.tolist() for t in b] for b in batches]


def test_recipes_sync_over_two_ranks():
    out = run_distributed(_sync_worker, 2, timeout=180)
    batches = [tuple(torch.tensor(t, dtype=torch.float64 if isinstance(t[0], float) else torch.int64) for t in b)
               for _, bs in out for b in bs]
    want = _reference(batches)
    for rank, (got, _) in enumerate(out):
        _close(got, want, f"rank {rank} after the sync")
