"""Triton backend: each launcher vs d9d_kernels.reference, op registration, routing.

Runs on CPU tensors through TRITON_INTERPRET=1 (set by conftest.py before any
`import triton`); inputs are kept small because every program instance costs
milliseconds in the interpreter. The per-op files (test_<op>.py) also run the
triton backend through the `backend` fixture; this file adds the adversarial
cases specific to the Triton tiling (tile edges, ties across column tiles,
pivots, input-kind inference) and the torch.library / dispatch plumbing.
"""

from __future__ import annotations

import importlib
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
from op_utils import FLOAT_DTYPES, assert_counts_equal, assert_sums_close, f64, noncontig, sprinkle

import d9d_kernels as dk
from d9d_kernels import reference

pytestmark = [
    pytest.mark.skipif(
        not dk._extension.triton_usable(torch.device("cpu")), reason="triton not installed or TRITON_INTERPRET unset"
    ),
    # numpy warns when the interpreter computes NaN/Inf lanes that are masked out afterwards
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
OPS = dk.ops.OPS
NAN, INF = float("nan"), float("inf")


def tr(op: str):
    """The Triton launcher of `op` (same positional arguments as the reference)."""
    return getattr(importlib.import_module(f"d9d_kernels.triton.{op}"), op)


def both(op: str, args: tuple, states: list, sums: tuple[int, ...] = (), atol: float | None = None):
    """Runs the reference and the Triton launcher on copies of `states`; compares them.

    Counts must match exactly; the state tensors whose position is in `sums`
    hold float sums and must match to float64 rounding, or within `atol`
    where the kernel sums float32 terms by design (class_stats' NLL).
    """
    want = [None if s is None else s.clone() for s in states]
    got = [None if s is None else s.clone() for s in states]
    getattr(reference, op)(*args, *want)
    tr(op)(*args, *got)
    for i, (g, w) in enumerate(zip(got, want)):
        if w is None:
            continue
        if i in sums and atol is not None:
            torch.testing.assert_close(g, w, rtol=0, atol=atol, equal_nan=True, msg=lambda m: f"{op} state {i}: {m}")
        elif i in sums:
            assert_sums_close(g, w, f"{op} state {i}", rtol=1e-11)
        else:
            assert_counts_equal(g, w, f"{op} state {i}")
    return got


# ---- weighted_moments ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [0, 1, 5, 123, 20_000])
def test_weighted_moments_vs_reference(dtype, n):
    x = sprinkle(torch.randn(n) * 3 + 1000).to(dtype)
    y = sprinkle(torch.randn(n)).to(dtype)
    w = sprinkle(torch.rand(n), values=(NAN, INF, 0.0)).to(dtype)
    mask = torch.rand(n) > 0.3
    for skip_bad in (False, True):
        for args in [(x, None, None, None), (x, y, w, mask), (x, y, None, None), (x, None, w, mask)]:
            # pivot unset (NaN), no pivot, and a non-zero start state
            both("weighted_moments", (*args, skip_bad), [f64(9), f64(1), f64(2, fill=NAN)], sums=(0, 2))
            both("weighted_moments", (*args, skip_bad), [f64(9, fill=1.5), f64(1, fill=2.0), None], sums=(0,))


def test_weighted_moments_pivots():
    x = torch.tensor([NAN, 5.0, 7.0, 9.0], dtype=torch.float64)
    y = torch.tensor([1.0, INF, 3.0, 4.0], dtype=torch.float64)
    mask = torch.tensor([True, True, True, False])
    # first good element is index 2 (0 has NaN x, 1 has Inf y)
    got = both("weighted_moments", (x, y, None, mask, True), [f64(9), f64(1), f64(2, fill=NAN)], sums=(0,))
    assert got[2].tolist() == [7.0, 3.0]
    assert got[1].item() == 2.0
    # a set pivot stays; an unset one is set independently
    got = both("weighted_moments", (x, y, None, mask, True), [f64(9), f64(1), torch.tensor([1.0, NAN], dtype=torch.float64)], sums=(0,))
    assert got[2].tolist() == [1.0, 3.0]
    # no good element: the pivot stays unset, sums are about 0
    got = both("weighted_moments", (x[:2], y[:2], None, None, False), [f64(9), f64(1), f64(2, fill=NAN)], sums=(0,))
    assert torch.isnan(got[2]).all() and torch.isnan(got[0][1])
    # the good element sits in a later program (index > one block of the interpreter)
    big = torch.full((20_000,), NAN)
    big[17_777] = 2.5
    got = both("weighted_moments", (big, None, None, None, True), [f64(9), f64(1), f64(2, fill=NAN)], sums=(0,))
    assert got[2][0].item() == 2.5 and torch.isnan(got[2][1])


# ---- running_extrema ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [0, 1, 123, 20_000])
def test_running_extrema_vs_reference(dtype, n):
    x = sprinkle(torch.randn(n) * 100).to(dtype)
    mask = torch.rand(n) > 0.5
    for skip_bad in (False, True):
        for m in (None, mask):
            for init in ([-INF, -INF], [NAN, 0.0], [1e9, 1e9]):
                both("running_extrema", (x, m, skip_bad), [torch.tensor(init, dtype=torch.float64), f64(1)])


def test_running_extrema_nan_propagation():
    x = torch.tensor([1.0, NAN, -INF, 3.0])
    got = both("running_extrema", (x, None, False), [f64(2, fill=-INF), f64(1)])
    assert torch.isnan(got[0]).all() and got[1].item() == 2.0
    got = both("running_extrema", (x, None, True), [f64(2, fill=-INF), f64(1)])
    assert got[0].tolist() == [3.0, INF]
    # a masked-out NaN changes nothing
    got = both("running_extrema", (x, torch.tensor([True, False, False, True]), False), [f64(2, fill=-INF), f64(1)])
    assert got[0].tolist() == [3.0, -1.0] and got[1].item() == 0.0


# ---- binary_stats / score_histogram ---------------------------------------------------------


def _binary_inputs(n, L, dtype, scale):
    p = (torch.rand(n, L) * scale - (scale - 1) / 2).to(dtype)
    t = torch.randint(0, 2, (n, L))
    if n >= 4:
        p[0, 0], p[1, 0] = NAN, INF
        t[2, 0], t[3, 0] = 2, -1
    return p, t, torch.rand(n, L) > 0.2


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(("n", "L"), [(0, 3), (1, 1), (5, 123), (300, 1), (40, 7)])
def test_binary_stats_vs_reference(dtype, n, L):
    for scale in (1.0, 6.0):  # probabilities / logits (INPUT_AUTO picks)
        p, t, mask = _binary_inputs(n, L, dtype, scale)
        for kind in (reference.INPUT_PROBS, reference.INPUT_LOGITS, reference.INPUT_AUTO):
            for ignore, m in ((None, None), (-1, mask)):
                both("binary_stats", (p, t, m, 0.5, ignore, kind), [f64(L, 4), f64(2)])
                both("binary_stats", (p, t, m, 0.3, ignore, kind), [f64(L, 4, fill=1.0), f64(2)])


def test_binary_stats_threshold_is_float64():
    # 0.3 + 1e-12 > 0.3 only if the threshold is not rounded to float32 (0.30000001192...)
    p = torch.tensor([[0.3 + 1e-12], [0.3], [0.3000001]], dtype=torch.float64)
    t = torch.tensor([[1], [1], [0]])
    got = both("binary_stats", (p, t, None, 0.3, None, reference.INPUT_PROBS), [f64(1, 4), f64(2)])
    assert got[0].tolist() == [[1.0, 1.0, 0.0, 1.0]]
    # logit 0 -> sigmoid 0.5, which is not > 0.5; integer preds are probabilities
    both("binary_stats", (torch.zeros(2, 1), torch.tensor([[0], [1]]), None, 0.5, None, reference.INPUT_LOGITS), [f64(1, 4), f64(2)])
    both("binary_stats", (torch.tensor([[0], [1], [2]]), torch.tensor([[0], [1], [1]]), None, 0.5, None, reference.INPUT_AUTO), [f64(1, 4), f64(2)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "L", "B"), [(0, 2, 10), (1, 1, 10), (5, 123, 10), (200, 3, 10), (20_000, 1, 10),
                                           (20_000, 2, 1000)])
def test_score_histogram_binary_vs_reference(dtype, n, L, B):
    """2 * L * B <= HIST_BINS: per-program histograms (n = 20000: over several row
    tiles); L = 123 and B = 1000 at L = 2: an atomic per entry."""
    for scale in (1.0, 6.0):
        p, t, mask = _binary_inputs(n, L, dtype, scale)
        for kind in (reference.INPUT_PROBS, reference.INPUT_LOGITS, reference.INPUT_AUTO):
            for ignore, m in ((None, None), (-1, mask)):
                both("score_histogram", (p, t, m, ignore, kind, False), [f64(2, L, B), f64(2)])


@pytest.mark.parametrize(("n", "C", "dtype"), [(0, 3, torch.float32), (1, 1, torch.float32), (5, 123, torch.float16),
                                               (64, 700, torch.float32), (100, 4, torch.float64)])
def test_score_histogram_multiclass_vs_reference(n, C, dtype):
    for softmaxed in (True, False):
        s = torch.randn(n, C) * 3
        p = (torch.softmax(s, 1) if softmaxed else s).to(dtype)
        t = torch.randint(0, C, (n,))
        if n >= 4:
            t[0], t[1] = C, -1  # out of range: bad
            p[2, C - 1] = NAN
        mask = torch.rand(n) > 0.2
        for kind in (reference.INPUT_PROBS, reference.INPUT_LOGITS, reference.INPUT_AUTO):
            for ignore, m in ((None, None), (-1, mask)):
                both("score_histogram", (p, t, m, ignore, kind, True), [f64(2, C, 7), f64(2)])


def test_score_histogram_bin_edges():
    # bin = clamp(floor(p * B), 0, B - 1): 1.0 -> last bin; 0.5 -> bin 5 of 10; out of [0,1] clamps (PROBS)
    p = torch.tensor([[0.0], [0.5], [1.0], [0.0999999], [1.7], [-3.0], [1e300]], dtype=torch.float64)
    t = torch.ones(7, 1, dtype=torch.int64)
    got = both("score_histogram", (p, t, None, None, reference.INPUT_PROBS, False), [f64(2, 1, 10), f64(2)])
    assert got[0][0, 0].tolist() == [3.0, 0, 0, 0, 0, 1.0, 0, 0, 0, 3.0]


# ---- class_stats --------------------------------------------------------------------------


def nll_atol(scores: torch.Tensor) -> float | None:
    """Summed-NLL tolerance: <= 32-bit scores sum exp2 terms in float32 per tile,
    within 1e-6 per row (perplexity within 1e-6 relative); float64 stays exact."""
    return None if scores.dtype == torch.float64 else 1e-6 * max(scores.shape[0], 1)


def _class_states(K, C, confmat=True):
    return [f64(K, 3, C), f64(C, C) if confmat else None, f64(2), f64(2)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(("n", "C"), [(0, 3), (1, 1), (5, 123), (64, 4), (16, 1100)])
def test_class_stats_scores_vs_reference(dtype, n, C):
    s = torch.randn(n, C)
    if C >= 4:
        s[:, :4] = torch.randint(0, 2, (n, 4)).float()  # many ties
    s = sprinkle(s, frac=0.002).to(dtype)
    t = torch.randint(0, C, (n,))
    if n >= 3:
        t[0], t[1], t[2] = C, -1, -100
    mask = torch.rand(n) > 0.2
    ks = sorted({1, min(2, C), min(5, C)})
    for ignore, m in ((None, None), (-100, mask)):
        both("class_stats", (s, t, m, C, ignore, ks, True), _class_states(len(ks), C), sums=(2,), atol=nll_atol(s))
        both("class_stats", (s, t, m, C, ignore, [1], False), _class_states(1, C, confmat=False))


def test_class_stats_ties_across_column_tiles():
    # C spans several BLOCK_C tiles: equal maxima in different tiles go to the lowest index
    C = 1100
    s = torch.zeros(6, C)
    s[1, 600] = s[1, 1000] = 10.0
    s[2, 1099] = 1.0
    s[3, 5] = s[3, 700] = s[3, 1050] = -0.5  # all other entries (0) rank ahead
    s[4] = torch.randint(0, 3, (C,)).float()
    s[5, 3:] = -1.0
    t = torch.tensor([4, 1000, 1099, 700, 0, 2])
    got = both("class_stats", (s, t, None, C, None, [1, 3, 7], True), _class_states(3, C), sums=(2,), atol=nll_atol(s))
    argmax = got[1].argmax(1)  # confmat rows: target -> argmax
    assert argmax[1000].item() == 600 and argmax[1099].item() == 1099 and argmax[4].item() == 0
    # row 0 (all zeros): top-3 are classes 0, 1, 2, so target 4 is not a hit; 7 includes it
    assert got[0][1, 0, 4].item() == 0.0 and got[0][2, 0, 4].item() == 1.0


@pytest.mark.parametrize(("n", "C"), [(0, 9), (1, 9), (123, 9), (20_000, 9), (20_000, 40), (20_000, 1500)])
def test_class_stats_indices_vs_reference(n, C):
    """Index preds: per-program histograms (C = 9: counts and confusion matrix;
    C = 40: counts, the confusion matrix by atomics) and atomics alone (C = 1500),
    over several grid-stride tiles at n = 20000."""
    p = torch.randint(-1, C + 1, (n,))
    t = torch.randint(-1, C + 1, (n,))
    mask = torch.rand(n) > 0.3
    for ignore, m in ((None, None), (3, mask)):
        both("class_stats", (p, t, m, C, ignore, [1], False), _class_states(1, C))


def test_class_stats_noncontiguous_scores():
    s = noncontig(torch.randn(30, 12))
    t = torch.randint(0, 12, (30,))
    both("class_stats", (s, t, None, 12, None, [1, 4], True), _class_states(2, 12), sums=(2,), atol=nll_atol(s))


@pytest.mark.parametrize("ks,nll", [((1,), False), ((1, 3), True)])
def test_class_stats_class_strided_scores_read_in_place(ks, nll, monkeypatch):
    """A channel-first sample [C, H, W] seen as [H*W, C] (strides (1, H*W)),
    the way the metrics pass segmentation batches: equal to the reference,
    with NaN / all -Inf rows, and without a contiguous copy of the scores."""
    C, H, W = 7, 6, 9
    x = torch.randn(C, H, W)
    x[2, 1, 3] = float("nan")
    x[:, 4, 4] = float("-inf")
    s = x.reshape(C, H * W).t()  # [H*W, C], class stride H*W
    assert s.stride() == (1, H * W)
    t = torch.randint(-1, C, (H * W,))
    both("class_stats", (s, t, None, C, -1, list(ks), nll), _class_states(len(ks), C), sums=(2,), atol=nll_atol(s))
    # the launcher makes no contiguous copy of the scores (the interpreter's own
    # host copies of every argument hide that from a profiler)
    made = []
    contiguous = torch.Tensor.contiguous

    def recording(self, *a, **k):
        if self.data_ptr() == s.data_ptr() and not self.is_contiguous():
            made.append(tuple(self.shape))
        return contiguous(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "contiguous", recording)
    tr("class_stats")(s, t, None, C, -1, list(ks), nll, *_class_states(len(ks), C))
    assert not made, made


# ---- bad counts by cause (class_stats, binary_stats, score_histogram) ----------------------


def _bad_rows(C: int, rows: list, reps: int):
    """Scores [n, C], targets [n] and mask [n] from (target, scores or None for a
    valid row, kept by mask) triples, repeated `reps` times so that the counts
    span several programs."""
    g = torch.Generator().manual_seed(3)
    s, t, m = [], [], []
    for _ in range(reps):
        for tgt, row, kept in rows:
            s.append(torch.rand(C, generator=g) if row is None else torch.tensor(row, dtype=torch.float32))
            t.append(tgt)
            m.append(kept)
    return torch.stack(s), torch.tensor(t), torch.tensor(m)


def test_bad_split_by_cause():
    """bad[0] counts kept entries with a bad target (whatever their preds hold), bad[1]
    kept entries with a good target and a bad pred; ignored / masked entries count nowhere."""
    reps = 300
    C = 4
    finite = [0.1, 0.2, 0.3, 0.4]
    rows = [
        (C, [NAN, 0.1, 0.2, 0.3], True),  # bad target and NaN score: target
        (-1, [0.1, INF, 0.2, 0.3], True),  # bad target and +Inf: target
        (C + 3, finite, True),  # bad target only
        (1, [0.1, NAN, 0.2, 0.3], True),  # NaN only: pred
        (2, [0.1, 0.2, INF, 0.3], True),  # +Inf only: pred
        (0, [-INF] * C, True),  # all -Inf only: pred (class_stats); -Inf: pred (score_histogram)
        (3, [-INF, 0.5, -INF, 0.2], True),  # -Inf as a masked logit: valid for class_stats
        (-100, [NAN, NAN, NAN, NAN], True),  # ignored
        (C, [NAN, 0.1, 0.2, 0.3], False),  # masked: bad target and NaN
        (2, [0.1, 0.2, INF, 0.3], False),  # masked: +Inf
        (1, None, True),
        (0, None, True),
    ]
    s, t, m = _bad_rows(C, rows, reps)

    # class_stats, scores: row 6 is valid (-Inf is a masked logit)
    got = both("class_stats", (s, t, m, C, -100, [1, 2], True), _class_states(2, C), sums=(2,), atol=nll_atol(s))
    assert got[3].tolist() == [3.0 * reps, 3.0 * reps]
    got = both("class_stats", (s, t, m, C, -100, [1], False), _class_states(1, C, confmat=False))
    assert got[3].tolist() == [3.0 * reps, 3.0 * reps]
    # nothing dropped: rows 7 (target -100) and 8 count as bad targets, row 9 as a bad pred
    got = both("class_stats", (s, t, None, C, None, [1], False), _class_states(1, C))
    assert got[3].tolist() == [5.0 * reps, 4.0 * reps]

    # class_stats, index preds: an out-of-range index pred is a label mistake (bad[0])
    p = torch.tensor([C, -1, 0, 2, 1, 0, 3, 9, C, 2, 1, 0]).repeat(reps)
    p[2::12] = 1  # bad target, good pred
    p[3::12] = -1  # good target, bad pred
    got = both("class_stats", (p, t, m, C, -100, [1], False), _class_states(1, C))
    assert got[3].tolist() == [4.0 * reps, 0.0]

    # score_histogram, multiclass: -Inf is not finite, so row 6 is bad (pred) there
    for kind in (reference.INPUT_PROBS, reference.INPUT_LOGITS, reference.INPUT_AUTO):
        got = both("score_histogram", (s, t, m, -100, kind, True), [f64(2, C, 5), f64(2)])
        assert got[1].tolist() == [3.0 * reps, 4.0 * reps]

    # binary_stats / score_histogram, binary: entries of an [n, 3] batch
    L = 3
    pb = s[:, :L].clone()
    tb = torch.randint(0, 2, (s.shape[0], L), generator=torch.Generator().manual_seed(4))
    mb = m[:, None].expand(-1, L).clone()
    tb[0::12, 0] = 2  # with a NaN pred: target
    tb[1::12, 1] = -1  # with a +Inf pred: target
    tb[2::12, :] = 5  # bad targets only (3 entries)
    tb[7::12, :] = -100  # ignored (NaN preds)
    tb[8::12, 0] = 7  # masked: bad target and NaN
    mb[4::12, 1] = False  # masks a good row's entry
    pb[4::12, 1] = NAN
    # pred-caused: row 3 (NaN at 1), row 4 (+Inf at 2), row 5 (3 x -Inf), row 6 (-Inf at 0, 2)
    want = [5.0 * reps, 7.0 * reps]
    for kind in (reference.INPUT_PROBS, reference.INPUT_LOGITS, reference.INPUT_AUTO):
        got = both("binary_stats", (pb, tb, mb, 0.5, -100, kind), [f64(L, 4), f64(2)])
        assert got[1].tolist() == want
        got = both("score_histogram", (pb, tb, mb, -100, kind, False), [f64(2, L, 6), f64(2)])
        assert got[1].tolist() == want


# ---- registration, fake tensors, torch.compile, routing -------------------------------------


MUTATED = {
    "weighted_moments": {"state", "bad", "pivot"},
    "class_stats": {"stats", "confmat", "extras", "bad"},
    "binary_stats": {"state", "bad"},
    "score_histogram": {"hist", "bad"},
    "running_extrema": {"state", "bad"},
    "expert_histogram": {"load", "gate", "bad"},
}


@pytest.mark.parametrize("op", OPS)
def test_registered_as_mutating_torch_op(op):
    tr(op)  # importing registers it
    schema = getattr(torch.ops.d9d_kernels, f"{op}_triton").default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == MUTATED[op] and len(schema.returns) == 0, str(schema)
    # same positional arguments as the reference
    ref_args = list(inspect.signature(getattr(reference, op)).parameters)
    assert [a.name for a in schema.arguments] == ref_args


def _opcheck_args(op):
    x, p2, t2, s, t = _all_ops_args()[:5]
    return {
        "weighted_moments": (x, x * 2, x.abs(), x > 0, False, f64(9), f64(1), f64(2, fill=NAN)),
        "running_extrema": (x, None, False, f64(2, fill=-INF), f64(1)),
        "class_stats": (s, t, None, 6, None, [1, 2], True, f64(2, 3, 6), f64(6, 6), f64(2), f64(2)),
        "binary_stats": (p2, t2, None, 0.5, None, reference.INPUT_AUTO, f64(3, 4), f64(2)),
        "score_histogram": (p2, t2, None, None, reference.INPUT_AUTO, False, f64(2, 3, 8), f64(2)),
        "expert_histogram": (t.reshape(2, 10), [1, 0], s.softmax(-1).reshape(2, 10, 6), f64(2, 6), f64(2, 7), f64(1)),
    }[op]


@pytest.mark.parametrize("op", OPS)
def test_opcheck(op):
    """The declared mutations are the real ones; fake impl and autograd registration are sound."""
    tr(op)
    result = torch.library.opcheck(
        getattr(torch.ops.d9d_kernels, f"{op}_triton"), _opcheck_args(op),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    assert set(result.values()) == {"SUCCESS"}, result


def _all_ops(x, p2, t2, s, t, state):
    """One call of every op through dk.ops with backend="triton"."""
    w, ex, cs, bs, h, b1, b2, eh = state
    dk.ops.weighted_moments(x, x * 2, state=w, bad=b1, pivot=ex[:2], backend="triton")
    dk.ops.running_extrema(x, state=ex[2:], bad=b1, backend="triton")
    dk.ops.class_stats(s, t, num_classes=s.shape[1], stats=cs[0], extras=cs[1], bad=b2, top_ks=(1, 2), nll=True, backend="triton")
    dk.ops.binary_stats(p2, t2, state=bs, bad=b2, backend="triton")
    dk.ops.score_histogram(p2, t2, hist=h, bad=b2, backend="triton")
    # routing of 2 layers (t holds 0..5: 5 is out of range for E = 5); gate values exact under compile (abs)
    dk.ops.expert_histogram(t.reshape(2, 10), [1, 0], s[:, :5].abs().reshape(2, 10, 5), load=eh[0], gate=eh[1],
                            bad=eh[2], backend="triton")


def _all_ops_args():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50, generator=g)
    p2, t2 = torch.rand(40, 3, generator=g), torch.randint(0, 2, (40, 3), generator=g)
    s, t = torch.randn(20, 6, generator=g), torch.randint(0, 6, (20,), generator=g)
    ex = torch.cat([f64(2, fill=NAN), f64(2, fill=-INF)])
    # bad: [1] for the one-cause ops, [2] (target, pred) for the others
    state = (f64(9), ex, (f64(2, 3, 6), f64(2)), f64(3, 4), f64(2, 3, 8), f64(1), f64(2), (f64(2, 5), f64(2, 6), f64(1)))
    return (x, p2, t2, s, t, state)


def _flat(state):
    out = []
    for s in state:
        out.extend(s if isinstance(s, tuple) else [s])
    return out


def test_fake_tensor_mode_runs_every_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in _all_ops_args()[:5]]
        state = tuple(
            tuple(mode.from_tensor(t) for t in s) if isinstance(s, tuple) else mode.from_tensor(s) for s in _all_ops_args()[5]
        )
        _all_ops(*args, state)  # must not launch anything nor raise
    assert all(isinstance(s, torch._subclasses.FakeTensor) for s in _flat(state))


def test_torch_compile_fullgraph_matches_eager():
    torch._dynamo.reset()
    eager, compiled = _all_ops_args(), _all_ops_args()
    _all_ops(*eager)
    torch.compile(_all_ops, fullgraph=True)(*compiled)
    for a, b in zip(_flat(eager[5]), _flat(compiled[5])):
        assert_sums_close(b, a, "compiled vs eager", rtol=1e-12)
    assert _flat(eager[5])[0][0].item() == 50.0  # something was computed


def test_env_backend_routes_cpu_tensors_to_triton(monkeypatch):
    """D9D_KERNELS_BACKEND=triton on CPU tensors runs the Triton launchers (reference never called)."""
    monkeypatch.setenv("D9D_KERNELS_BACKEND", "triton")
    calls = []
    for op in OPS:
        mod = importlib.import_module(f"d9d_kernels.triton.{op}")
        real = getattr(mod, op)

        def spy(*args, _real=real, _op=op):
            calls.append(_op)
            return _real(*args)

        monkeypatch.setattr(mod, op, spy)

        def boom(*args, _op=op):
            raise AssertionError(f"reference.{_op} called although the triton backend was forced")

        monkeypatch.setattr(reference, op, boom)
    args = _all_ops_args()
    w, ex, cs, bs, h, b1, b2, eh = args[5]
    x, p2, t2, s, t = args[:5]
    dk.ops.weighted_moments(x, state=w, bad=b1)
    dk.ops.running_extrema(x, state=ex[2:], bad=b1)
    dk.ops.class_stats(s, t, num_classes=6, stats=cs[0], extras=cs[1], bad=b2, top_ks=(1, 2))
    dk.ops.binary_stats(p2, t2, state=bs, bad=b2)
    dk.ops.score_histogram(p2, t2, hist=h, bad=b2)
    dk.ops.expert_histogram(t.reshape(2, 10), load=eh[0], bad=eh[2])
    assert sorted(calls) == sorted(OPS)
    monkeypatch.undo()
    # and the results are the reference's
    want = f64(9)
    reference.weighted_moments(x, None, None, None, False, want, f64(1))
    assert_sums_close(w, want, "weighted_moments via env backend")
    assert cs[0][0, 2].sum().item() == 20.0 and bs.sum().item() == 120.0


def test_triton_backend_listed_and_forced_backend_checked(monkeypatch):
    assert "triton" in dk.ops.backends()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="triton"):
        dk.ops.running_extrema(torch.ones(3), state=f64(2, fill=-INF), bad=f64(1), backend="triton")


# ---- compiled Triton (not the interpreter) ---------------------------------------------------
# conftest.py sets TRITON_INTERPRET=1 for the whole session, so these run in a subprocess.


def _compile_all_for_cuda() -> None:
    """Compiles every kernel to a cubin for sm_90 (no GPU needed): catches what the
    interpreter lets through (loop-carried types, constexpr misuse, dtype mixes)."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from d9d_kernels.triton import _common, binary_stats, class_stats, running_extrema, score_histogram
    from d9d_kernels.triton import weighted_moments as wm

    assert not _common.INTERPRETED

    def cc(kernel, consts, ptrs):
        sig = {}
        for name in inspect.signature(kernel.fn).parameters:
            sig[name] = "constexpr" if name in consts else ptrs.get(name, "*fp64" if name.endswith("_ptr") else "i32")
        triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))

    on = dict(HAS_M=True, HAS_IGNORE=True)
    B = _common.BLOCK
    xs = {"x_ptr": "*bf16", "y_ptr": "*fp32", "w_ptr": "*fp16", "m_ptr": "*u8", "first_ptr": "*i64"}
    cc(wm._first_good_kernel, dict(HAS_Y=True, HAS_W=True, HAS_M=True, BLOCK=B), xs)
    cc(wm._moments_kernel, dict(SKIP_BAD=True, HAS_Y=True, HAS_W=True, HAS_M=True, HAS_PIVOT=True, BLOCK=B), xs)
    cc(wm._moments_kernel, dict(SKIP_BAD=False, HAS_Y=False, HAS_W=False, HAS_M=False, HAS_PIVOT=False, BLOCK=B), xs)
    cc(wm._set_pivot_kernel, dict(HAS_Y=True), xs)
    cc(running_extrema._partial_kernel, dict(SKIP_BAD=True, HAS_M=True, BLOCK=B), {"x_ptr": "*fp16", "m_ptr": "*u8"})
    cc(running_extrema._combine_kernel, dict(BLOCK_P=_common.pow2(_common.MAX_PROGRAMS)), {})
    from d9d_kernels.triton import expert_histogram as eh

    for nb, ity in ((0, "*i32"), (128, "*i64")):
        cc(eh._load_kernel, dict(NB=nb, BLOCK=B), {"idx_ptr": ity, "lay_ptr": "*i64"})
    cc(eh._gate_kernel, dict(BLOCK_T=16, BLOCK_E=128), {"p_ptr": "*bf16", "lay_ptr": "*i64"})
    ps = {"p_ptr": "*fp32", "t_ptr": "*i64", "m_ptr": "*u8", "flag_ptr": "*i32", "ks_ptr": "*i64", "thr_bits": "i64"}
    for L in (1, 100):
        bn, bl = binary_stats.tile_2d(L)
        cc(binary_stats.outside_kernel, dict(BLOCK_N=bn, BLOCK_L=bl, **on), ps)
        cc(binary_stats._binary_stats_kernel, dict(KIND=2, BLOCK_N=bn, BLOCK_L=bl, **on), ps)
        for nb in (0, 2048):
            cc(score_histogram._binary_hist_kernel, dict(KIND=2, BLOCK_N=bn, BLOCK_L=bl, NB=nb, **on), ps)
    bc = min(_common.pow2(1000), _common.TILE)
    cc(score_histogram._multiclass_outside_kernel, dict(BLOCK_N=_common.TILE // bc, BLOCK_C=bc, **on), ps)
    cc(score_histogram._multiclass_hist_kernel, dict(KIND=2, BLOCK_N=_common.TILE // bc, BLOCK_C=bc, **on), ps)
    for nb, cm_nb in ((16, 128), (1024, 0), (0, 0)):  # histograms of counts and cells, of counts, none
        cc(class_stats._index_kernel, dict(HAS_CONFMAT=True, BLOCK=B, NB=nb, CM_NB=cm_nb, **on), {**ps, "p_ptr": "*i64"})
    for ct, s_ty in ((tl.float32, "*bf16"), (tl.float64, "*fp64")):
        for bn, bc in ((16, 128), class_stats.scores_tiles(128256)):
            cc(class_stats._scores_kernel, dict(HAS_CONFMAT=True, NLL=True, KS=(1, 5, 10), K=3, KMAX=10, KP=16, CT=ct,
                                                BLOCK_N=bn, BLOCK_C=bc, **on), {**ps, "s_ptr": s_ty})


def _run_without_interpreter(func: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    code = f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_triton; test_triton.{func}()"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


def test_kernels_compile_for_cuda():
    pytest.importorskip("triton.backends.nvidia")
    _run_without_interpreter("_compile_all_for_cuda")


def _trace_triton_op() -> None:
    """torch.compile(fullgraph=True) traces *into* the triton_op launchers: AOT sees
    every kernel launch as a triton_kernel_wrapper_functional node. Nothing is
    launched (the compiled function is replaced before it runs), so no GPU is needed."""
    from torch._functorch.aot_autograd import aot_module_simplified

    from d9d_kernels import _extension
    from d9d_kernels.triton import _common

    assert not _common.INTERPRETED
    _extension.triton_usable = lambda device: True  # route CPU tensors to triton; nothing runs
    graphs = []

    class Traced(Exception):
        pass

    def capture(gm, example_inputs):
        graphs.append(gm)

        def never(*args):
            raise Traced

        return never

    with pytest.raises(Traced):
        torch.compile(
            _all_ops, fullgraph=True, backend=lambda gm, ex: aot_module_simplified(gm, ex, fw_compiler=capture)
        )(*_all_ops_args())
    launches = [n for n in graphs[0].graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    # weighted_moments 3 (first good, sums, set pivot), running_extrema 2, class_stats 1,
    # binary_stats 2, score_histogram 2 (INPUT_AUTO prepass + counts) and expert_histogram 2 (load + gate)
    assert len(launches) == 12, graphs[0].code


def test_triton_op_traced_by_torch_compile():
    pytest.importorskip("triton.backends.nvidia")
    _run_without_interpreter("_trace_triton_op")


def _gpu_check() -> None:
    """On a CUDA device with compiled Triton: every op vs the reference, and the
    triton_op path (not the interpreter fallback) under torch.compile(fullgraph=True)."""
    from d9d_kernels.triton import _common

    assert not _common.INTERPRETED
    dev = torch.device("cuda")
    args = _all_ops_args()
    cuda = lambda t: t.to(dev) if isinstance(t, torch.Tensor) else tuple(cuda(s) for s in t)  # noqa: E731
    eager, compiled = [cuda(a) for a in args], [cuda(a) for a in _all_ops_args()]
    _all_ops(*eager)
    torch.compile(_all_ops, fullgraph=True)(*compiled)
    for a, b in zip(_flat(eager[5]), _flat(compiled[5])):
        assert_sums_close(b.cpu(), a.cpu(), "compiled vs eager on cuda", rtol=1e-12)
    x, p2, t2, s, t = args[:5]
    want = f64(9)
    reference.weighted_moments(x, x * 2, None, None, False, want, f64(1), f64(2, fill=NAN))
    assert_sums_close(_flat(eager[5])[0].cpu(), want, "weighted_moments on cuda")
    for n, C in ((5, 123), (3000, 37), (64, 1100)):
        sc = sprinkle(torch.randn(n, C), frac=0.002)
        tg = torch.randint(-1, C + 1, (n,))
        states = _class_states(3, C)
        want = [st.clone() for st in states]
        got = [st.to(dev) for st in states]
        reference.class_stats(sc, tg, None, C, None, [1, 2, 5], True, *want)
        tr("class_stats")(sc.to(dev), tg.to(dev), None, C, None, [1, 2, 5], True, *got)
        for g, w in zip(got, want):
            assert_sums_close(g.cpu(), w, "class_stats on cuda")


def test_class_stats_launch_makes_no_tensor_per_call(monkeypatch):
    """top_ks reach the kernel as a constexpr tuple: no per-call torch.tensor (on
    CUDA a host-to-device copy that syncs the stream and breaks graph capture)."""
    made = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or real(*a, **k))
    s, t = torch.randn(8, 30), torch.randint(0, 30, (8,))
    got = _class_states(3, 30)
    tr("class_stats")(s, t, None, 30, None, [1, 5, 10], True, *got)
    monkeypatch.setattr(torch, "tensor", real)
    want = _class_states(3, 30)
    reference.class_stats(s, t, None, 30, None, [1, 5, 10], True, *want)
    assert made == []
    assert_counts_equal(got[0], want[0], "stats")


def test_scratch_is_fresh_on_fake_tensors():
    """A fake-tensor pass (Dynamo running a triton_op's body) gets a fresh fake
    buffer, never the cached real one, and leaves the cache as it was."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from d9d_kernels.triton import _common

    cpu = torch.device("cpu")
    real = _common.scratch("fake_test", (1,), torch.int64, cpu)
    with FakeTensorMode():
        got = _common.scratch("fake_test", (1,), torch.int64, cpu)
    assert isinstance(got, FakeTensor)
    assert _common.scratch("fake_test", (1,), torch.int64, cpu) is real
