"""Perplexity on language-model shapes: the vector NLL pass against float64
``F.cross_entropy`` (bf16/fp16/fp32, +-1e4 logits, -inf masked vocabularies,
all-ignored batches) and the ``lse=`` update against the plain one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import d9d_kernels as dk
from d9d_kernels.metrics import class_stats as cs_mod
from d9d_kernels.metrics import text as text_mod

IGNORE = -100


def want_ppl(logits, target):
    keep = target != IGNORE
    if not keep.any():
        return 0.0
    return torch.exp(F.cross_entropy(logits.double(), target, ignore_index=IGNORE)).item()


def lm_batch(seed, N, V, dtype, kind):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g, dtype=torch.float64) * 3
    t = torch.randint(0, V, (N,), generator=g)
    if kind == "1e4":  # +-1e4 plus noise, the target among the +1e4 ones: a finite perplexity
        sign = torch.where(torch.rand(N, V, generator=g) < 0.5, 1.0, -1.0).double()
        sign[torch.arange(N), t] = 1.0
        x = sign * 1e4 + x
    if kind == "masked":  # a masked vocabulary: -inf logits, never the target
        m = torch.rand(N, V, generator=g) < 0.6
        m[torch.arange(N), t] = False
        x = x.masked_fill(m, float("-inf"))
    t[torch.rand(N, generator=g) < 0.1] = IGNORE
    return x.to(dtype), t


def group(V):
    return dk.MetricGroup({
        "ppl": dk.Perplexity(ignore_index=IGNORE, num_classes=V),
        "acc": dk.Accuracy(task="multiclass", num_classes=V, ignore_index=IGNORE),
        "top5": dk.Accuracy(task="multiclass", num_classes=V, top_k=5, ignore_index=IGNORE),
    })


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kind", ["plain", "1e4", "masked"])
@pytest.mark.parametrize("V", [1000, 4133])
def test_vector_nll_matches_float64_cross_entropy(dtype, kind, V):
    if dtype == torch.float16 and kind == "1e4":
        pytest.skip("1e4 +- noise is not representable apart in float16")
    x, t = lm_batch(V, 64, V, dtype, kind)
    want = want_ppl(x, t)
    alone = dk.Perplexity(ignore_index=IGNORE)
    alone.update(x, t)
    g = group(V)
    g.update(preds=x, target=t)
    assert alone.compute().item() == pytest.approx(want, rel=1e-6)
    assert g.compute()["ppl"].item() == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_all_ignored_batch_gives_zero(dtype):
    x, t = lm_batch(0, 16, 300, dtype, "plain")
    t[:] = IGNORE
    alone = dk.Perplexity(ignore_index=IGNORE)
    alone.update(x, t)
    g = group(300)
    g.update(preds=x, target=t)
    assert alone.compute().item() == 0.0 and g.compute()["ppl"].item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["plain", "masked"])
def test_lse_update_matches_plain_update(dtype, kind):
    V = 700
    x, t = lm_batch(1, 48, V, dtype, kind)
    lse = torch.logsumexp(x.double(), dim=-1)
    mask = torch.rand(48, generator=torch.Generator().manual_seed(2)) < 0.8
    plain, given = dk.Perplexity(ignore_index=IGNORE), dk.Perplexity(ignore_index=IGNORE)
    plain.update(x, t, mask=mask)
    given.update(x, t, mask=mask, lse=lse)
    sp, sg = plain._states()["nll"], given._states()["nll"]
    assert torch.equal(sp["extras"][0], sg["extras"][0]) and torch.equal(sp["bad"], sg["bad"])
    assert given.compute().item() == pytest.approx(want_ppl(x, torch.where(mask, t, IGNORE)), rel=1e-9)
    assert given.compute().item() == pytest.approx(plain.compute().item(), rel=1e-6)
    # the trainer's float32 logsumexp: the result to float32 precision
    given32 = dk.Perplexity(ignore_index=IGNORE)
    given32.update(x, t, mask=mask, lse=torch.logsumexp(x.float(), dim=-1))
    assert given32.compute().item() == pytest.approx(plain.compute().item(), rel=1e-5)


def test_lse_in_a_group_skips_the_exp_pass_and_keeps_accuracy(monkeypatch):
    V = 500
    x, t = lm_batch(3, 40, V, torch.bfloat16, "plain")
    lse = torch.logsumexp(x.double(), dim=-1)
    plain = group(V)
    plain.update(preds=x, target=t)
    calls = []
    real = cs_mod.ops.class_stats

    def spy(*a, **k):
        calls.append((tuple(k["top_ks"]), k["nll"]))
        return real(*a, **k)

    monkeypatch.setattr(cs_mod.ops, "class_stats", spy)
    given = group(V)
    given.update(preds=x, target=t, lse=lse)
    assert calls == [((1, 5), False)]  # one call, top-k only
    a, b = plain.compute(), given.compute()
    assert a["acc"].item() == b["acc"].item() and a["top5"].item() == b["top5"].item()
    assert b["ppl"].item() == pytest.approx(want_ppl(x, t), rel=1e-9)
    assert b["ppl"].item() == pytest.approx(a["ppl"].item(), rel=1e-6)


def test_lse_without_classes_calls_no_kernel(monkeypatch):
    x, t = lm_batch(4, 8, 50, torch.float32, "plain")
    monkeypatch.setattr(text_mod.ops, "class_stats", lambda *a, **k: pytest.fail("kernel called"))
    m = dk.Perplexity(ignore_index=IGNORE)
    m.update(x, t, lse=torch.logsumexp(x, -1))
    assert m.compute().item() == pytest.approx(want_ppl(x, t), rel=1e-6)


def test_lse_bad_rows_counted_as_the_kernel_does():
    x, t = lm_batch(5, 8, 64, torch.float32, "plain")
    t[:] = torch.arange(8)
    x[2, 7] = float("nan")
    x[5] = float("-inf")  # an all-masked row
    for lse in (None, torch.logsumexp(x, -1)):
        m = dk.Perplexity(ignore_index=IGNORE)
        m.update(x, t, lse=lse)
        s = m._states()["nll"]
        assert s["bad"].tolist() == [0, 2] and s["extras"][0].item() == 6
        with pytest.raises(ValueError, match="Perplexity"):
            m.compute()


def test_lse_bad_input_names_the_argument():
    x, t = lm_batch(6, 8, 32, torch.float32, "plain")
    m = dk.Perplexity()
    with pytest.raises(ValueError, match="Perplexity.*lse"):
        m.update(x, t, lse=torch.zeros(7))
    with pytest.raises(TypeError, match="Perplexity.*lse"):
        m.update(x, t, lse=torch.zeros(8, dtype=torch.int64))
    assert m._states()["nll"]["extras"].sum().item() == 0  # state untouched
