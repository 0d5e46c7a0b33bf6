"""ops.linear_logits (torch blocks and Triton) against reference.linear_logits (materialised logits)."""

from __future__ import annotations

import importlib

import pytest
import torch

import d9d_kernels as dk
from d9d_kernels import reference
L = importlib.import_module("d9d_kernels.ops.linear_logits")  # the module (dk.ops.linear_logits is the function)

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def impls():
    out = ["torch"]
    if "triton" in dk.ops.backends():
        out.append("triton")
    return out


def ref_rows(h, w, b, t, zt=None, start=0, softcap=None, sumexp=True):
    out = torch.empty(h.shape[0], 5, dtype=torch.float64, device=h.device)
    reference.linear_logits(h, w, b, t, zt, start, softcap, sumexp, out)
    return out


def integer_case(N, D, V, dtype, seed=0):
    """Small integers: every logit exact in every dtype (and many ties)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-3, 4, (N, D), generator=g).to(dtype)
    w = torch.randint(-2, 3, (V, D), generator=g).to(dtype)
    b = torch.randint(-2, 3, (V,), generator=g).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    return h, w, b, t


def assert_rows_equal(got, ref, sum_rtol=1e-5):
    ok = torch.isfinite(ref[:, 0])
    assert torch.equal(got[:, 0].isnan(), ref[:, 0].isnan())
    assert torch.equal(got[ok, 0], ref[ok, 0])
    torch.testing.assert_close(got[ok, 1], ref[ok, 1], rtol=sum_rtol, atol=0)
    assert torch.equal(got[:, 2], ref[:, 2])
    assert torch.equal(got[ok, 3], ref[ok, 3])
    assert torch.equal(got[ok, 4], ref[ok, 4])


@pytest.fixture
def small_blocks(monkeypatch):
    # blocks of a few hundred columns: V = 1000 crosses block edges, not a multiple of them
    monkeypatch.setattr(L, "SCRATCH_BYTES", 1 << 16)


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_integer_logits_exact(small_blocks, impl, dtype, bias, softcap):
    if impl == "triton" and dtype == torch.float64:
        pytest.skip("triton takes 16/32-bit inputs")
    V = 1000 if impl == "torch" else 300  # the interpreter: ~ms per tile
    h, w, b, t = integer_case(37, 19, V, dtype)  # D odd
    t[3], t[5] = -100, V  # out of range: -inf target logit
    b = b if bias else None
    got = L.linear_logits(h, w, b, t, softcap=softcap, backend=impl)
    ref = ref_rows(h, w, b, t, softcap=softcap)
    if softcap is not None and dtype in (torch.float32, torch.float64) and impl == "triton":
        # tanh as 1 - 2 / (exp(2x) + 1): within a few ulp of torch.tanh
        torch.testing.assert_close(got[:, 0], ref[:, 0], rtol=1e-6, atol=1e-6)
        return
    assert_rows_equal(got, ref)
    assert (got[[3, 5], 2] == float("-inf")).all()
    # hits from the counts equal the stable-sort top-k of the materialised logits
    z = torch.nn.functional.linear(h, w, b).double()
    if softcap is not None:
        z = (softcap * torch.tanh(torch.nn.functional.linear(h, w, b) / softcap)).double()
    order = torch.sort(z, dim=1, descending=True, stable=True).indices
    ok = (t >= 0) & (t < V)
    for k in (1, 5, 10):
        hit = (order[:, :k] == t[:, None]).any(1)
        assert torch.equal(hit[ok], (got[ok, 3] < k))


@pytest.mark.parametrize("impl", impls())
def test_sumexp_off_given_target_logit_and_shard_start(impl):
    h, w, b, t = integer_case(20, 8, 200, torch.float32, seed=3)
    zt = ref_rows(h, w, b, t)[:, 2]
    got = L.linear_logits(h, w[50:150], b[50:150], t, zt, start=50, sumexp=False, backend=impl)
    ref = ref_rows(h, w[50:150], b[50:150], t, zt, start=50, sumexp=False)
    assert (got[:, 1] == 0).all()
    assert_rows_equal(got, ref)


@pytest.mark.parametrize("impl", impls())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_logits_differ_only_within_rounding(impl, dtype):
    """On random data the target logit (a separate dot) may differ from the
    materialised one in the last bit: a count may then differ, but only by
    logits within that rounding of the target's (measured: none here)."""
    N, D, V = (256, 64, 2000) if impl == "torch" else (64, 32, 256)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(N, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) / D**0.5).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    got = L.linear_logits(h, w, None, t, backend=impl)
    ref = ref_rows(h, w, None, t)
    z = torch.nn.functional.linear(h, w).double()
    zt = z.gather(1, t[:, None])[:, 0]
    # a rounding step of the dtype plus the float32 dot's summation-order bound
    dot = (h.double().abs() * w.double().abs()[t]).sum(1)
    tol = torch.finfo(dtype).eps * zt.abs() + D * torch.finfo(torch.float32).eps * dot
    assert ((got[:, 2] - zt).abs() <= tol).all()
    near = ((z - zt[:, None]).abs() <= tol[:, None]).sum(1) - 1  # other logits within rounding
    diff = (got[:, 3] - ref[:, 3]).abs()
    assert (diff <= near).all()
    assert torch.equal(got[:, 4], ref[:, 4]) or dtype != torch.float32 and impl == "triton"
    torch.testing.assert_close(got[:, 1], ref[:, 1], rtol=1e-5, atol=0)


@pytest.mark.parametrize("impl", impls())
def test_bad_rows_and_empty(impl):
    h, w, b, t = integer_case(6, 4, 50, torch.float32)
    h[1, 0] = float("nan")
    h[2] = 0
    w2 = w.clone()
    w2[7, 0] = float("inf")
    got = L.linear_logits(h, w2, None, t, backend=impl)
    assert got[1, 0].isnan()
    assert not torch.isfinite(got[:, 0]).all()
    assert L.linear_logits(h[:0], w, None, t[:0], backend=impl).shape == (0, 5)


def test_blocks_bounded():
    for N, V, dt in [(2048, 32000, torch.float32), (16384, 128000, torch.bfloat16), (7, 50257, torch.float64)]:
        rows, cols = L.blocks(N, V, dt)
        assert rows * cols * L.scratch_per_element(dt) <= L.SCRATCH_BYTES + L.MIN_COLS * 32
        assert cols >= min(V, L.MIN_COLS)
    # the bench shape: scratch <= 2 % of the float32 logits
    assert L.scratch_bytes(2048, 512, 32000, torch.float32) <= 0.02 * 2048 * 32000 * 4


def test_argument_errors():
    h, w, b, t = integer_case(4, 3, 10, torch.float32)
    with pytest.raises(TypeError, match="linear_logits: argument 'weight'"):
        L.linear_logits(h, w.double(), None, t)
    with pytest.raises(ValueError, match="argument 'weight' must be \\[V, D\\] with D = 3"):
        L.linear_logits(h, w[:, :2], None, t)
    with pytest.raises(ValueError, match="argument 'bias'"):
        L.linear_logits(h, w, b[:5], t)
    with pytest.raises(TypeError, match="argument 'target'"):
        L.linear_logits(h, w, None, t.float())
    with pytest.raises(ValueError, match="argument 'softcap'"):
        L.linear_logits(h, w, None, t, softcap=-1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(37, 19, 1000), (300, 64, 50257), (5000, 128, 4096)])
def test_cuda_triton_matches_reference(dtype, shape):
    N, D, V = shape
    h, w, b, t = integer_case(N, D, V, dtype)
    h, w, b, t = h.cuda(), w.cuda(), b.cuda(), t.cuda()
    for bias in (None, b):
        for softcap in (None, 30.0):
            got = L.linear_logits(h, w, bias, t, softcap=softcap)
            ref = ref_rows(h.cpu(), w.cpu(), None if bias is None else bias.cpu(), t.cpu(), softcap=softcap)
            if softcap is None or dtype != torch.float32:
                assert_rows_equal(got.cpu(), ref)
            torch.testing.assert_close(got[:, 1].cpu(), ref[:, 1], rtol=1e-5, atol=0)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.skipif(L._native_rows(torch.device("cpu")) is None, reason="extension without linear_logits_rows")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_block_pass_equals_its_torch_specification(small_blocks, one_thread, monkeypatch, dtype):
    """The C++ pass (csrc/cpu/linear_logits.cpp) against the torch ops it
    replaces, on the same blocks (its tasks of the fallback's rows, the
    matmuls on one thread: torch.mm's rounding depends on the block's rows
    and on its threads): integer logits (ties across block edges), random
    logits, NaN / +Inf rows, targets outside the shard, soft-cap, sumexp off."""
    monkeypatch.setattr(L, "task_rows", lambda N, V, dtype, threads: L.blocks(N, V, dtype)[0])
    g = torch.Generator().manual_seed(5)
    cases = [integer_case(41, 7, 1000, dtype, seed=2)]
    h = torch.randn(33, 16, generator=g).to(dtype)
    w = torch.randn(700, 16, generator=g).to(dtype)
    t = torch.randint(0, 700, (33,), generator=g)
    t[0], t[1] = -1, 700
    h[2, 3] = float("nan")
    cases.append((h, w, None, t))
    for h, w, b, t in cases:
        for kw in (dict(), dict(softcap=4.0), dict(sumexp=False, start=100)):
            native = L.linear_logits(h, w, b, t, backend="torch", **kw)
            with monkeypatch.context() as mp:
                mp.setattr(L, "_native_rows", lambda device: None)
                spec = L.linear_logits(h, w, b, t, backend="torch", **kw)
            ok = torch.isfinite(spec[:, 0])  # a row with NaN / +Inf is bad whatever the rest holds
            assert torch.equal(native[:, 0].isnan(), spec[:, 0].isnan())
            for col in (0, 2, 3, 4):
                torch.testing.assert_close(native[ok, col], spec[ok, col], rtol=0, atol=0, equal_nan=True)
            torch.testing.assert_close(native[ok, 1], spec[ok, 1], rtol=1e-6, atol=0)


@pytest.mark.skipif(L._native_rows(torch.device("cpu")) is None, reason="extension without linear_logits_rows")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_tasks_any_split_any_threads(small_blocks, dtype):
    """The C++ op's threads take tasks of ``rows`` rows from a shared counter:
    every split and thread count gives the same rows (integer logits: exact
    whatever the matmul's blocking), equal to the reference."""
    h, w, b, t = integer_case(41, 7, 1000, dtype, seed=4)
    t[0] = -1
    ref = ref_rows(h, w, b, t, softcap=3.0)
    op = L._native_rows(torch.device("cpu"))
    _, cols = L.blocks(41, 1000, dtype)
    zt = L.target_logits(h, w, b, t, 0, 3.0)
    n = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for rows in (1, 5, 40, 41, 1000):
                st = torch.full((41, 4), 7.0, dtype=torch.float64)  # every row written
                op(h, w, b, zt, t, cols, rows, 3.0, True, st)
                got = torch.cat([st[:, :2], zt.double()[:, None], st[:, 2:]], 1)
                assert_rows_equal(got, ref)
    finally:
        torch.set_num_threads(n)


@pytest.mark.skipif(L._native(torch.device("cpu"), "linear_logits_target") is None,
                    reason="extension without linear_logits_target")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("softcap", [None, 4.0])
def test_cpu_target_logits_equal_their_torch_specification(monkeypatch, dtype, softcap):
    """The C++ target logits (csrc/cpu/linear_logits.cpp) against target_logits'
    torch ops: exact on integer logits (targets outside the shard -inf), within
    the dot's summation order on random ones; a non-contiguous weight too."""
    h, w, b, t = integer_case(300, 19, 500, dtype, seed=6)
    t[:3] = torch.tensor([-1, 40, 550])  # outside [start, start + V) = [50, 550)
    g = torch.Generator().manual_seed(7)
    hr = torch.randn(300, 64, generator=g).to(dtype)
    wr = (torch.randn(64, 500, generator=g) / 8).to(dtype).t()  # [V, D], column-major
    for hh, ww, bb, tol in ((h, w, b, False), (h, w, None, False), (hr, wr, None, True)):
        got = L.target_logits(hh, ww, bb, t, 50, softcap)
        with monkeypatch.context() as mp:
            mp.setattr(L, "_native", lambda device, name: None)
            spec = L.target_logits(hh, ww, bb, t, 50, softcap)
        assert got.dtype == spec.dtype
        assert torch.equal(got.isneginf(), spec.isneginf()) and got[:3].isneginf().all()
        if not tol:
            assert torch.equal(got, spec)
        else:
            fin = torch.isfinite(spec)
            idx = (t - 50).clamp(0, 499)
            dot = (hh.double().abs() * ww.double()[idx].abs()).sum(1)
            bound = torch.finfo(dtype).eps * spec.double().abs() + 64 * torch.finfo(torch.float32).eps * dot
            assert ((got.double() - spec.double()).abs()[fin] <= 2 * bound[fin]).all()
