"""weighted_moments: every backend vs d9d_kernels.reference on random and adversarial inputs."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_utils import FLOAT_DTYPES, assert_counts_equal, assert_sums_close, f64, noncontig, sprinkle

import d9d_kernels as dk
from d9d_kernels import reference

COUNT_SLOTS = [reference.MOMENTS["n"]]


def run_and_compare(backend, x, y=None, w=None, mask=None, skip_bad=False, pivot=None, state0=None):
    """Runs the op on `backend` and the reference on copies of the same state; compares."""
    state0 = f64(9) if state0 is None else state0
    got = [state0.clone(), f64(1), None if pivot is None else pivot.clone()]
    want = [state0.clone(), f64(1), None if pivot is None else pivot.clone()]
    dk.ops.weighted_moments(x, y, w, mask, state=got[0], bad=got[1], pivot=got[2], skip_bad=skip_bad, backend=backend)
    # the reference sees what the wrapper hands the kernels: flat, one dtype
    dt = x.dtype
    for t in (y, w):
        if t is not None:
            dt = torch.promote_types(dt, t.dtype)
    rx = x.reshape(-1).to(dt)
    ry = None if y is None else y.reshape(-1).to(dt)
    rw = None if w is None else torch.broadcast_to(w, x.shape).reshape(-1).to(dt)
    rm = None if mask is None else torch.broadcast_to(mask, x.shape).reshape(-1)
    reference.weighted_moments(rx, ry, rw, rm, skip_bad, want[0], want[1], want[2])
    assert_counts_equal(got[1], want[1], "bad")
    assert_counts_equal(got[0][COUNT_SLOTS], want[0][COUNT_SLOTS], "n")
    assert_sums_close(got[0], want[0], "state")
    if pivot is not None:
        assert_counts_equal(got[2], want[2], "pivot")
    return got


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (5, 123), (1000,), (70000,)])
@pytest.mark.parametrize("with_y", [False, True])
def test_random(backend, dtype, shape, with_y):
    x = (torch.randn(shape) * 3 + 1).to(dtype)
    y = (torch.randn(shape)).to(dtype) if with_y else None
    w = torch.rand(shape).to(dtype)
    mask = torch.rand(shape) > 0.3
    run_and_compare(backend, x, y, w, mask)
    run_and_compare(backend, x, y, None, None, pivot=f64(2, fill=float("nan")))


@pytest.mark.parametrize("skip_bad", [False, True])
@pytest.mark.parametrize("with_y", [False, True])
def test_nan_inf(backend, skip_bad, with_y):
    shape = (5, 123)
    x = sprinkle(torch.randn(shape, dtype=torch.float64))
    y = sprinkle(torch.randn(shape, dtype=torch.float64)) if with_y else None
    w = sprinkle(torch.rand(shape, dtype=torch.float64), 0.02)
    got = run_and_compare(backend, x, y, w, torch.rand(shape) > 0.2, skip_bad=skip_bad, pivot=f64(2, fill=float("nan")))
    assert got[1].item() > 0
    assert torch.isnan(got[0][0]).item() != skip_bad  # propagate vs ignore


def test_pivot_first_good_element(backend):
    # the first elements are masked or non-finite: the pivot comes from index 3
    x = torch.tensor([5.0, float("nan"), 7.0, 1e6 + 1, 1e6 + 2, 1e6 + 3], dtype=torch.float64)
    y = torch.tensor([1.0, 2.0, float("inf"), 3.0, 4.0, 5.0], dtype=torch.float64)
    mask = torch.tensor([False, True, True, True, True, True])
    got = run_and_compare(backend, x, y, None, mask, skip_bad=True, pivot=f64(2, fill=float("nan")))
    assert got[2].tolist() == [1e6 + 1, 3.0]
    # a set pivot is left alone
    got = run_and_compare(backend, x, y, None, mask, skip_bad=True, pivot=torch.tensor([2.0, float("nan")], dtype=torch.float64))
    assert got[2].tolist() == [2.0, 3.0]
    # no good element: pivot stays unset
    got = run_and_compare(backend, x[:3], y[:3], None, mask[:3], pivot=f64(2, fill=float("nan")))
    assert torch.isnan(got[2]).all()


def test_pivot_keeps_variance_exact(backend):
    x = 1e8 + torch.randn(10000, dtype=torch.float64)
    st, bad, piv = f64(9), f64(1), f64(2, fill=float("nan"))
    dk.ops.weighted_moments(x, state=st, bad=bad, pivot=piv, backend=backend)
    var = st[2] / st[0] - (st[1] / st[0]) ** 2
    torch.testing.assert_close(var, x.var(unbiased=False), rtol=1e-9, atol=0)


def test_noncontiguous_and_broadcast(backend):
    x = noncontig(torch.randn(4, 301))
    y = noncontig(torch.randn(4, 301))
    w = torch.tensor(2.5)  # scalar weight broadcast to x
    mask = torch.rand(1, 301) > 0.5  # broadcast over rows
    run_and_compare(backend, x, y, w, mask, pivot=f64(2, fill=float("nan")))


def test_all_masked_and_mixed_dtypes(backend):
    x = torch.randn(257, dtype=torch.float16)
    y = torch.randn(257, dtype=torch.float64)
    got = run_and_compare(backend, x, y, torch.rand(257, dtype=torch.bfloat16), torch.zeros(257, dtype=torch.bool))
    assert got[0].abs().sum().item() == 0 and got[1].item() == 0
    run_and_compare(backend, x, y, torch.rand(257, dtype=torch.bfloat16), None, state0=torch.arange(9, dtype=torch.float64))


def test_direct_op_mixed_dtypes():
    """torch.ops with mixed float dtypes (no wrapper) promotes like the wrapper."""
    if "cpp" not in dk.ops.backends():
        pytest.skip("no compiled extension")
    x = torch.randn(100, dtype=torch.float16)
    y = torch.randn(100, dtype=torch.float64)
    got, want = f64(9), f64(9)
    torch.ops.d9d_kernels.weighted_moments(x, y, None, None, False, got, f64(1), None)
    reference.weighted_moments(x.double(), y, None, None, False, want, f64(1), None)
    assert_sums_close(got, want)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 300),
    with_y=st.booleans(),
    with_w=st.booleans(),
    with_mask=st.booleans(),
    skip_bad=st.booleans(),
    bad_frac=st.sampled_from([0.0, 0.1, 1.0]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis(n, with_y, with_w, with_mask, skip_bad, bad_frac, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 10
    if bad_frac and n:
        x = sprinkle(x, bad_frac)
    y = torch.randn(n, generator=g, dtype=torch.float64) if with_y else None
    w = torch.rand(n, generator=g, dtype=torch.float64) if with_w else None
    mask = torch.rand(n, generator=g) > 0.5 if with_mask else None
    for b in dk.ops.backends():
        if b in ("cpp", "torch"):
            run_and_compare(b, x, y, w, mask, skip_bad=skip_bad, pivot=f64(2, fill=float("nan")))


# ---- contracts: opcheck, torch.compile, bad input ----------------------------------------
from op_utils import assert_compiled_matches_eager, assert_rejects, needs_cpp  # noqa: E402


@needs_cpp
def test_opcheck():
    x, y, w, m = torch.randn(50), torch.randn(50), torch.rand(50), torch.rand(50) > 0.5
    torch.library.opcheck(torch.ops.d9d_kernels.weighted_moments.default, (x, y, w, m, False, f64(9), f64(1), f64(2, fill=float("nan"))))
    torch.library.opcheck(torch.ops.d9d_kernels.weighted_moments.default, (x.half(), None, None, None, True, f64(9), f64(1), None))


@pytest.mark.parametrize("with_pivot", [False, True])
@pytest.mark.parametrize("impl", ["cpp", "torch"])
def test_compile_matches_eager(impl, with_pivot):
    if impl not in dk.ops.backends():
        pytest.skip(f"{impl} not available")
    x, y, w = torch.randn(4, 33), torch.randn(4, 33), torch.rand(4, 33)

    def fn(state, bad, pivot):
        dk.ops.weighted_moments(x, y, w, x > 0, state=state, bad=bad, pivot=pivot, backend=impl)

    assert_compiled_matches_eager(fn, lambda: (f64(9), f64(1), f64(2, fill=float("nan")) if with_pivot else None))


def test_bad_input_wrapper():
    x = torch.randn(10)
    st, bad = f64(9), f64(1)
    op = "weighted_moments"
    call = lambda **kw: dk.ops.weighted_moments(**{"x": x, "state": st, "bad": bad, **kw})  # noqa: E731
    assert_rejects(lambda: call(y=torch.randn(11)), op, "y", [st, bad])
    assert_rejects(lambda: call(weights=torch.rand(3)), op, "weights", [st, bad])
    assert_rejects(lambda: call(mask=torch.ones(10)), op, "mask", [st, bad])
    assert_rejects(lambda: call(state=f64(8)), op, "state", [st, bad])
    assert_rejects(lambda: call(state=torch.zeros(9)), op, "state", [st, bad])
    assert_rejects(lambda: call(state=f64(18)[::2]), op, "state", [st, bad])
    assert_rejects(lambda: call(state=st.to("meta")), op, "state", [st, bad])
    assert_rejects(lambda: call(bad=f64(2)), op, "bad", [st, bad])
    assert_rejects(lambda: call(pivot=f64(3)), op, "pivot", [st, bad])


@needs_cpp
def test_bad_input_direct_op():
    x = torch.randn(10)
    st, bad = f64(9), f64(1)
    op = "weighted_moments"
    call = lambda *a: torch.ops.d9d_kernels.weighted_moments(*a)  # noqa: E731
    assert_rejects(lambda: call(x.to(torch.complex64), None, None, None, False, st, bad, None), op, "x", [st, bad])
    assert_rejects(lambda: call(x, torch.randn(11), None, None, False, st, bad, None), op, "y", [st, bad])
    assert_rejects(lambda: call(x, None, torch.rand(9), None, False, st, bad, None), op, "weights", [st, bad])
    assert_rejects(lambda: call(x, None, None, torch.ones(10), False, st, bad, None), op, "mask", [st, bad])
    assert_rejects(lambda: call(x, None, None, None, False, f64(10), bad, None), op, "state", [st, bad])
    assert_rejects(lambda: call(x, None, None, None, False, torch.zeros(9), bad, None), op, "state", [st, bad])
    assert_rejects(lambda: call(x, None, None, None, False, f64(18)[::2], bad, None), op, "state", [st, bad])
    assert_rejects(lambda: call(x, None, None, None, False, st.to("meta"), bad, None), op, "state", [st, bad])
    assert_rejects(lambda: call(x, None, None, None, False, st, bad, f64(1)), op, "pivot", [st, bad])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [1, 5 * 123, 1_000_003])
def test_cuda_matches_reference(dtype, n):
    x, y, w = (torch.randn(n) * 3 + 1).to(dtype), torch.randn(n).to(dtype), torch.rand(n).to(dtype)
    x = sprinkle(x, 0.01)
    mask = torch.rand(n) > 0.2
    for skip_bad in (False, True):
        want = [f64(9), f64(1), f64(2, fill=float("nan"))]
        reference.weighted_moments(x, y, w, mask, skip_bad, *want)
        got = [t.cuda() for t in (f64(9), f64(1), f64(2, fill=float("nan")))]
        dk.ops.weighted_moments(x.cuda(), y.cuda(), w.cuda(), mask.cuda(), state=got[0], bad=got[1], pivot=got[2],
                                skip_bad=skip_bad, backend="cuda")
        got = [t.cpu() for t in got]
        assert_counts_equal(got[1], want[1], "bad")
        assert_counts_equal(got[2], want[2], "pivot")
        assert_sums_close(got[0], want[0], "state")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [6, 300, 1000, 2048, 2049, 70000])
@pytest.mark.parametrize("with_y", [False, True])
def test_cuda_pivot_one_launch_and_two(n, with_y):
    """Small inputs set the pivot inside the sums' only block, larger ones in a
    pivot kernel first: both give the reference's pivot (the first good
    element, found past several tiles of masked and non-finite ones) and sums,
    and a set pivot is left alone."""
    x = 1e6 + torch.randn(n, dtype=torch.float64)
    y = torch.randn(n, dtype=torch.float64) if with_y else None
    first = min(n - 1, 700)  # past two 256-element tiles where n allows
    x[: first // 2] = float("nan")
    mask = torch.ones(n, dtype=torch.bool)
    mask[first // 2 : first] = False
    for pivot0 in (f64(2, fill=float("nan")), torch.tensor([3.0, float("nan")], dtype=torch.float64)):
        for skip_bad in (False, True):
            want = [f64(9), f64(1), pivot0.clone()]
            reference.weighted_moments(x, y, None, mask, skip_bad, *want)
            got = [f64(9).cuda(), f64(1).cuda(), pivot0.cuda()]
            dk.ops.weighted_moments(x.cuda(), None if y is None else y.cuda(), None, mask.cuda(), state=got[0],
                                    bad=got[1], pivot=got[2], skip_bad=skip_bad, backend="cuda")
            got = [t.cpu() for t in got]
            assert_counts_equal(got[2], want[2], "pivot")
            assert got[2][0].item() == (x[first].item() if torch.isnan(pivot0[0]) else 3.0)
            assert_counts_equal(got[1], want[1], "bad")
            assert_sums_close(got[0], want[0], "state")
