"""After warm-up an update allocates nothing: stable buffers, no per-call scratch.

A step that allocates on every metric update costs allocator time on the
host and, on a GPU, breaks CUDA-graph capture (stable addresses). The
profiler (``profile_memory=True``) attributes every CPU tensor allocation
to the op that made it (its self memory); the inputs are built once outside the
measured loop, so any allocation seen is the library's.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import d9d_kernels as dk

N, C, L = 256, 10, 6
WARMUP, CALLS = 3, 50


def _allocations(step) -> list[int]:
    for _ in range(WARMUP):
        step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(CALLS):
            step()
    # an allocation inside an op is that op's self memory; one outside any op is a "[memory]" event
    return [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]


def _inputs():
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(N, generator=g),
        "y": torch.randn(N, generator=g),
        "w": torch.rand(N, generator=g),
        "v0": torch.tensor(2.5),
        "w0": torch.tensor(3.0),
        "logits": torch.randn(N, C, generator=g),
        "labels": torch.randint(0, C, (N,), generator=g),
        "probs": torch.rand(N, generator=g),
        "bits": torch.randint(0, 2, (N,), generator=g),
        "ml_probs": torch.rand(N, L, generator=g),
        "ml_bits": torch.randint(0, 2, (N, L), generator=g),
        "seq_logits": torch.randn(4, N // 4, C, generator=g),
        "seq_labels": torch.randint(0, C, (4, N // 4), generator=g),
    }


I = _inputs()

CASES = {
    "weighted_mean_0d_tensors": (dk.WeightedMeanMetric, {}, lambda m: m.update(values=I["v0"], weights=I["w0"])),
    "weighted_mean_numbers": (dk.WeightedMeanMetric, {}, lambda m: m.update(2.5, weights=3)),
    "sum_number": (dk.SumMetric, {}, lambda m: m.update(2.0)),
    "max_0d": (dk.MaxMetric, {}, lambda m: m.update(I["v0"])),
    "min_tensor": (dk.MinMetric, {}, lambda m: m.update(I["x"])),
    "mse": (dk.MeanSquaredError, {}, lambda m: m.update(I["x"], I["y"])),
    "r2_weighted": (dk.R2Score, {}, lambda m: m.update(I["x"], I["y"], weights=I["w"])),
    "pearson": (dk.PearsonCorrCoef, {}, lambda m: m.update(I["x"], I["y"])),
    "binary_f1": (dk.F1Score, {"task": "binary"}, lambda m: m.update(I["probs"], I["bits"])),
    "multilabel_f1": (dk.F1Score, {"task": "multilabel", "num_labels": L}, lambda m: m.update(I["ml_probs"], I["ml_bits"])),
    "binary_auroc": (dk.AUROC, {"task": "binary", "num_bins": 1000}, lambda m: m.update(I["probs"], I["bits"])),
    "multiclass_auroc": (dk.AUROC, {"task": "multiclass", "num_classes": C, "num_bins": 1000},
                         lambda m: m.update(I["logits"], I["labels"])),
    "accuracy_indices": (dk.Accuracy, {"task": "multiclass", "num_classes": C}, lambda m: m.update(I["labels"], I["labels"])),
    "accuracy_sequences": (dk.Accuracy, {"task": "multiclass", "num_classes": C},
                           lambda m: m.update(I["seq_logits"], I["seq_labels"])),
    "cohen_kappa": (dk.CohenKappa, {"task": "multiclass", "num_classes": C}, lambda m: m.update(I["logits"], I["labels"])),
    "perplexity_vocab_known": (dk.Perplexity, {"num_classes": C}, lambda m: m.update(I["logits"], I["labels"])),
    "perplexity": (dk.Perplexity, {}, lambda m: m.update(I["logits"], I["labels"])),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_update_allocates_nothing_after_warmup(name):
    cls, kwargs, call = CASES[name]
    m = cls(**kwargs)
    allocs = _allocations(lambda: call(m))
    assert allocs == [], f"{name}: {len(allocs)} allocations in {CALLS} updates (bytes: {allocs[:8]})"


def test_group_update_allocates_nothing_after_warmup():
    g = dk.MetricGroup({
        "loss": dk.WeightedMeanMetric(),
        "acc": dk.Accuracy(task="multiclass", num_classes=C),
        "top5": dk.Accuracy(task="multiclass", num_classes=C, top_k=5),
        "f1": dk.F1Score(task="multiclass", num_classes=C, average="macro"),
        "cm": dk.ConfusionMatrix(task="multiclass", num_classes=C),
        "gnorm": dk.MaxMetric(),
    })

    def step():
        g["loss"].update(values=I["v0"], weights=I["w0"])
        g.update(preds=I["logits"], target=I["labels"])
        g["gnorm"].update(I["v0"])

    allocs = _allocations(step)
    assert allocs == [], f"{len(allocs)} allocations in {CALLS} group steps (bytes: {allocs[:8]})"


def test_counter_sees_an_allocating_update():
    """The probe itself can fail: an update that allocates is caught."""

    class Allocating(dk.Metric):
        def __init__(self):
            super().__init__()
            self.add_state("total", kind="sum", shape=())

        def _update(self, values):
            self.total += (values * 2.0).sum()  # a temporary per call

        def _compute(self, state):
            return state["total"]

    m = Allocating()
    assert len(_allocations(lambda: m.update(I["x"]))) >= CALLS


def test_nonfinite_rows_are_counted_in_the_kernel():
    """Non-finite score rows (nan_strategy="ignore") are counted by the
    kernel's own pass: no temporary of the logits' size, and no second read
    (no allocation beyond a few bytes) per update."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(32, 20000, generator=g).to(torch.bfloat16)
    x[3, 5], x[4] = float("nan"), float("-inf")
    t = torch.randint(0, 20000, (32,), generator=g)
    m = dk.Perplexity(nan_strategy="ignore")
    allocs = _allocations(lambda: m.update(x, t))
    assert max(allocs, default=0) < 1024, max(allocs)
    m.reset()
    m.update(x, t)
    assert m.bad_input_counts() == {"target_out_of_range": 0, "nonfinite_preds": 2}
    want = dk.Perplexity(nan_strategy="ignore")
    want.update(x[[i for i in range(32) if i not in (3, 4)]], t[[i for i in range(32) if i not in (3, 4)]])
    torch.testing.assert_close(m.compute(), want.compute())
