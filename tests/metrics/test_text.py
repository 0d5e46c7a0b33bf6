"""Perplexity against a float64 log-softmax reference and torchmetrics."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchmetrics.text import Perplexity as TMPerplexity

import d9d_kernels as dk
from tests.metrics._catalogue_utils import _one_thread  # noqa: F401


# float32/float16/bfloat16 logits: the kernel's exp runs in float lanes (sums in
# float64): the contract is 1e-6 relative; float64 logits keep a float64 exp.
def rtol(dtype):
    return 1e-9 if dtype == torch.float64 else 1e-6


def reference(logits, target, ignore_index=None, mask=None):
    lp = torch.log_softmax(logits.double(), dim=-1)
    keep = torch.ones_like(target, dtype=torch.bool)
    if ignore_index is not None:
        keep &= target != ignore_index
    if mask is not None:
        keep &= torch.broadcast_to(mask, target.shape)
    if keep.sum() == 0:
        return 0.0
    t = torch.where(keep, target, torch.zeros_like(target))
    nll = -lp.gather(-1, t[..., None])[..., 0]
    return float(torch.exp(nll[keep].sum() / keep.sum()))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    B=st.integers(1, 3),
    T=st.integers(0, 7),
    V=st.integers(2, 50),
    scale=st.sampled_from([1.0, 10.0, 1e4]),
    ignore=st.sampled_from([None, -100, 1]),
    masked=st.booleans(),
    flat=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
)
def test_against_float64_log_softmax(seed, B, T, V, scale, ignore, masked, flat, dtype):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64) * min(scale, 10.0)
    target = torch.randint(0, V, (B, T), generator=g)
    if scale == 1e4:
        # entries at +-1e4 (+ noise); the target among the +1e4 ones, so the perplexity itself is finite
        sign = torch.where(torch.rand(B, T, V, generator=g) < 0.5, 1.0, -1.0).double()
        sign.scatter_(-1, target[..., None], 1.0)
        logits = sign * 1e4 + logits
    logits = logits.to(dtype)
    if ignore == -100:
        target[torch.rand(B, T, generator=g) < 0.2] = -100
    mask = torch.rand(B, T, generator=g) < 0.7 if masked else None
    if flat:
        logits, target = logits.reshape(-1, V), target.reshape(-1)
        mask = None if mask is None else mask.reshape(-1)
    m = dk.Perplexity(ignore_index=ignore)
    m.update(logits, target, mask=mask)
    got = m.compute()
    assert torch.isfinite(got)
    np.testing.assert_allclose(got.item(), reference(logits, target, ignore, mask), rtol=rtol(dtype))


def test_extreme_logits_stay_finite():
    """Logits at +-1e4 (float32): log-sum-exp without overflow, exact against float64."""
    V = 1000
    logits = torch.full((64, V), -1e4)
    logits[:, :3] = 1e4 + torch.randn(64, 3)  # three near-tied winners at 1e4
    target = torch.randint(0, 3, (64,))
    m = dk.Perplexity()
    m.update(logits, target)
    out = m.compute()
    assert torch.isfinite(out)
    np.testing.assert_allclose(out.item(), reference(logits, target), rtol=rtol(logits.dtype))


def test_matches_torchmetrics():
    logits = torch.randn(3, 11, 37)
    target = torch.randint(0, 37, (3, 11))
    target[0, :4] = -100
    ours = dk.Perplexity(ignore_index=-100)
    ours.update(logits, target)
    tm = TMPerplexity(ignore_index=-100)
    tm.update(logits, target)
    np.testing.assert_allclose(ours.compute().item(), tm.compute().item(), rtol=1e-5)


def test_grouped_with_accuracy_one_kernel_call(monkeypatch):
    """Perplexity(num_classes=V) + top-1/top-5 token accuracy: ONE class_stats call per g.update."""
    from d9d_kernels.metrics import class_stats as cs_mod

    calls = []
    real = cs_mod.ops.class_stats

    def spy(*a, **k):
        calls.append(k.get("top_ks"))
        return real(*a, **k)

    monkeypatch.setattr(cs_mod.ops, "class_stats", spy)
    V = 40
    g = dk.MetricGroup({
        "ppl": dk.Perplexity(ignore_index=-100, num_classes=V),
        "acc": dk.Accuracy(task="multiclass", num_classes=V, ignore_index=-100),
        "top5": dk.Accuracy(task="multiclass", num_classes=V, top_k=5, ignore_index=-100),
    })
    logits = torch.randn(2, 9, V)
    target = torch.randint(0, V, (2, 9))
    target[1, -3:] = -100
    g.update(preds=logits, target=target)
    assert len(calls) == 1 and tuple(calls[0]) == (1, 5)
    out = g.compute()
    np.testing.assert_allclose(out["ppl"].item(), reference(logits, target, -100), rtol=rtol(logits.dtype))
    keep = target != -100
    top1 = (logits.argmax(-1) == target)[keep].double().mean().item()
    top5 = (logits.topk(5, -1).indices == target[..., None]).any(-1)[keep].double().mean().item()
    assert out["acc"].item() == pytest.approx(top1, abs=1e-12)
    assert out["top5"].item() == pytest.approx(top5, abs=1e-12)


def test_errors():
    m = dk.Perplexity()
    with pytest.raises(ValueError, match="Perplexity: argument 'preds'"):
        m.update(torch.randn(4, 5), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="Perplexity: argument 'preds'"):
        m.update(torch.zeros(4, 5, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="Perplexity: argument 'preds'"):
        dk.Perplexity(num_classes=6).update(torch.randn(4, 5), torch.zeros(4, dtype=torch.long))
    m.update(torch.randn(2, 5), torch.tensor([1, 7]))
    with pytest.raises(ValueError, match="1 invalid"):
        m.compute()
    assert dk.Perplexity().compute().item() == 0.0  # nothing seen


@pytest.mark.parametrize("nan_strategy", ["error", "ignore", "propagate"])
@pytest.mark.parametrize("grouped", [False, True])
def test_masked_vocabulary_matches_torchmetrics(nan_strategy, grouped):
    """A vocabulary masked with -inf logits (never the target) is valid input,
    alone and grouped with token accuracy: perplexity equals torchmetrics',
    accuracy torchmetrics' top-1/top-5, under every nan_strategy."""
    from torchmetrics.classification import MulticlassAccuracy

    g = torch.Generator().manual_seed(7)
    B, T, V = 2, 9, 50
    logits = torch.randn(B, T, V, generator=g)
    target = torch.randint(0, V, (B, T), generator=g)
    target[0, :2] = -100
    vocab_mask = torch.rand(B, T, V, generator=g) < 0.6
    vocab_mask.scatter_(-1, target.clamp(min=0)[..., None], False)
    logits = logits.masked_fill(vocab_mask, float("-inf"))
    if grouped:
        g_ = dk.MetricGroup({
            "ppl": dk.Perplexity(ignore_index=-100, num_classes=V, nan_strategy=nan_strategy),
            "acc": dk.Accuracy(task="multiclass", num_classes=V, ignore_index=-100, nan_strategy=nan_strategy),
            "top5": dk.Accuracy(task="multiclass", num_classes=V, top_k=5, ignore_index=-100,
                                nan_strategy=nan_strategy),
        })
        g_.update(preds=logits, target=target)
        out = g_.compute()
        for k, tm in (("acc", MulticlassAccuracy(V, average="micro", ignore_index=-100)),
                      ("top5", MulticlassAccuracy(V, top_k=5, average="micro", ignore_index=-100))):
            tm.update(logits.reshape(-1, V), target.reshape(-1))
            np.testing.assert_allclose(out[k].item(), tm.compute().item(), rtol=1e-6)
        ppl = out["ppl"]
    else:
        m = dk.Perplexity(ignore_index=-100, nan_strategy=nan_strategy)
        m.update(logits, target)
        ppl = m.compute()
    tm = TMPerplexity(ignore_index=-100)
    tm.update(logits, target)
    want = tm.compute().item()
    assert np.isfinite(want)
    np.testing.assert_allclose(ppl.item(), want, rtol=1e-5)
