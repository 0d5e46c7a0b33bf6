"""score_histogram: every backend vs d9d_kernels.reference (bin counts exact)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_utils import FLOAT_DTYPES, assert_counts_equal, f64, noncontig, sprinkle

import d9d_kernels as dk
from d9d_kernels import reference
from d9d_kernels.ops._common import as_index

KINDS = [reference.INPUT_PROBS, reference.INPUT_LOGITS, reference.INPUT_AUTO]


def run_and_compare(backend, preds, target, mask=None, *, B=16, multiclass=False, ignore_index=None, input_kind=reference.INPUT_AUTO):
    L = preds.shape[-1] if multiclass else (1 if preds.dim() <= 1 else preds.shape[-1])
    got, want = [f64(2, L, B), f64(1)], [f64(2, L, B), f64(1)]
    dk.ops.score_histogram(preds, target, mask, hist=got[0], bad=got[1], multiclass=multiclass, ignore_index=ignore_index,
                           input_kind=input_kind, backend=backend)
    rp = preds.reshape(-1, L)
    rt = as_index("t", "target", target, target.device)
    rt = rt.reshape(-1) if multiclass else rt.reshape(-1, L)
    rm = None if mask is None else torch.broadcast_to(mask, target.shape)
    rm = None if rm is None else (rm.reshape(-1) if multiclass else rm.reshape(-1, L))
    reference.score_histogram(rp, rt, rm, ignore_index, input_kind, multiclass, want[0], want[1])
    assert_counts_equal(got[0], want[0], "hist")
    assert_counts_equal(got[1], want[1], "bad")
    return got


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (5, 123), (3000, 4), (70000,)])
@pytest.mark.parametrize("kind", KINDS)
def test_binary_multilabel(backend, dtype, shape, kind):
    probs = torch.rand(shape).to(dtype)
    probs.view(-1)[:2] = torch.tensor([0.0, 1.0], dtype=dtype)[: probs.numel()]  # edges: first and last bin
    target = torch.randint(0, 2, shape)
    run_and_compare(backend, probs, target, torch.rand(shape) > 0.2, B=10, input_kind=kind)
    got = run_and_compare(backend, (torch.randn(shape) * 4).to(dtype), target, B=7, input_kind=kind)
    assert got[0].sum().item() == target.numel()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(0, 3), (1, 1), (5, 123), (2000, 10)])
@pytest.mark.parametrize("kind", KINDS)
def test_multiclass(backend, dtype, shape, kind):
    n, C = shape
    logits = (torch.randn(n, C) * 2).to(dtype)
    probs = torch.softmax(logits.float(), 1).to(dtype)
    target = torch.randint(0, C, (n,))
    mask = torch.rand(n) > 0.2
    run_and_compare(backend, logits, target, mask, B=20, multiclass=True, input_kind=kind)
    run_and_compare(backend, probs, target, None, B=20, multiclass=True, input_kind=kind)


def test_bad_and_ignored(backend):
    preds = sprinkle(torch.randn(200, 5), 0.03)
    target = torch.randint(-1, 7, (200,))
    target[0] = 10**12
    got = run_and_compare(backend, preds, target, multiclass=True, ignore_index=-1, B=100)
    assert got[1].item() > 0
    got = run_and_compare(backend, preds, torch.randint(-1, 3, (200, 5)), ignore_index=-1, B=3)
    assert got[1].item() > 0
    run_and_compare(backend, preds, torch.randint(0, 2, (200, 5)), torch.zeros(200, 5, dtype=torch.bool))


def test_many_bins_single_label(backend):
    # a big [2, 1, 10000] histogram over 100k scores (private histograms per thread)
    run_and_compare(backend, torch.rand(100_000, dtype=torch.float64), torch.randint(0, 2, (100_000,)), B=10_000)


def test_noncontiguous(backend):
    preds = noncontig(torch.randn(60, 6))
    run_and_compare(backend, preds, noncontig(torch.randint(0, 2, (60, 6))), torch.rand(60, 1) > 0.4, B=5)
    run_and_compare(backend, preds, torch.randint(0, 6, (60,)), torch.rand(60) > 0.4, B=5, multiclass=True)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 30),
    L=st.integers(1, 5),
    B=st.integers(1, 12),
    multiclass=st.booleans(),
    kind=st.sampled_from(KINDS),
    scale=st.sampled_from([1.0, 3.0]),
    with_mask=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_hypothesis(n, L, B, multiclass, kind, scale, with_mask, seed):
    g = torch.Generator().manual_seed(seed)
    preds = torch.rand(n, L, generator=g, dtype=torch.float64) * scale
    if multiclass:
        target = torch.randint(-1, L + 1, (n,), generator=g)
        mask = torch.rand(n, generator=g) > 0.3 if with_mask else None
    else:
        target = torch.randint(-1, 3, (n, L), generator=g)
        mask = torch.rand(n, L, generator=g) > 0.3 if with_mask else None
    for b in dk.ops.backends():
        if b in ("cpp", "torch"):
            run_and_compare(b, preds, target, mask, B=B, multiclass=multiclass, ignore_index=-1, input_kind=kind)
