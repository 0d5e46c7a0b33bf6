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
    got, want = [f64(2, L, B), f64(2)], [f64(2, L, B), f64(2)]
    dk.ops.score_histogram(preds, target, mask, hist=got[0], bad=got[1], multiclass=multiclass, ignore_index=ignore_index,
                           input_kind=input_kind, backend=backend)
    rp = preds.reshape(-1, L)
    rt = as_index("t", "target", target)
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
    # by cause: a target outside [0, L) whatever the row holds, else a NaN/Inf score in the row
    kept, target_ok = target != -1, (target >= 0) & (target < 5)
    want = [(kept & ~target_ok).sum().item(), (kept & target_ok & ~torch.isfinite(preds).all(1)).sum().item()]
    assert got[1].tolist() == want and min(want) > 0
    labels = torch.randint(-1, 3, (200, 5))
    got = run_and_compare(backend, preds, labels, ignore_index=-1, B=3)
    kept, target_ok = labels != -1, (labels == 0) | (labels == 1)
    want = [(kept & ~target_ok).sum().item(), (kept & target_ok & ~torch.isfinite(preds)).sum().item()]
    assert got[1].tolist() == want and min(want) > 0
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


# ---- contracts: opcheck, torch.compile, bad input ----------------------------------------
from op_utils import assert_compiled_matches_eager, assert_rejects, needs_cpp  # noqa: E402


@needs_cpp
def test_opcheck():
    p, t, m = torch.randn(30, 3), torch.randint(0, 2, (30, 3)), torch.rand(30, 3) > 0.2
    op = torch.ops.d9d_kernels.score_histogram.default
    torch.library.opcheck(op, (p, t, m, None, 2, False, f64(2, 3, 8), f64(2)))
    torch.library.opcheck(op, (p.bfloat16(), t[:, 0], m[:, 0], 1, 1, True, f64(2, 3, 5), f64(2)))


@pytest.mark.parametrize("multiclass", [False, True])
@pytest.mark.parametrize("impl", ["cpp", "torch"])
def test_compile_matches_eager(impl, multiclass):
    if impl not in dk.ops.backends():
        pytest.skip(f"{impl} not available")
    p = torch.randn(16, 4)
    t = torch.randint(0, 4, (16,)) if multiclass else torch.randint(0, 2, (16, 4))

    def fn(hist, bad):
        dk.ops.score_histogram(p, t, t != 3, hist=hist, bad=bad, multiclass=multiclass, backend=impl)

    assert_compiled_matches_eager(fn, lambda: (f64(2, 4, 10), f64(2)))


def test_bad_input_wrapper():
    op = "score_histogram"
    p, t = torch.rand(8, 3), torch.randint(0, 2, (8, 3))
    h, bd = f64(2, 3, 5), f64(2)
    call = lambda **kw: dk.ops.score_histogram(**{"preds": p, "target": t, "hist": h, "bad": bd, **kw})  # noqa: E731
    assert_rejects(lambda: call(target=t[:, :2]), op, "target", [h, bd])
    assert_rejects(lambda: call(multiclass=True), op, "preds", [h, bd])
    assert_rejects(lambda: call(mask=torch.ones(8, 3)), op, "mask", [h, bd])
    assert_rejects(lambda: call(input_kind=7), op, "input_kind", [h, bd])
    assert_rejects(lambda: call(hist=f64(2, 2, 5)), op, "hist", [h, bd])
    assert_rejects(lambda: call(hist=f64(3, 3, 5)), op, "hist", [h, bd])
    assert_rejects(lambda: call(hist=torch.zeros(2, 3, 5)), op, "hist", [h, bd])
    assert_rejects(lambda: call(hist=f64(2, 3, 10)[..., ::2]), op, "hist", [h, bd])
    assert_rejects(lambda: call(hist=h.to("meta")), op, "hist", [h, bd])
    assert_rejects(lambda: call(bad=f64(0)), op, "bad", [h, bd])


@needs_cpp
def test_bad_input_direct_op():
    op = "score_histogram"
    p, t = torch.rand(8, 3), torch.randint(0, 2, (8, 3))
    h, bd = f64(2, 3, 5), f64(2)

    def call(preds=p, target=t, mask=None, kind=2, multiclass=False, hist=h, bad=bd):
        torch.ops.d9d_kernels.score_histogram(preds, target, mask, None, kind, multiclass, hist, bad)

    assert_rejects(lambda: call(preds=t), op, "preds", [h, bd])
    assert_rejects(lambda: call(preds=p.reshape(-1)), op, "preds", [h, bd])
    assert_rejects(lambda: call(target=t.bool()), op, "target", [h, bd])
    assert_rejects(lambda: call(multiclass=True), op, "target", [h, bd])
    assert_rejects(lambda: call(mask=torch.ones(8, dtype=torch.bool)), op, "mask", [h, bd])
    assert_rejects(lambda: call(kind=3), op, "input_kind", [h, bd])
    assert_rejects(lambda: call(hist=f64(2, 3, 0)), op, "hist", [h, bd])
    assert_rejects(lambda: call(hist=f64(2, 4, 5)), op, "hist", [h, bd])
    assert_rejects(lambda: call(hist=f64(2, 3, 10)[..., ::2]), op, "hist", [h, bd])
    assert_rejects(lambda: call(hist=h.to("meta")), op, "hist", [h, bd])
    assert_rejects(lambda: call(bad=f64(1)), op, "bad", [h, bd])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("shape", "B", "multiclass"), [((5, 123), 10, False), ((100_003, 2), 1000, False),
                                                         ((5, 123), 10, True), ((3001, 10), 10_000, True)])
def test_cuda_matches_reference(dtype, kind, shape, B, multiclass):
    preds = sprinkle(torch.randn(shape).to(dtype), 0.01)
    n, L = shape
    target = torch.randint(-1, L + 1, (n,)) if multiclass else torch.randint(-1, 3, shape)
    mask = torch.rand(target.shape) > 0.1
    want = [f64(2, L, B), f64(2)]
    reference.score_histogram(preds, target, mask, -1, kind, multiclass, *want)
    got = [f64(2, L, B).cuda(), f64(2).cuda()]
    dk.ops.score_histogram(preds.cuda(), target.cuda(), mask.cuda(), hist=got[0], bad=got[1], multiclass=multiclass,
                           ignore_index=-1, input_kind=kind, backend="cuda")
    assert_counts_equal(got[0].cpu(), want[0], "hist")
    assert_counts_equal(got[1].cpu(), want[1], "bad")


@pytest.mark.parametrize("B", [7, 10, 1000])
def test_bin_edges(backend, B):
    """Scores on and next to every bin edge k / B (and -0.0, tiny negatives,
    1.0, just above 1): the kernels' truncating bin index equals the
    reference's clamp(floor(p * B), 0, B - 1)."""
    edges = torch.arange(B + 1, dtype=torch.float64) / B
    p = torch.cat([edges, torch.nextafter(edges, torch.tensor(2.0, dtype=torch.float64)),
                   torch.nextafter(edges, torch.tensor(-1.0, dtype=torch.float64)),
                   torch.tensor([-0.0, -1e-300, 1.0 + 1e-12, 5e-324])])
    target = torch.randint(0, 2, p.shape)
    got = run_and_compare(backend, p, target, B=B, input_kind=reference.INPUT_PROBS)
    assert got[0].sum().item() == p.numel()
