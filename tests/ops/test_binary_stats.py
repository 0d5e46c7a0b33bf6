"""binary_stats: every backend vs d9d_kernels.reference (counts exact)."""

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


def run_and_compare(backend, preds, target, mask=None, *, threshold=0.5, ignore_index=None, input_kind=reference.INPUT_AUTO):
    L = 1 if preds.dim() <= 1 else preds.shape[-1]
    got, want = [f64(L, 4), f64(2)], [f64(L, 4), f64(2)]
    dk.ops.binary_stats(preds, target, mask, state=got[0], bad=got[1], threshold=threshold, ignore_index=ignore_index,
                        input_kind=input_kind, backend=backend)
    rp = preds.reshape(-1, L)
    if not rp.is_floating_point():
        rp = rp.to(torch.float32)
    rt = as_index("t", "target", target).reshape(-1, L)
    rm = None if mask is None else torch.broadcast_to(mask, target.shape).reshape(-1, L)
    kind = input_kind if preds.is_floating_point() else reference.INPUT_PROBS
    reference.binary_stats(rp, rt, rm, threshold, ignore_index, kind, want[0], want[1])
    assert_counts_equal(got[0], want[0], "state")
    assert_counts_equal(got[1], want[1], "bad")
    return got


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (5, 123), (4000, 3), (70000,)])
@pytest.mark.parametrize("kind", KINDS)
def test_random(backend, dtype, shape, kind):
    probs = torch.rand(shape).to(dtype)
    logits = (torch.randn(shape) * 3).to(dtype)
    target = torch.randint(0, 2, shape)
    mask = torch.rand(shape) > 0.2
    run_and_compare(backend, probs, target, mask, input_kind=kind, threshold=0.3)
    got = run_and_compare(backend, logits, target, None, input_kind=kind)
    assert got[0].sum().item() == target.numel()


def test_auto_is_per_call_and_ignores_invalid_entries(backend):
    # the only out-of-[0,1] pred is masked, ignored, or has a bad target: still probabilities
    preds = torch.tensor([0.2, 0.7, 5.0, 0.9, -3.0, 0.6])
    target = torch.tensor([0, 1, 1, 1, 2, -1])
    mask = torch.tensor([True, True, False, True, True, True])
    got = run_and_compare(backend, preds, target, mask, ignore_index=-1)
    assert got[0].tolist() == [[2.0, 0.0, 1.0, 0.0]] and got[1].tolist() == [1, 0]
    # one valid logit flips the whole call to sigmoid: 0.2 -> 0.55 is positive
    got = run_and_compare(backend, torch.tensor([0.2, 1.5]), torch.tensor([0, 1]))
    assert got[0].tolist() == [[1.0, 1.0, 0.0, 0.0]]


def test_threshold_is_strict(backend):
    got = run_and_compare(backend, torch.tensor([0.5, 0.5, 0.25]), torch.tensor([1, 0, 1]), input_kind=reference.INPUT_PROBS)
    assert got[0].tolist() == [[0.0, 0.0, 1.0, 2.0]]


def test_bad_entries(backend):
    preds = sprinkle(torch.randn(300, 4) * 2, 0.05)
    target = torch.randint(-1, 3, (300, 4))
    target[0, 0] = 10**12
    got = run_and_compare(backend, preds, target, ignore_index=-1)
    # by cause: a target other than 0/1 whatever the pred, else a NaN/Inf pred
    kept, target_ok = target != -1, (target == 0) | (target == 1)
    want = [(kept & ~target_ok).sum().item(), (kept & target_ok & ~torch.isfinite(preds)).sum().item()]
    assert got[1].tolist() == want and min(want) > 0
    run_and_compare(backend, preds, target.double() / 2)  # 0.5 targets: not whole, bad
    run_and_compare(backend, preds, target, torch.zeros(300, 4, dtype=torch.bool))


def test_integer_and_bool_inputs(backend):
    preds = torch.randint(0, 2, (100, 3))
    target = torch.randint(0, 2, (100, 3)).bool()
    run_and_compare(backend, preds, target, input_kind=reference.INPUT_LOGITS)  # ints are always probabilities
    run_and_compare(backend, preds.bool(), target.float())


def test_noncontiguous_and_broadcast_mask(backend):
    preds = noncontig(torch.randn(50, 7))
    target = noncontig(torch.randint(0, 2, (50, 7)))
    run_and_compare(backend, preds, target, torch.rand(50, 1) > 0.5)
    run_and_compare(backend, preds.t(), target.t(), torch.rand(7, 1) > 0.5)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 40),
    L=st.integers(1, 5),
    kind=st.sampled_from(KINDS),
    scale=st.sampled_from([0.5, 1.0, 4.0]),
    threshold=st.sampled_from([0.0, 0.3, 0.5, 0.9]),
    with_mask=st.booleans(),
    ignore=st.sampled_from([None, -1, 0]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis(n, L, kind, scale, threshold, with_mask, ignore, seed):
    g = torch.Generator().manual_seed(seed)
    preds = torch.rand(n, L, generator=g, dtype=torch.float64) * scale
    target = torch.randint(-1, 3, (n, L), generator=g)
    mask = torch.rand(n, L, generator=g) > 0.3 if with_mask else None
    for b in dk.ops.backends():
        if b in ("cpp", "torch"):
            run_and_compare(b, preds, target, mask, threshold=threshold, ignore_index=ignore, input_kind=kind)


# ---- contracts: opcheck, torch.compile, bad input ----------------------------------------
from op_utils import assert_compiled_matches_eager, assert_rejects, needs_cpp  # noqa: E402


@needs_cpp
def test_opcheck():
    p, t, m = torch.randn(30, 3), torch.randint(0, 2, (30, 3)), torch.rand(30, 3) > 0.2
    op = torch.ops.d9d_kernels.binary_stats.default
    torch.library.opcheck(op, (p, t, m, 0.5, None, 2, f64(3, 4), f64(2)))
    torch.library.opcheck(op, (p.half(), t, None, 0.3, 0, 1, f64(3, 4), f64(2)))
    torch.library.opcheck(op, (t, t, None, 0.5, None, 0, f64(3, 4), f64(2)))


@pytest.mark.parametrize("impl", ["cpp", "torch"])
def test_compile_matches_eager(impl):
    if impl not in dk.ops.backends():
        pytest.skip(f"{impl} not available")
    p, t = torch.randn(16, 3), torch.randint(0, 2, (16, 3))

    def fn(state, bad):
        dk.ops.binary_stats(p, t, p > -1, state=state, bad=bad, threshold=0.4, backend=impl)

    assert_compiled_matches_eager(fn, lambda: (f64(3, 4), f64(2)))


def test_bad_input_wrapper():
    op = "binary_stats"
    p, t = torch.rand(8, 3), torch.randint(0, 2, (8, 3))
    st, bd = f64(3, 4), f64(2)
    call = lambda **kw: dk.ops.binary_stats(**{"preds": p, "target": t, "state": st, "bad": bd, **kw})  # noqa: E731
    assert_rejects(lambda: call(target=t[:, :2]), op, "target", [st, bd])
    assert_rejects(lambda: call(mask=torch.ones(8, 3)), op, "mask", [st, bd])
    assert_rejects(lambda: call(input_kind=3), op, "input_kind", [st, bd])
    assert_rejects(lambda: call(state=f64(2, 4)), op, "state", [st, bd])
    assert_rejects(lambda: call(state=torch.zeros(3, 4)), op, "state", [st, bd])
    assert_rejects(lambda: call(state=f64(4, 3).t()), op, "state", [st, bd])
    assert_rejects(lambda: call(state=st.to("meta")), op, "state", [st, bd])
    assert_rejects(lambda: call(bad=f64(1, 1)), op, "bad", [st, bd])


@needs_cpp
def test_bad_input_direct_op():
    op = "binary_stats"
    p, t = torch.rand(8, 3), torch.randint(0, 2, (8, 3))
    st, bd = f64(3, 4), f64(2)

    def call(preds=p, target=t, mask=None, kind=2, state=st, bad=bd):
        torch.ops.d9d_kernels.binary_stats(preds, target, mask, 0.5, None, kind, state, bad)

    assert_rejects(lambda: call(preds=p.reshape(-1)), op, "preds", [st, bd])
    assert_rejects(lambda: call(target=t.float()), op, "target", [st, bd])
    assert_rejects(lambda: call(target=t[:4]), op, "target", [st, bd])
    assert_rejects(lambda: call(mask=torch.ones(8, 2, dtype=torch.bool)), op, "mask", [st, bd])
    assert_rejects(lambda: call(kind=-1), op, "input_kind", [st, bd])
    assert_rejects(lambda: call(state=f64(3, 5)), op, "state", [st, bd])
    assert_rejects(lambda: call(state=f64(4, 3).t()), op, "state", [st, bd])
    assert_rejects(lambda: call(state=st.to("meta")), op, "state", [st, bd])
    assert_rejects(lambda: call(bad=torch.zeros(1)), op, "bad", [st, bd])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(1, 1), (5, 123), (100_003, 3), (50, 2000)])
def test_cuda_matches_reference(dtype, kind, shape):
    preds = sprinkle((torch.randn(shape) * 2).to(dtype), 0.01)
    target = torch.randint(-1, 3, shape)
    mask = torch.rand(shape) > 0.1
    want = [f64(shape[1], 4), f64(2)]
    reference.binary_stats(preds, target, mask, 0.4, -1, kind, *want)
    got = [f64(shape[1], 4).cuda(), f64(2).cuda()]
    dk.ops.binary_stats(preds.cuda(), target.cuda(), mask.cuda(), state=got[0], bad=got[1], threshold=0.4,
                        ignore_index=-1, input_kind=kind, backend="cuda")
    assert_counts_equal(got[0].cpu(), want[0], "state")
    assert_counts_equal(got[1].cpu(), want[1], "bad")


@pytest.mark.parametrize("threshold", [0.5, 0.3, 0.9, 1e-3, 1e-7, 1 - 1e-7, 0.0, 1.0])
def test_logits_at_the_threshold_boundary(backend, threshold):
    # logits just around logit(threshold): the kernels' logit comparison and its
    # exact-sigmoid fallback must give the reference's sigmoid(v) > threshold
    import math

    if 0 < threshold < 1:
        lt = math.log(threshold) - math.log1p(-threshold)
        rel = torch.tensor([0.0, 1e-14, -1e-14, 1e-12, -1e-12, 1e-10, -1e-10, 1e-8, -1e-8, 1e-3, -1e-3])
        logits = (lt + rel * (1 + abs(lt))).double()
    else:
        logits = torch.tensor([-800.0, -40.0, -1.0, 0.0, 1.0, 40.0, 800.0], dtype=torch.float64)
    logits = torch.cat([logits, torch.tensor([5.0])])  # keeps INPUT_AUTO on logits
    target = torch.randint(0, 2, logits.shape)
    run_and_compare(backend, logits, target, threshold=threshold, input_kind=reference.INPUT_LOGITS)
    run_and_compare(backend, logits, target, threshold=threshold)


@pytest.mark.gpu
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
@pytest.mark.parametrize("case", ["probs", "logits", "outside_masked", "outside_bad_target", "misaligned"])
def test_cuda_auto_one_label_in_one_pass(case, target_dtype):
    """INPUT_AUTO with one label counts both readings in one pass and keeps the
    one the data chose: preds outside [0, 1] only where masked or on a bad
    target do not make them logits."""
    if "cuda" not in dk.ops.backends():
        pytest.skip("no CUDA kernels")
    g = torch.Generator().manual_seed(7)
    n = 200_003
    p = torch.rand(n + 1, generator=g)
    t = torch.randint(0, 2, (n + 1,), generator=g)
    m = torch.rand(n + 1, generator=g) > 0.1
    if case == "logits":
        p = torch.randn(n + 1, generator=g) * 3
    elif case == "outside_masked":
        m[100] = False
        p[100] = 4.0
    elif case == "outside_bad_target":
        t[100] = 2
        p[100] = -4.0
    p, t, m = (p[1:], t[1:], m[1:]) if case == "misaligned" else (p[:n], t[:n], m[:n])
    if target_dtype == torch.bool:
        t = t.clamp(0, 1)
    t = t.to(target_dtype)
    want = [f64(1, 4), f64(2)]
    reference.binary_stats(p[:, None], t.long()[:, None], m[:, None], 0.3, None, reference.INPUT_AUTO, *want)
    got = [f64(1, 4).cuda(), f64(2).cuda()]
    torch.ops.d9d_kernels.binary_stats.default(p.cuda()[:, None], t.cuda()[:, None], m.cuda()[:, None], 0.3, None,
                                               reference.INPUT_AUTO, *got)
    assert_counts_equal(got[0].cpu(), want[0], "state")
    assert_counts_equal(got[1].cpu(), want[1], "bad")
