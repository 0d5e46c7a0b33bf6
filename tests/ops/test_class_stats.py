"""class_stats: every backend vs d9d_kernels.reference (counts exact, NLL to rounding)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_utils import FLOAT_DTYPES, assert_counts_equal, assert_sums_close, f64, needs_cpp, noncontig, sprinkle

import d9d_kernels as dk
from d9d_kernels import reference


def run_and_compare(backend, preds, target, mask=None, *, C, top_ks=(1,), nll=False, ignore_index=None, confmat=True):
    K = len(top_ks)
    mk = lambda: [f64(K, 3, C), f64(C, C) if confmat else None, f64(2), f64(2)]  # noqa: E731
    got, want = mk(), mk()
    dk.ops.class_stats(preds, target, mask, num_classes=C, stats=got[0], confmat=got[1], extras=got[2], bad=got[3],
                       ignore_index=ignore_index, top_ks=top_ks, nll=nll, backend=backend)
    n = target.numel()
    scores = preds.is_floating_point()
    rp = preds.reshape(n, C) if scores else preds.reshape(-1)
    rm = None if mask is None else torch.broadcast_to(mask, target.shape).reshape(-1)
    reference.class_stats(rp, target.reshape(-1), rm, C, ignore_index, list(top_ks), nll, want[0], want[1], want[2], want[3])
    assert_counts_equal(got[0], want[0], "stats")
    if confmat:
        assert_counts_equal(got[1], want[1], "confmat")
    assert_counts_equal(got[2][:1], want[2][:1], "extras[0]")
    assert_counts_equal(got[3], want[3], "bad")
    assert_nll_close(got[2], want[2], preds.dtype)
    return got


def assert_nll_close(got_extras, want_extras, dtype):
    """float32/float16/bfloat16 scores: the CPU's exp runs in float lanes, each row's
    NLL within 1e-7 (perplexity within 1e-7 relative); float64 scores: to rounding."""
    if dtype in (torch.float32, torch.float16, torch.bfloat16):
        atol = 1e-7 * max(1.0, want_extras[0].item())
        torch.testing.assert_close(got_extras[1:], want_extras[1:], rtol=0, atol=atol, equal_nan=True)
    else:
        assert_sums_close(got_extras[1:], want_extras[1:], "nll")


@pytest.mark.parametrize(("n", "C"), [(0, 3), (1, 1), (123, 7), (5000, 1000), (150_000, 7), (150_000, 50)])
def test_indices(backend, n, C):
    preds = torch.randint(-1, C + 1, (n,))  # a few out of range: bad
    target = torch.randint(-1, C + 1, (n,))
    mask = torch.rand(n) > 0.2
    got = run_and_compare(backend, preds, target, mask, C=C, ignore_index=C // 2)
    assert got[2][0] + got[3][0] <= n


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(0, 5), (1, 1), (5, 123), (300, 10), (3000, 37)])
def test_scores(backend, dtype, shape):
    n, C = shape
    preds = torch.randn(n, C).to(dtype)
    target = torch.randint(0, C, (n,))
    top_ks = tuple(sorted({1, min(5, C), C}))
    run_and_compare(backend, preds, target, torch.rand(n) > 0.1, C=C, top_ks=top_ks, nll=True)


def test_ties_follow_lower_index_first(backend):
    # every row is all-equal or has repeated maxima: argmax and top-k by lowest index
    C = 6
    preds = torch.tensor([[1.0] * C, [0, 2, 2, 1, 2, 0], [3, 3, 0, 0, 3, 3], [-1, -1, -1, -1, -1, 5.0]])
    target = torch.tensor([0, 4, 5, 5])
    got = run_and_compare(backend, preds, target, C=C, top_ks=(1, 2, 3, C), nll=True)
    # argmax of row 1 is class 1 (first of the tied 2s): target 4 is not a top-1 hit
    assert got[0][0, 0].tolist() == [1, 0, 0, 0, 0, 1]
    # bfloat16 rounds many logits to equal values
    preds = (torch.randn(500, 50) * 0.01).to(torch.bfloat16)
    run_and_compare(backend, preds, torch.randint(0, 50, (500,)), C=50, top_ks=(1, 3, 10), nll=True)


def test_bad_rows(backend):
    C = 9
    preds = sprinkle(torch.randn(200, C), 0.02, values=(float("nan"), float("inf")))  # -inf: test_masked_logits
    target = torch.randint(-3, C + 3, (200,))
    target[:5] = 10**12  # huge ids
    target[5:10] = -(10**12)
    target[10:20] = -100  # ignore_index
    got = run_and_compare(backend, preds, target, C=C, top_ks=(1, 2), nll=True, ignore_index=-100)
    # by cause: a bad target whatever the row holds, else NaN/+Inf scores
    kept, target_ok = target != -100, (target >= 0) & (target < C)
    row_ok = torch.isfinite(preds).all(1)
    want = [(kept & ~target_ok).sum().item(), (kept & target_ok & ~row_ok).sum().item()]
    assert got[3].tolist() == want and min(want) > 3
    assert torch.isfinite(got[2]).all()
    got = run_and_compare(backend, torch.full((20,), 10**12), torch.zeros(20, dtype=torch.int64), C=C)
    assert got[3].tolist() == [20, 0] and got[2][0].item() == 0  # an index pred out of range: a label mistake


def test_all_masked_and_no_confmat(backend):
    preds, target = torch.randn(64, 4), torch.randint(0, 4, (64,))
    got = run_and_compare(backend, preds, target, torch.zeros(64, dtype=torch.bool), C=4, nll=True, confmat=False)
    assert got[0].abs().sum().item() == 0 and got[2].abs().sum().item() == 0
    run_and_compare(backend, preds, target, torch.tensor(True), C=4, top_ks=(4, 2), nll=True, confmat=False)


def test_noncontiguous_and_batched(backend):
    C = 11
    preds = noncontig(torch.randn(3, 40, C))
    target = torch.randint(0, C, (3, 40))
    mask = torch.rand(3, 1) > 0.3
    run_and_compare(backend, preds, target, mask, C=C, top_ks=(1, 3), nll=True)
    run_and_compare(backend, noncontig(torch.randint(0, C, (3, 40))), target, mask, C=C)


def test_large_k_sorts_the_row(backend):
    # max(top_ks) above the insertion buffer (64) takes the partial-sort path
    C = 150
    preds = torch.randint(0, 20, (100, C)).to(torch.float32)  # many ties
    run_and_compare(backend, preds, torch.randint(0, C, (100,)), C=C, top_ks=(1, 65, 149, C), nll=True)


def test_nll_matches_cross_entropy(backend):
    preds, target = torch.randn(257, 31, dtype=torch.float64) * 5, torch.randint(0, 31, (257,))
    ex = f64(2)
    dk.ops.class_stats(preds, target, num_classes=31, stats=f64(1, 3, 31), extras=ex, bad=f64(2), nll=True, backend=backend)
    want = torch.nn.functional.cross_entropy(preds, target, reduction="sum")
    torch.testing.assert_close(ex[1], want, rtol=1e-12, atol=0)
    assert ex[0].item() == 257


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 60),
    C=st.integers(1, 12),
    use_scores=st.booleans(),
    k_extra=st.integers(1, 12),
    with_mask=st.booleans(),
    ignore=st.sampled_from([None, 0, -1]),
    lo_res=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_hypothesis(n, C, use_scores, k_extra, with_mask, ignore, lo_res, seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(-1, C + 1, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.3 if with_mask else None
    if use_scores:
        preds = torch.randint(0, 4, (n, C), generator=g).double() if lo_res else torch.randn(n, C, generator=g, dtype=torch.float64)
        top_ks = tuple(sorted({1, min(k_extra, C)}))
    else:
        preds, top_ks = torch.randint(-1, C + 1, (n,), generator=g), (1,)
    for b in dk.ops.backends():
        if b in ("cpp", "torch"):
            run_and_compare(b, preds, target, mask, C=C, top_ks=top_ks, nll=use_scores, ignore_index=ignore)


# ---- contracts: opcheck, torch.compile, bad input ----------------------------------------
from op_utils import assert_compiled_matches_eager, assert_rejects, needs_cpp  # noqa: E402


@needs_cpp
def test_opcheck():
    p, t, m = torch.randn(40, 6), torch.randint(0, 6, (40,)), torch.rand(40) > 0.2
    op = torch.ops.d9d_kernels.class_stats.default
    torch.library.opcheck(op, (p, t, m, 6, None, [1, 3], True, f64(2, 3, 6), f64(6, 6), f64(2), f64(2)))
    torch.library.opcheck(op, (p.bfloat16(), t, None, 6, 2, [6], False, f64(1, 3, 6), None, f64(2), f64(2)))
    torch.library.opcheck(op, (t.flip(0), t, m, 6, None, [1], False, f64(1, 3, 6), f64(6, 6), f64(2), f64(2)))


@pytest.mark.parametrize("scores", [False, True])
@pytest.mark.parametrize("impl", ["cpp", "torch"])
def test_compile_matches_eager(impl, scores):
    if impl not in dk.ops.backends():
        pytest.skip(f"{impl} not available")
    C = 7
    t = torch.randint(0, C, (4, 9))
    p = torch.randn(4, 9, C) if scores else torch.randint(0, C, (4, 9))
    ks = (1, 3) if scores else (1,)

    def fn(stats, confmat, extras, bad):
        dk.ops.class_stats(p, t, t != 2, num_classes=C, stats=stats, confmat=confmat, extras=extras, bad=bad,
                           top_ks=ks, nll=scores, ignore_index=5, backend=impl)

    assert_compiled_matches_eager(fn, lambda: (f64(len(ks), 3, C), f64(C, C), f64(2), f64(2)))


def _states(K=1, C=5):
    return dict(stats=f64(K, 3, C), extras=f64(2), bad=f64(2), confmat=f64(C, C))


def test_bad_input_wrapper():
    C, op = 5, "class_stats"
    p, t = torch.randn(8, C), torch.randint(0, C, (8,))
    s = _states(1, C)
    keep = list(s.values())
    call = lambda **kw: dk.ops.class_stats(**{"preds": p, "target": t, "num_classes": C, **s, **kw})  # noqa: E731
    assert_rejects(lambda: call(preds=torch.randn(8, C + 1)), op, "preds", keep)
    assert_rejects(lambda: call(preds=torch.randint(0, C, (9,))), op, "preds", keep)
    assert_rejects(lambda: call(mask=torch.ones(8)), op, "mask", keep)
    assert_rejects(lambda: call(top_ks=(0,)), op, "top_ks", keep)
    assert_rejects(lambda: call(top_ks=(C + 1,)), op, "top_ks", keep)
    assert_rejects(lambda: call(top_ks=(2, 2)), op, "top_ks", keep)
    assert_rejects(lambda: call(preds=t, top_ks=(2,)), op, "top_ks", keep)
    assert_rejects(lambda: call(preds=t, nll=True), op, "nll", keep)
    assert_rejects(lambda: call(stats=f64(2, 3, C)), op, "stats", keep)
    assert_rejects(lambda: call(stats=torch.zeros(1, 3, C)), op, "stats", keep)
    assert_rejects(lambda: call(stats=f64(1, 3, 2 * C)[..., ::2]), op, "stats", keep)
    assert_rejects(lambda: call(stats=s["stats"].to("meta")), op, "stats", keep)
    assert_rejects(lambda: call(confmat=f64(C, C + 1)), op, "confmat", keep)
    assert_rejects(lambda: call(extras=f64(3)), op, "extras", keep)
    assert_rejects(lambda: call(bad=f64(2).float()), op, "bad", keep)


@needs_cpp
def test_bad_input_direct_op():
    C, op = 5, "class_stats"
    p, t = torch.randn(8, C), torch.randint(0, C, (8,))
    st, cm, ex, bd = f64(1, 3, C), f64(C, C), f64(2), f64(2)
    keep = [st, cm, ex, bd]

    def call(preds=p, target=t, mask=None, num_classes=C, ks=(1,), nll=False, stats=st, confmat=cm, extras=ex, bad=bd):
        torch.ops.d9d_kernels.class_stats(preds, target, mask, num_classes, None, list(ks), nll, stats, confmat, extras, bad)

    assert_rejects(lambda: call(num_classes=0), op, "num_classes", keep)
    assert_rejects(lambda: call(target=t.int()), op, "target", keep)
    assert_rejects(lambda: call(preds=p[:, :4]), op, "preds", keep)
    assert_rejects(lambda: call(preds=t.int()), op, "preds", keep)
    assert_rejects(lambda: call(mask=torch.ones(7, dtype=torch.bool)), op, "mask", keep)
    assert_rejects(lambda: call(ks=(0,)), op, "top_ks", keep)
    assert_rejects(lambda: call(ks=(6,)), op, "top_ks", keep)
    assert_rejects(lambda: call(ks=(1, 1), stats=f64(2, 3, C)), op, "top_ks", keep)
    assert_rejects(lambda: call(ks=()), op, "top_ks", keep)
    assert_rejects(lambda: call(preds=t, nll=True), op, "nll", keep)
    assert_rejects(lambda: call(stats=f64(1, 3, C + 1)), op, "stats", keep)
    assert_rejects(lambda: call(stats=torch.zeros(1, 3, C)), op, "stats", keep)
    assert_rejects(lambda: call(stats=f64(1, 3, 2 * C)[..., ::2]), op, "stats", keep)
    assert_rejects(lambda: call(stats=st.to("meta")), op, "stats", keep)
    assert_rejects(lambda: call(confmat=f64(C, 1)), op, "confmat", keep)
    assert_rejects(lambda: call(extras=f64(1)), op, "extras", keep)
    assert_rejects(lambda: call(bad=f64(1)), op, "bad", keep)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(("n", "C", "top_ks"), [(1, 1, (1,)), (123, 5, (1, 5)), (4099, 37, (1, 5, 37)), (300, 2000, (1, 5, 100))])
def test_cuda_matches_reference(dtype, n, C, top_ks):
    preds = sprinkle(torch.randint(0, 8, (n, C)).to(dtype), 0.002)  # ties and a few bad rows
    target = torch.randint(-1, C + 1, (n,))
    mask = torch.rand(n) > 0.1
    masked = torch.randn(n, C).masked_fill(torch.rand(n, C) < 0.6, float("-inf")).to(dtype)  # masked logits
    masked[: max(1, n // 50)] = float("-inf")  # rows of only -inf: bad
    for p, ks, nll in ((preds, top_ks, True), (masked, top_ks, True), (torch.randint(-1, C + 1, (n,)), (1,), False)):
        want = [f64(len(ks), 3, C), f64(C, C), f64(2), f64(2)]
        reference.class_stats(p, target, mask, C, -1, list(ks), nll, *want)
        got = [t.cuda() for t in (f64(len(ks), 3, C), f64(C, C), f64(2), f64(2))]
        dk.ops.class_stats(p.cuda(), target.cuda(), mask.cuda(), num_classes=C, stats=got[0], confmat=got[1],
                           extras=got[2], bad=got[3], ignore_index=-1, top_ks=ks, nll=nll, backend="cuda")
        got = [t.cpu() for t in got]
        for g, w, what in zip(got[:2] + [got[2][:1], got[3]], want[:2] + [want[2][:1], want[3]], ["stats", "confmat", "rows", "bad"]):
            assert_counts_equal(g, w, what)
        # rows of <= 32 classes sum exp in float32 before the float64 fold (docs/kernels.md)
        assert_sums_close(got[2][1:], want[2][1:], "nll", rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 1000])
def test_cuda_indices_without_confmat(n):
    """Index preds with no confusion matrix: the block's shared counters hold the
    stats alone (no confusion-matrix cells past them)."""
    C = 10
    p, t = torch.randint(-1, C + 1, (n,)), torch.randint(-1, C + 1, (n,))
    want = [f64(1, 3, C), f64(2), f64(2)]
    reference.class_stats(p, t, None, C, None, [1], False, want[0], None, want[1], want[2])
    got = [x.cuda() for x in (f64(1, 3, C), f64(2), f64(2))]
    torch.ops.d9d_kernels.class_stats.default(p.cuda(), t.cuda(), None, C, None, [1], False, got[0], None, *got[1:])
    for g, w, what in zip(got, want, ("stats", "extras", "bad")):
        assert_counts_equal(g.cpu(), w, what)


def _class_strided(x: torch.Tensor) -> torch.Tensor:
    """``x`` [R, C] with the same values, classes R apart (as one sample of a
    channel-first [N, C, H, W] batch seen as [H*W, C])."""
    out = x.t().contiguous().t()
    assert out.stride() == (1, x.shape[0]) or x.shape[0] <= 1
    return out


@pytest.mark.parametrize("layout", ["rows", "class_strided"])
def test_scores_several_chunks_with_confmat(backend, layout):
    """Enough rows for several CPU chunks: the confusion matrix goes through the
    per-row cells (not privatised), the counts through private slices; with
    class-strided scores, top-1 alone (the column scan) and with top-3 (tiles)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        n, C = 40_000, 10
        preds = sprinkle(torch.randn(n, C))
        target = torch.randint(-1, C + 1, (n,))
        if layout == "class_strided":
            preds = _class_strided(preds)
        for top_ks in [(1,), (1, 3)]:
            run_and_compare(backend, preds, target, torch.rand(n) > 0.1, C=C, top_ks=top_ks, ignore_index=0)
    finally:
        torch.set_num_threads(threads)


def _adversarial_rows(n, C, dtype, g):
    """Rows that stress a threshold scan: ascending (every score a new best),
    descending, all equal, few distinct values (ties across blocks), the best
    scores in the last (partial) block, one NaN/+Inf/-Inf at the start, middle
    or last position, and plain random rows."""
    kinds = []
    base = torch.randn(n, C, generator=g, dtype=torch.float64)
    ar = torch.arange(C, dtype=torch.float64)
    for r in range(n):
        kind = r % 9
        if kind == 0:
            base[r] = ar
        elif kind == 1:
            base[r] = -ar
        elif kind == 2:
            base[r] = 1.5
        elif kind == 3:
            base[r] = torch.randint(0, 3, (C,), generator=g).double()
        elif kind == 4:
            base[r, -min(C, 7):] += 10.0
        elif kind in (5, 6, 7):
            pos = int(torch.randint(0, C, (1,), generator=g)) if kind == 6 else (0 if kind == 5 else C - 1)
            base[r, pos] = [float("nan"), float("inf"), float("-inf")][r % 3]
        kinds.append(kind)
    return base.to(dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("C", [2, 10, 17, 32, 33, 100, 1003])
def test_scores_adversarial_rows(backend, dtype, C):
    """Every row scan of the CPU kernel (all-pairs ranks up to 32 classes, the
    two-pass threshold scan above) on rows built to defeat it, several top_ks
    including a k above the 16 columns of the scan and the buffer limit 64."""
    if C > 100 and backend == "triton":
        pytest.skip("~17 s in the Triton interpreter; C = 100 covers its row loop")
    g = torch.Generator().manual_seed(C)
    n = 45
    preds = _adversarial_rows(n, C, dtype, g)
    target = torch.randint(0, C, (n,), generator=g)
    for top_ks in [(1,), (1, 5), (2, 16), (3, 17), (1, 64), (C,)]:
        top_ks = tuple(sorted({min(k, C) for k in top_ks}))
        run_and_compare(backend, preds, target, C=C, top_ks=top_ks, nll=True)
    # rows read near the end of a strided view and of the storage
    run_and_compare(backend, noncontig(preds)[-3:], target[-3:], C=C, top_ks=(1, min(5, C)))
    run_and_compare(backend, preds[-1:], target[-1:], C=C, top_ks=(1,))


def test_every_float16_value(backend):
    """All 65536 float16 bit patterns as scores (the CPU kernel converts half
    rows with its own vectorised formula): subnormals, +-0, Inf and NaN rows."""
    if backend == "triton":
        pytest.skip("the Triton interpreter is slow here; the bit patterns matter for the C++ conversion")
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    preds = bits.view(torch.float16)[torch.randperm(2**16)].reshape(-1, 64)
    finite = preds[torch.isfinite(preds).all(dim=1)]
    for p in (preds, finite, finite[:, :37]):
        C = p.shape[1]
        run_and_compare(backend, p, torch.randint(0, C, (p.shape[0],)), C=C, top_ks=(1, 5), nll=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("C", [7, 32, 100, 1003])
def test_masked_logits(backend, dtype, C):
    """-Inf is a masked logit (language models mask vocabulary that way): the
    row stays valid, the masked classes rank last (ties: lower index), the
    NLL equals torch's cross_entropy; a row of only -Inf is bad and a -Inf
    target score gives an infinite NLL."""
    if C > 100 and backend == "triton":
        pytest.skip("~17 s in the Triton interpreter; C = 100 covers its row loop")
    g = torch.Generator().manual_seed(C)
    n = 40
    logits = torch.randn(n, C, generator=g, dtype=torch.float64) * 3
    masked = torch.rand(n, C, generator=g) < torch.linspace(0.05, 0.97, n)[:, None]  # light to heavy masking
    target = torch.randint(0, C, (n,), generator=g)
    masked[torch.arange(n), target] = False  # the target itself is never masked here
    preds = logits.masked_fill(masked, float("-inf")).to(dtype)
    top_ks = tuple(sorted({1, min(5, C), min(17, C)}))
    got = run_and_compare(backend, preds, target, C=C, top_ks=top_ks, nll=True)
    assert got[3].tolist() == [0, 0] and got[2][0].item() == n  # no row is bad
    # independent references: cross_entropy for the NLL, argmax for top-1
    want_nll = torch.nn.functional.cross_entropy(preds.double(), target, reduction="sum")
    assert_nll_close(got[2], torch.stack([got[2][0], want_nll]), preds.dtype)
    hits = (preds.double().argmax(dim=1) == target).double().sum()
    assert got[0][0, 0].sum().item() == hits.item()
    # a row of only -Inf is bad and changes nothing else; masked ones rank last, in index order
    rows = torch.full((3, C), float("-inf"), dtype=dtype)
    rows[1, C // 2] = 0.0  # one live class: rank 0; the masked ones follow as 0, 1, 2, ...
    got = run_and_compare(backend, rows, torch.tensor([0, C - 1, 1]), C=C, top_ks=(1, min(3, C)), nll=True)
    assert got[3].tolist() == [0, 2] and got[2][0].item() == 1
    # a masked target: the row counts, its NLL is +Inf (cross_entropy agrees)
    preds2 = preds.clone()
    preds2[0, target[0]] = float("-inf")
    got = run_and_compare(backend, preds2, target, C=C, top_ks=(1,), nll=True)
    assert got[3].tolist() == [0, 0] and got[2][1].item() == float("inf")
    assert torch.nn.functional.cross_entropy(preds2.double(), target, reduction="sum").item() == float("inf")


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_small_rows_every_width(backend, dtype):
    """Every C of the all-pairs ranking (1..33: each count of vectors of the
    16- and 32-byte loops, and the step to the scan) on adversarial rows."""
    if backend == "triton":
        pytest.skip("one row loop in Triton; test_scores_adversarial_rows covers it")
    for C in range(1, 34):
        g = torch.Generator().manual_seed(C)
        preds = _adversarial_rows(27, C, dtype, g)
        target = torch.randint(0, C, (27,), generator=g)
        run_and_compare(backend, preds, target, C=C, top_ks=tuple(sorted({1, min(3, C), C})), nll=True)


@needs_cpp
@pytest.mark.parametrize(("capability", "select"), [
    ("default", "(cpp or hypothesis) and not compile and not lower_capability"),
    ("avx2", "cpp and (nll or adversarial or masked) and not compile and not lower_capability"),
])
def test_lower_capability_builds(capability, select):
    """The C++ kernel's narrower builds: on an AVX-512 machine the other tests
    take the 32-byte row loops and the 64-byte NLL exp, so the cpp tests of
    this file run again with ATEN_CPU_CAPABILITY=default (16-byte SSE2/NEON
    loops, scalar exp) and the NLL tests with ATEN_CPU_CAPABILITY=avx2 (the
    at::vec AVX2 exp): the variable turns them off for torch and us alike.
    (torch.compile's C++ codegen does not build under "default": its tests stay out.)"""
    if capability == "avx2" and torch.backends.cpu.get_cpu_capability() != "AVX512":
        pytest.skip("the AVX2 NLL is what the other tests already run here")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    probe = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                          timeout=120).stdout.strip() == capability.upper()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.abspath(__file__),
           "-k", select]
    r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("C", [1, 31, 32, 33, 1000])
def test_nll_alone_without_top_ks(backend, dtype, C):
    """top_ks=() with nll: only extras and bad (the Perplexity path), against the
    reference and float64 cross_entropy; -inf masked logits, NaN/+Inf and all -inf rows."""
    g = torch.Generator().manual_seed(C)
    n = 300
    logits = torch.randn(n, C, generator=g, dtype=torch.float64) * 4
    target = torch.randint(0, C, (n,), generator=g)
    if C > 1:
        masked = torch.rand(n, C, generator=g) < 0.3
        masked[torch.arange(n), target] = False
        logits = logits.masked_fill(masked, float("-inf"))
    preds = logits.to(dtype)
    target[::17] = -1  # ignored
    got = run_and_compare(backend, preds, target, C=C, top_ks=(), nll=True, ignore_index=-1, confmat=False)
    assert got[3].tolist() == [0, 0]
    keep = target != -1
    want = torch.nn.functional.cross_entropy(preds[keep].double(), target[keep], reduction="sum")
    assert_nll_close(got[2], torch.stack([got[2][0], want]), dtype)
    bad = preds.clone()
    bad[3, 0], bad[5, C - 1], bad[7] = float("nan"), float("inf"), float("-inf")
    got = run_and_compare(backend, bad, target, C=C, top_ks=(), nll=True, ignore_index=-1, confmat=False)
    assert got[3].tolist() == [0, 3]


def test_empty_top_ks_needs_nll_scores():
    C = 5
    with pytest.raises(ValueError, match="top_ks"):
        dk.ops.class_stats(torch.randn(4, C), torch.zeros(4, dtype=torch.int64), num_classes=C,
                           stats=f64(0, 3, C), extras=f64(2), bad=f64(2), top_ks=(), nll=False)
    with pytest.raises(ValueError, match="top_ks"):
        dk.ops.class_stats(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), num_classes=C,
                           stats=f64(0, 3, C), extras=f64(2), bad=f64(2), top_ks=(), nll=True)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("C", [2, 5, 21, 33, 150])
def test_class_strided_scores_read_in_place(backend, dtype, C):
    """Scores whose classes are not adjacent (channel-first inputs): the CPU
    kernel stages L1 tiles of rows; counts equal the reference and the same
    rows given contiguous (the NLL sum to rounding: tiles group its partial sums)."""
    if C > 33 and backend == "triton":
        pytest.skip("~8 s in the Triton interpreter; C <= 33 covers its strided loads")
    g = torch.Generator().manual_seed(C)
    n = 2000 + C  # several tiles, the last one partial
    x = _adversarial_rows(n, C, dtype, g)
    target = torch.randint(-1, C + 1, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.1
    for top_ks, nll in [((1,), False), ((1, min(3, C)), True)]:
        strided = run_and_compare(backend, _class_strided(x), target, mask, C=C, top_ks=top_ks, nll=nll,
                                  ignore_index=0)
        contiguous = run_and_compare(backend, x, target, mask, C=C, top_ks=top_ks, nll=nll, ignore_index=0)
        for a, b, what in zip(strided, contiguous, ("stats", "confmat", "extras", "bad")):
            if what == "extras":
                assert_counts_equal(a[:1], b[:1], "valid rows, strided vs contiguous")
                assert_sums_close(a[1:], b[1:], "nll, strided vs contiguous", rtol=1e-12)
            else:
                assert_counts_equal(a, b, f"{what}, strided vs contiguous")
    # a channel-first batch's sample: [C, H, W] -> [H*W, C] view, strides (1, H*W)
    batch = torch.randn(2, C, 9, 13, generator=g).to(dtype)
    sample = batch[1].movedim(0, -1).reshape(-1, C)
    assert sample.data_ptr() == batch[1].data_ptr() and sample.stride(1) == 9 * 13
    run_and_compare(backend, sample, torch.randint(0, C, (9 * 13,), generator=g), C=C)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("C", "top_ks"), [(5, (1, 3)), (21, (1,)), (33, (1, 5, 33)), (150, (1, 5))])
def test_cuda_thread_rows_and_class_strided_in_place(dtype, C, top_ks):
    """scores_thread_kernel (a thread per row: <= 32 classes, and class-strided
    rows of any length) against the reference, adversarial rows included; the
    class-strided sample of a channel-first batch allocates nothing."""
    g = torch.Generator().manual_seed(C)
    n = 3000 + C
    x = _adversarial_rows(n, C, dtype, g)
    target = torch.randint(-1, C + 1, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.1
    for p in (x, _class_strided(x)):
        want = [f64(len(top_ks), 3, C), f64(C, C), f64(2), f64(2)]
        reference.class_stats(p, target, mask, C, 0, list(top_ks), True, *want)
        got = [t.cuda() for t in (f64(len(top_ks), 3, C), f64(C, C), f64(2), f64(2))]
        dk.ops.class_stats(p.cuda(), target.cuda(), mask.cuda(), num_classes=C, stats=got[0], confmat=got[1],
                           extras=got[2], bad=got[3], ignore_index=0, top_ks=top_ks, nll=True, backend="cuda")
        got = [t.cpu() for t in got]
        for a, b, what in zip(got[:2] + [got[2][:1], got[3]], want[:2] + [want[2][:1], want[3]], ["stats", "confmat", "rows", "bad"]):
            assert_counts_equal(a, b, what)
        assert_sums_close(got[2][1:], want[2][1:], "nll", rtol=1e-6)
    batch = torch.randn(2, C, 64, 96, device="cuda").to(dtype)
    sample = batch[1].movedim(0, -1).reshape(-1, C)
    assert sample.data_ptr() == batch[1].data_ptr()
    st, cm, ex, bad = (t.cuda() for t in (f64(1, 3, C), f64(C, C), f64(2), f64(2)))
    t = torch.randint(0, C, (64 * 96,), device="cuda")
    gc.collect()  # a collection during the call frees earlier tensors and moves memory_allocated
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.ops.d9d_kernels.class_stats.default(sample, t, None, C, None, [1], True, st, cm, ex, bad)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before


@needs_cpp
def test_class_strided_scores_make_no_copy():
    """The CPU op allocates no tensor for class-strided scores (the tile is a
    small private buffer, not a copy of the input)."""
    from torch.profiler import ProfilerActivity, profile

    C, n = 21, 1 << 16
    x = _class_strided(torch.randn(n, C))
    target = torch.randint(0, C, (n,))
    st, cm, ex, bad = f64(1, 3, C), f64(C, C), f64(2), f64(2)
    op = torch.ops.d9d_kernels.class_stats.default
    op(x, target, None, C, None, [1], False, st, cm, ex, bad)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        op(x, target, None, C, None, [1], False, st, cm, ex, bad)
    allocated = [e.self_cpu_memory_usage for e in prof.events() if e.self_cpu_memory_usage > 0]
    assert allocated == [], allocated


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("n", "C", "top_ks"), [(64, 128256, (1, 5, 10)), (3, 50257, (1, 5, 10)), (45, 4097, (1, 5)),
                                                 (45, 4096, (1, 5, 10)), (90, 1000, (1, 32)), (18, 50257, (1,))])
def test_cuda_vocabulary_rows_match_reference(dtype, n, C, top_ks):
    """The one-pass warp and block kernels (threshold-gated top-k, shared across
    the block) on vocabulary rows: ascending / descending / constant rows, ties
    across threads and vectors, the best scores in the tail, NaN / +Inf / -Inf
    at the edges, -Inf masks, and misaligned rows (x[:, 1:]: scalar head and tail)."""
    if "cuda" not in dk.ops.backends():
        pytest.skip("no CUDA kernels")
    g = torch.Generator().manual_seed(C + n)
    x = _adversarial_rows(n, C + 1, torch.float64, g)
    x[n // 2:] = torch.randint(0, 8, (n - n // 2, C + 1), generator=g).double()  # heavy ties
    x[1::4] = x[1::4].masked_fill(torch.rand(x[1::4].shape, generator=g) < 0.7, float("-inf"))
    x[-1, -2:] = float("nan")  # NaN in the last column of both views below
    x = x.to(dtype)
    target = torch.randint(-1, C + 1, (n,), generator=g)
    target[::5] = x[::5, :C].float().nan_to_num(nan=-1.0, posinf=-1.0).argmax(1)  # hits at rank 0
    mask = torch.rand(n, generator=g) > 0.1
    mask[-1] = True
    target[-1] = 0  # kept, in range: the NaN row counts as bad scores
    cm = (lambda: f64(C, C)) if C <= 4097 else (lambda: None)  # a vocabulary's confusion matrix would not fit
    for p in (x[:, :C], x[:, 1:]):
        want = [f64(len(top_ks), 3, C), cm(), f64(2), f64(2)]
        reference.class_stats(p, target, mask, C, -1, list(top_ks), True, *want)
        got = [None if t is None else t.cuda() for t in (f64(len(top_ks), 3, C), cm(), f64(2), f64(2))]
        dk.ops.class_stats(p.cuda(), target.cuda(), mask.cuda(), num_classes=C, stats=got[0], confmat=got[1],
                           extras=got[2], bad=got[3], ignore_index=-1, top_ks=top_ks, nll=True, backend="cuda")
        where = "aligned" if p.data_ptr() == x.data_ptr() else "misaligned"
        for a, b, what in zip(got, want, ["stats", "confmat", "extras", "bad"]):
            if b is None:
                continue
            a = a.cpu()
            if what == "extras":
                assert_counts_equal(a[:1], b[:1], f"rows ({where})")
                assert_sums_close(a[1:], b[1:], f"nll ({where})", rtol=1e-6)
            else:
                assert_counts_equal(a, b, f"{what} ({where})")
        assert want[3][1] > 0 and want[2][0] > 0  # bad score rows and valid rows both occur
