"""One rank of a large world in this process: torch's fake process group.

``fake_world(W)`` initialises the default process group with the "fake"
backend (``torch.testing._internal.distributed.fake_pg``: no communication;
every collective hands this rank its own data back, as if the other ranks
contributed zeros to a sum and nothing larger to a max) for a rank in the
middle of a world of ``W``, over a ``CountingStore`` that records every store
operation. The real library code runs unchanged, so whatever it does per
rank that grows with ``W`` (store keys, loops over ranks, buffers) shows up
in time, memory or the store count. Shared by tests/scale and
bench/bench_scale.py.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist

import d9d_kernels as dk

__all__ = ["CountingStore", "fake_world", "catalogue_group", "feed", "host_calls"]


class CountingStore(dist.Store):
    """A c10d store that counts the operations passed to the store it wraps."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.ops: list[str] = []

    def _op(self, name, fn, *args):
        self.ops.append(name)
        return fn(*args)

    def set(self, key, value):
        return self._op("set", self.inner.set, key, value)

    def get(self, key):
        return self._op("get", self.inner.get, key)

    def add(self, key, n):
        return self._op("add", self.inner.add, key, n)

    def wait(self, keys, *timeout):
        return self._op("wait", self.inner.wait, keys, *timeout)

    def check(self, keys):
        return self._op("check", self.inner.check, keys)

    def delete_key(self, key):
        return self._op("delete_key", self.inner.delete_key, key)

    def compare_set(self, key, expected, desired):
        return self._op("compare_set", self.inner.compare_set, key, expected, desired)

    def num_keys(self):
        return self._op("num_keys", self.inner.num_keys)

    def multi_get(self, keys):
        return self._op("multi_get", self.inner.multi_get, keys)

    def multi_set(self, keys, values):
        return self._op("multi_set", self.inner.multi_set, keys, values)

    def append(self, key, value):
        return self._op("append", self.inner.append, key, value)


@contextlib.contextmanager
def fake_world(world_size: int, rank: int | None = None):
    """Default process group = a fake rank (default: ``world_size // 2 + 3``)
    of ``world_size``; yields the CountingStore; destroyed on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_world: a default process group is already initialised")
    store = CountingStore(FakeStore())
    dist.init_process_group("fake", store=store, rank=world_size // 2 + 3 if rank is None else rank,
                            world_size=world_size)
    try:
        yield store
    finally:
        dist.destroy_process_group()


def catalogue_group() -> dk.MetricGroup:
    """A MetricGroup with one member of every catalogue class and aggregation metric."""
    C = 5
    mc = dict(task="multiclass", num_classes=C)
    return dk.MetricGroup({
        "sum": dk.SumMetric(), "mean": dk.WeightedMeanMetric(), "max": dk.MaxMetric(), "min": dk.MinMetric(),
        "acc": dk.Accuracy(**mc), "top2": dk.Accuracy(**mc, top_k=2), "prec": dk.Precision(**mc, average="macro"),
        "rec": dk.Recall(**mc, average="macro"), "f1": dk.F1Score(**mc, average="macro"),
        "f2": dk.FBetaScore(beta=2.0, **mc), "spec": dk.Specificity(**mc), "iou": dk.JaccardIndex(**mc),
        "mcc": dk.MatthewsCorrCoef(**mc), "kappa": dk.CohenKappa(**mc), "cm": dk.ConfusionMatrix(**mc),
        "auroc": dk.AUROC(task="binary", num_bins=64), "ap": dk.AveragePrecision(task="binary", num_bins=64),
        "mse": dk.MeanSquaredError(), "mae": dk.MeanAbsoluteError(), "r2": dk.R2Score(),
        "pearson": dk.PearsonCorrCoef(), "ev": dk.ExplainedVariance(), "ppl": dk.Perplexity(),
    })


def feed(g: dk.MetricGroup, seed: int = 0) -> None:
    """One batch into every member (positive maxima and negative minima: on the
    fake group a max over ranks is this rank's value vs nothing larger)."""
    gen = torch.Generator().manual_seed(seed)
    n, C = 16, 5
    x = torch.rand(n, generator=gen, dtype=torch.float64) + 1.0
    g["sum"].update(x)
    g["mean"].update(values=x, weights=torch.rand(n, generator=gen, dtype=torch.float64))
    g["max"].update(x)
    g["min"].update(-x)
    logits = torch.randn(n, C, generator=gen)
    labels = torch.randint(0, C, (n,), generator=gen)
    for k in ("acc", "top2", "prec", "rec", "f1", "f2", "spec", "iou", "mcc", "kappa", "cm", "ppl"):
        g[k].update(logits, labels)  # a shared statistic takes the batch once per member fed
    probs = torch.rand(n, generator=gen)
    g["auroc"].update(probs, labels % 2)
    g["ap"].update(probs, labels % 2)
    y = torch.randn(n, generator=gen, dtype=torch.float64) + 1e3
    for k in ("mse", "mae", "r2", "pearson", "ev"):
        g[k].update(y + torch.randn(n, generator=gen, dtype=torch.float64), y)


def host_calls(fn) -> int:
    """Python and C function calls made by ``fn()``: a count of host work that,
    unlike a time, does not move with the machine's load."""
    n = 0

    def tally(frame, event, arg):
        nonlocal n
        n += event in ("call", "c_call")

    sys.setprofile(tally)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n
