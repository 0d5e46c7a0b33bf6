"""The catalogue inside MetricGroups: shared statistics (ONE kernel call per
g.update), O(C) state, results equal to standalone metrics, torch.compile."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import d9d_kernels as dk
from d9d_kernels import reference
from tests.metrics._catalogue_utils import _one_thread  # noqa: F401


def _spy(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(*a, **k):
        calls.append(k)
        return real(*a, **k)

    monkeypatch.setattr(module, name, spy)
    return calls


def _classification_members(C):
    return {
        "acc": dk.Accuracy(task="multiclass", num_classes=C),
        "top5": dk.Accuracy(task="multiclass", num_classes=C, top_k=5),
        "f1": dk.F1Score(task="multiclass", num_classes=C, average="macro"),
        "prec": dk.Precision(task="multiclass", num_classes=C),
        "rec": dk.Recall(task="multiclass", num_classes=C, average="weighted"),
        "cm": dk.ConfusionMatrix(task="multiclass", num_classes=C),
    }


class _CountOps(TorchDispatchMode):
    """Counts dispatcher calls of one op (below every Python wrapper and update plan)."""

    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is self.op
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_one_class_stats_kernel_call_per_group_update(monkeypatch, backend):
    if backend == "torch":
        monkeypatch.setenv("D9D_KERNELS_BACKEND", "torch")
    wrapper_calls = _spy(monkeypatch, dk.ops, "class_stats")
    kernel_calls = _spy(monkeypatch, reference, "class_stats")
    C = 10
    g = dk.MetricGroup(_classification_members(C))
    solo = _classification_members(C)
    for step in range(4):  # step 0 runs the checked path, later steps the update plan
        logits = torch.randn(32, C)
        target = torch.randint(0, C, (32,))
        mask = torch.rand(32) > 0.1
        k0 = len(kernel_calls)
        with _CountOps(torch.ops.d9d_kernels.class_stats.default) as ops:
            g.update(preds=logits, target=target, mask=mask)
        if step == 0:
            assert len(wrapper_calls) == 1, "exactly one class_stats call per g.update"
            assert tuple(wrapper_calls[-1]["top_ks"]) == (1, 5) and wrapper_calls[-1]["confmat"] is not None
        if backend == "torch":
            assert len(kernel_calls) == k0 + 1
        else:
            assert ops.calls == 1, "exactly one class_stats kernel per g.update"
        for m in solo.values():
            m.update(logits, target, mask=mask)
    out = g.compute()
    for name, m in solo.items():
        assert torch.equal(out[name], m.compute()), name  # same statistics -> bit-identical results
    assert len(g._storage.layout.stats) == 1


def test_multiclass_state_is_o_of_c_unless_confusion_matrix():
    C = 1000
    small = dk.MetricGroup({k: v for k, v in _classification_members(C).items() if k != "cm"})
    n_small = sum(b.numel() for b in small._storage.local.values())
    assert n_small <= 2 * 3 * C + 16  # two top-k's x (tp, pred, target) x C + extras
    big = dk.MetricGroup(_classification_members(C))
    n_big = sum(b.numel() for b in big._storage.local.values())
    assert n_big == n_small + C * C


def test_binary_histogram_and_moments_statistics_are_shared(monkeypatch):
    b_calls = _spy(monkeypatch, dk.ops, "binary_stats")
    h_calls = _spy(monkeypatch, dk.ops, "score_histogram")
    m_calls = _spy(monkeypatch, dk.ops, "weighted_moments")
    g = dk.MetricGroup({
        "acc": dk.Accuracy(task="binary"),
        "f1": dk.F1Score(task="binary"),
        "mcc": dk.MatthewsCorrCoef(task="binary"),
        "cm": dk.ConfusionMatrix(task="binary"),
        "auroc": dk.AUROC(task="binary"),
        "ap": dk.AveragePrecision(task="binary"),
    })
    g.update(preds=torch.rand(50), target=torch.randint(0, 2, (50,)))
    assert len(b_calls) == 1 and len(h_calls) == 1
    r = dk.MetricGroup({n: getattr(dk, n)() for n in
                        ["MeanSquaredError", "MeanAbsoluteError", "R2Score", "PearsonCorrCoef", "ExplainedVariance"]})
    r.update(preds=torch.randn(20), target=torch.randn(20), weights=torch.rand(20))
    assert len(m_calls) == 1
    # a different threshold is a different statistic
    g2 = dk.MetricGroup({"a": dk.Accuracy(task="binary"), "b": dk.Accuracy(task="binary", threshold=0.3)})
    g2.update(preds=torch.rand(5), target=torch.randint(0, 2, (5,)))
    assert len(b_calls) == 3


def test_group_reset_and_state_dict_roundtrip():
    g = dk.MetricGroup(_classification_members(6))
    g.update(preds=torch.randn(20, 6), target=torch.randint(0, 6, (20,)))
    before = {k: v.clone() for k, v in g.compute().items()}
    sd = g.state_dict()
    g.reset()
    assert g.compute()["cm"].sum() == 0
    g.load_state_dict(sd)
    for k, v in g.compute().items():
        assert torch.equal(v, before[k]), k


def _all_metric_updates(seed=0):
    C, L = 5, 3
    torch.manual_seed(seed)
    p, t = torch.randn(8, C), torch.randint(0, C, (8,))
    mask = torch.rand(8) > 0.2
    pb, tb = torch.randn(8), torch.randint(0, 2, (8,))
    pl, tl = torch.rand(8, L), torch.randint(0, 2, (8, L))
    x, y, w = torch.randn(8), torch.randn(8), torch.rand(8)
    cases = []
    for name in ["Accuracy", "Precision", "Recall", "F1Score", "Specificity", "JaccardIndex", "MatthewsCorrCoef",
                 "CohenKappa", "ConfusionMatrix"]:
        cls = getattr(dk, name)
        cases.append((cls(task="multiclass", num_classes=C), (p, t, mask)))
        cases.append((cls(task="binary"), (pb, tb, None)))
        if name != "CohenKappa":
            cases.append((cls(task="multilabel", num_labels=L), (pl, tl, None)))
    cases.append((dk.FBetaScore(task="multiclass", beta=2.0, num_classes=C, top_k=2), (p, t, mask)))
    cases.append((dk.AUROC(task="multiclass", num_classes=C, num_bins=64), (p, t, mask)))
    cases.append((dk.AveragePrecision(task="multilabel", num_labels=L, num_bins=64), (pl, tl, None)))
    cases.append((dk.AUROC(task="binary", num_bins=64), (pb, tb, None)))
    cases.append((dk.Perplexity(ignore_index=0), (p, t, mask)))
    for name in ["MeanSquaredError", "MeanAbsoluteError", "R2Score", "PearsonCorrCoef", "ExplainedVariance"]:
        cases.append((getattr(dk, name)(), (x, y, w, mask)))
    return cases


def test_every_update_runs_under_torch_compile_fullgraph():
    """fullgraph=True: any graph break (host sync, data-dependent shape) fails.
    One compiled function traces every metric's update (aot_eager: dynamo +
    fake-tensor tracing without inductor codegen, to keep the test short); the
    compiled results equal eager ones."""
    torch._dynamo.reset()
    cases = _all_metric_updates()
    eager = _all_metric_updates()
    compiled_ms = [m for m, _ in cases]
    args = [a for _, a in cases]

    def step(*flat_args):
        for m, a in zip(compiled_ms, flat_args):
            m.update(*a)

    torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    for (m, _), (e, a) in zip(cases, eager):
        e.update(*a)
        np.testing.assert_allclose(m.compute().numpy(), e.compute().numpy(), rtol=1e-12, atol=1e-12,
                                   err_msg=type(m).__name__)


def test_group_update_under_torch_compile_inductor():
    torch._dynamo.reset()
    C = 7
    g = dk.MetricGroup({**_classification_members(C), "ppl": dk.Perplexity(num_classes=C)})
    e = dk.MetricGroup({**_classification_members(C), "ppl": dk.Perplexity(num_classes=C)})
    step = torch.compile(lambda p, t: g.update(preds=p, target=t), fullgraph=True)
    for _ in range(2):
        p, t = torch.randn(16, C), torch.randint(0, C, (16,))
        step(p, t)
        e.update(preds=p, target=t)
    for k, v in e.compute().items():
        torch.testing.assert_close(g.compute()[k], v, rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
def test_cuda_group_matches_cpu():
    """The same group on CUDA (cuda/triton kernels) and on CPU: counts exact, ratios to 1e-12."""
    C = 11

    def build():
        return dk.MetricGroup({**_classification_members(C), "ppl": dk.Perplexity(num_classes=C),
                               "auroc": dk.AUROC(task="multiclass", num_classes=C),
                               "mcc": dk.MatthewsCorrCoef(task="multiclass", num_classes=C)})

    cpu, gpu = build(), build().to("cuda")
    for _ in range(3):
        p, t = torch.randn(257, C, dtype=torch.float64), torch.randint(0, C, (257,))
        m = torch.rand(257) > 0.1
        cpu.update(preds=p, target=t, mask=m)
        gpu.update(preds=p.cuda(), target=t.cuda(), mask=m.cuda())
    a, b = cpu.compute(), gpu.compute()
    assert torch.equal(a["cm"], b["cm"].cpu())
    for k in a:
        torch.testing.assert_close(b[k].cpu(), a[k], rtol=1e-12, atol=1e-12)
