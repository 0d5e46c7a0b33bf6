"""running_extrema: every backend vs d9d_kernels.reference (exact)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from op_utils import FLOAT_DTYPES, assert_counts_equal, f64, noncontig, sprinkle

import d9d_kernels as dk
from d9d_kernels import reference

NEG_INF = float("-inf")


def run_and_compare(backend, x, mask=None, skip_bad=False, state0=None):
    state0 = f64(2, fill=NEG_INF) if state0 is None else state0
    got, want = [state0.clone(), f64(1)], [state0.clone(), f64(1)]
    dk.ops.running_extrema(x, mask, state=got[0], bad=got[1], skip_bad=skip_bad, backend=backend)
    rm = None if mask is None else torch.broadcast_to(mask, x.shape).reshape(-1)
    reference.running_extrema(x.reshape(-1), rm, skip_bad, want[0], want[1])
    assert_counts_equal(got[0], want[0], "state")
    assert_counts_equal(got[1], want[1], "bad")
    return got


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (5, 123), (70000,)])
def test_random(backend, dtype, shape):
    x = (torch.randn(shape) * 100).to(dtype)
    got = run_and_compare(backend, x, torch.rand(shape) > 0.3)
    run_and_compare(backend, x, state0=torch.tensor([5.0, -3.0], dtype=torch.float64))
    if x.numel():
        assert got[0][0].item() <= x.double().max().item()


@pytest.mark.parametrize("skip_bad", [False, True])
def test_nan_inf(backend, skip_bad):
    x = sprinkle(torch.randn(5, 123, dtype=torch.float64))
    got = run_and_compare(backend, x, torch.rand(5, 123) > 0.1, skip_bad=skip_bad)
    assert torch.isnan(got[0]).all().item() != skip_bad
    got = run_and_compare(backend, torch.tensor([1.0, float("inf"), -2.0]), skip_bad=skip_bad)
    assert got[0].tolist() == [float("inf"), 2.0] and got[1].item() == 1
    # a NaN state stays NaN (torch.maximum)
    run_and_compare(backend, torch.tensor([1.0]), state0=torch.tensor([float("nan"), 0.0], dtype=torch.float64))


def test_all_masked_and_noncontiguous(backend):
    x = torch.randn(300)
    got = run_and_compare(backend, x, torch.zeros(300, dtype=torch.bool))
    assert got[0].tolist() == [NEG_INF, NEG_INF]
    run_and_compare(backend, noncontig(torch.randn(7, 99)), torch.rand(1, 99) > 0.5)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 100), skip_bad=st.booleans(), with_mask=st.booleans(), bad_frac=st.sampled_from([0.0, 0.1, 1.0]),
       seed=st.integers(0, 2**16))
def test_hypothesis(n, skip_bad, with_mask, bad_frac, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64)
    if bad_frac:
        x = sprinkle(x, bad_frac)
    mask = torch.rand(n, generator=g) > 0.5 if with_mask else None
    for b in dk.ops.backends():
        if b in ("cpp", "torch"):
            run_and_compare(b, x, mask, skip_bad)


# ---- contracts: opcheck, torch.compile, bad input ----------------------------------------
from op_utils import assert_compiled_matches_eager, assert_rejects, needs_cpp  # noqa: E402


@needs_cpp
def test_opcheck():
    x, m = torch.randn(50), torch.rand(50) > 0.5
    op = torch.ops.d9d_kernels.running_extrema.default
    torch.library.opcheck(op, (x, m, False, f64(2, fill=NEG_INF), f64(1)))
    torch.library.opcheck(op, (x.half(), None, True, f64(2, fill=NEG_INF), f64(1)))


@pytest.mark.parametrize("impl", ["cpp", "torch"])
def test_compile_matches_eager(impl):
    if impl not in dk.ops.backends():
        pytest.skip(f"{impl} not available")
    x = torch.randn(3, 40)

    def fn(state, bad):
        dk.ops.running_extrema(x, x < 1, state=state, bad=bad, backend=impl)

    assert_compiled_matches_eager(fn, lambda: (f64(2, fill=NEG_INF), f64(1)))


def test_bad_input_wrapper():
    op = "running_extrema"
    x = torch.randn(10)
    st, bd = f64(2, fill=NEG_INF), f64(1)
    call = lambda **kw: dk.ops.running_extrema(**{"x": x, "state": st, "bad": bd, **kw})  # noqa: E731
    assert_rejects(lambda: call(mask=torch.ones(10)), op, "mask", [st, bd])
    assert_rejects(lambda: call(mask=torch.ones(3, dtype=torch.bool)), op, "mask", [st, bd])
    assert_rejects(lambda: call(state=f64(3)), op, "state", [st, bd])
    assert_rejects(lambda: call(state=torch.zeros(2)), op, "state", [st, bd])
    assert_rejects(lambda: call(state=f64(4)[::2]), op, "state", [st, bd])
    assert_rejects(lambda: call(state=st.to("meta")), op, "state", [st, bd])
    assert_rejects(lambda: call(bad=f64(2)), op, "bad", [st, bd])


@needs_cpp
def test_bad_input_direct_op():
    op = "running_extrema"
    x = torch.randn(10)
    st, bd = f64(2, fill=NEG_INF), f64(1)

    def call(x=x, mask=None, state=st, bad=bd):
        torch.ops.d9d_kernels.running_extrema(x, mask, False, state, bad)

    assert_rejects(lambda: call(x=x.int()), op, "x", [st, bd])
    assert_rejects(lambda: call(x=x.reshape(2, 5)), op, "x", [st, bd])
    assert_rejects(lambda: call(mask=torch.ones(10, dtype=torch.uint8)), op, "mask", [st, bd])
    assert_rejects(lambda: call(state=f64(1)), op, "state", [st, bd])
    assert_rejects(lambda: call(state=f64(4)[::2]), op, "state", [st, bd])
    assert_rejects(lambda: call(state=st.to("meta")), op, "state", [st, bd])
    assert_rejects(lambda: call(bad=torch.zeros(1, dtype=torch.float32)), op, "bad", [st, bd])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n", [1, 5 * 123, 1_000_003])
@pytest.mark.parametrize("skip_bad", [False, True])
def test_cuda_matches_reference(dtype, n, skip_bad):
    x = sprinkle((torch.randn(n) * 100).to(dtype), 0.001)
    mask = torch.rand(n) > 0.1
    want = [f64(2, fill=NEG_INF), f64(1)]
    reference.running_extrema(x, mask, skip_bad, *want)
    got = [f64(2, fill=NEG_INF).cuda(), f64(1).cuda()]
    dk.ops.running_extrema(x.cuda(), mask.cuda(), state=got[0], bad=got[1], skip_bad=skip_bad, backend="cuda")
    assert_counts_equal(got[0].cpu(), want[0], "state")
    assert_counts_equal(got[1].cpu(), want[1], "bad")
