"""expert_histogram: every backend vs d9d_kernels.reference (counts exact, gate sums to rounding)."""

from __future__ import annotations

import pytest
import torch
from op_utils import (FLOAT_DTYPES, assert_compiled_matches_eager, assert_counts_equal, assert_rejects,
                      assert_sums_close, f64, needs_cpp)

import d9d_kernels as dk
from d9d_kernels import reference


def run_and_compare(backend, indices, layers, L, E, probs=None, start=None):
    """The wrapper on ``backend`` and the reference on the same raw arguments; returns (load, gate, bad)."""
    def fresh():
        load = f64(L, E) if start is None else start[0].clone()
        gate = f64(L, E + 1) if start is None else start[1].clone()
        return [load, gate, f64(1)]

    got, want = fresh(), fresh()
    dk.ops.expert_histogram(indices, layers, probs, load=got[0], gate=got[1], bad=got[2], backend=backend)
    raw = indices.reshape(indices.shape[0], -1) if indices.dim() > 1 else indices.reshape(1, -1)
    if raw.is_floating_point():  # the wrapper's conversion: values that are not whole numbers are bad
        raw = dk.ops.as_index(raw)
    rp = None if probs is None else (probs[None] if probs.dim() == 2 else probs)
    lay = list(range(raw.shape[0])) if layers is None else list(layers)
    reference.expert_histogram(raw, lay, rp, want[0], want[1] if probs is not None else None, want[2])
    assert_counts_equal(got[0], want[0], "load")
    assert_counts_equal(got[2], want[2], "bad")
    assert_sums_close(got[1], want[1], "gate", rtol=1e-11)
    return got


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("shape,E", [((1, 0, 2), 3), ((1, 1, 1), 1), ((3, 123, 2), 5), ((2, 5000, 8), 128),
                                     ((5, 7, 3), 4097)])
def test_random(backend, dtype, shape, E):
    L = shape[0] + 2
    idx = torch.randint(-1, E, shape, dtype=dtype)
    layers = list(range(L - 1, L - 1 - shape[0], -1))  # reversed and offset: rows land on other layers
    run_and_compare(backend, idx, layers, L, E)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_long_rows_bad_slots_everywhere(backend, dtype):
    # rows longer than the CPU loop's prefetch distance, of lengths that are no
    # multiple of its unroll, with bad and dropped slots at the start, inside and in the tail
    E = 50
    idx = torch.randint(-1, E, (3, 4099), dtype=dtype)
    idx.view(-1)[::97] = E
    idx.view(-1)[5::211] = -7
    idx[:, -3:] = torch.tensor([E + 1, -1, 2**30], dtype=dtype)
    idx[1] = 7  # one expert takes a whole row
    got = run_and_compare(backend, idx, [2, 0, 1], 3, E)
    assert got[0][0, 7].item() == 4099


def test_adversarial(backend):
    E, T, k = 6, 300, 2
    one = torch.full((1, T, k), 4)  # one expert takes all
    got = run_and_compare(backend, one, [1], 3, E)
    assert got[0][1].tolist() == [0, 0, 0, 0, T * k, 0] and got[0][[0, 2]].sum() == 0
    uniform = torch.arange(T * k).remainder(E).reshape(1, T, k)
    got = run_and_compare(backend, uniform, [0], 1, E)
    assert got[0].tolist() == [[T * k / E] * E]
    dropped = torch.full((2, T, k), -1)
    got = run_and_compare(backend, dropped, None, 2, E)
    assert got[0].sum() == 0 and got[2].item() == 0
    bad = torch.tensor([[[E, -2], [2**40, -(2**40)], [0, -1]]])
    got = run_and_compare(backend, bad, [0], 1, E)
    assert got[2].item() == 4 and got[0].sum() == 1
    # int32 extremes, a repeated layer id, a non-zero start state
    ext = torch.tensor([[2**31 - 1, -(2**31), 3], [3, 3, -1]], dtype=torch.int32)
    start = (torch.arange(2 * E, dtype=torch.float64).reshape(2, E), torch.ones(2, E + 1, dtype=torch.float64))
    got = run_and_compare(backend, ext, [1, 1], 2, E, start=start)
    assert got[2].item() == 2 and got[0][1, 3].item() == E + 3 + 3


def test_noncontiguous_and_floats(backend):
    E = 9
    base = torch.randint(-1, E, (4, 40, 6))
    run_and_compare(backend, base[:, ::3, ::2], [3, 0, 2, 1], 4, E)  # strided rows
    run_and_compare(backend, base.transpose(0, 1)[:, :2].transpose(0, 1), [0, 1], 2, E)
    f = torch.tensor([[0.0, 1.0, 2.5, float("nan"), -1.0]])  # floats: not whole -> bad; -1.0 dropped
    got = run_and_compare(backend, f, [0], 1, E)
    assert got[2].item() == 2 and got[0].sum() == 2


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_gate(backend, dtype):
    L, E, T, k = 3, 7, 61, 2
    logits = torch.randn(2, T, E)
    probs = torch.softmax(logits, -1).to(dtype)
    idx = logits.topk(k, -1).indices
    got = run_and_compare(backend, idx, [2, 0], L, E, probs=probs)
    assert got[1][:, E].tolist() == [T, 0, T]
    # one layer: [T, E] probs with [T, k] indices as one row; strided probs
    run_and_compare(backend, idx[0][None], [1], L, E, probs=probs[0])
    wide = torch.rand(2, T, 2 * E).to(dtype)
    run_and_compare(backend, idx, [0, 1], L, E, probs=wide[..., ::2])
    nan = probs.clone()
    nan[0, 3, 1] = float("nan")
    got = run_and_compare(backend, idx, [0, 1], L, E, probs=nan)
    assert torch.isnan(got[1][0, 1]) and not torch.isnan(got[1][1]).any()


# ---- contracts: opcheck, torch.compile, bad input ----------------------------------------


@needs_cpp
def test_opcheck():
    op = torch.ops.d9d_kernels.expert_histogram.default
    idx = torch.randint(-1, 5, (2, 30))
    torch.library.opcheck(op, (idx, [1, 0], None, f64(3, 5), None, f64(1)))
    torch.library.opcheck(op, (idx.int(), [2, 2], torch.rand(2, 15, 5), f64(3, 5), f64(3, 6), f64(1)))


@pytest.mark.parametrize("impl", ["cpp", "torch"])
def test_compile_matches_eager(impl):
    if impl not in dk.ops.backends():
        pytest.skip(f"{impl} not available")
    idx, probs = torch.randint(-1, 6, (2, 20, 2)), torch.rand(2, 20, 6)

    def fn(load, gate, bad):
        dk.ops.expert_histogram(idx, [2, 0], probs, load=load, gate=gate, bad=bad, backend=impl)

    assert_compiled_matches_eager(fn, lambda: (f64(3, 6), f64(3, 7), f64(1)))


def test_bad_input(backend):
    op = "expert_histogram"
    idx = torch.randint(0, 4, (2, 10))
    ld, gt, bd = f64(3, 4), f64(3, 5), f64(1)
    states = [ld, gt, bd]

    def call(**kw):
        args = {**dict(indices=idx, layers=[0, 1], probs=None, load=ld, gate=gt, bad=bd, backend=backend), **kw}
        dk.ops.expert_histogram(args.pop("indices"), args.pop("layers"), args.pop("probs"), **args)

    assert_rejects(lambda: call(layers=[0]), op, "layers", states)
    assert_rejects(lambda: call(layers=[0, 3]), op, "layers", states)
    assert_rejects(lambda: call(layers=[0, -1]), op, "layers", states)
    assert_rejects(lambda: call(layers=torch.tensor([0.0, 1.0])), op, "layers", states)
    assert_rejects(lambda: call(load=f64(3, 4)[:, :3]), op, "load", states)
    assert_rejects(lambda: call(load=torch.zeros(3, 4)), op, "load", states)
    assert_rejects(lambda: call(probs=torch.rand(2, 5, 3)), op, "probs", states)
    assert_rejects(lambda: call(probs=torch.rand(2, 5, 4), gate=None), op, "gate", states)
    assert_rejects(lambda: call(probs=torch.rand(2, 5, 4), gate=f64(3, 4)), op, "gate", states)
    assert_rejects(lambda: call(bad=f64(2)), op, "bad", states)
    assert_rejects(lambda: call(indices=torch.zeros(2, 3, dtype=torch.complex64)), op, "indices", states)


@needs_cpp
def test_bad_input_direct_op():
    op = "expert_histogram"
    ld, bd = f64(3, 4), f64(1)
    call = torch.ops.d9d_kernels.expert_histogram
    assert_rejects(lambda: call(torch.zeros(2, 3, dtype=torch.int16), [0, 1], None, ld, None, bd), op, "indices",
                   [ld, bd])
    assert_rejects(lambda: call(torch.zeros(2, 3, 1, dtype=torch.long), [0, 1], None, ld, None, bd), op, "indices",
                   [ld, bd])
    assert_rejects(lambda: call(torch.zeros(2, 3, dtype=torch.long), [0, 1], None, ld.to("meta"), None, bd), op,
                   "load", [bd])


@pytest.mark.gpu
@pytest.mark.parametrize("backend_gpu", ["cuda", "triton"])
@pytest.mark.parametrize("shape,E", [((48, 8192, 8), 128), ((1, 1_000_003, 1), 7), ((3, 77, 2), 5000)])
def test_cuda_matches_reference(backend_gpu, shape, E):
    if backend_gpu not in dk.ops.backends() and not (backend_gpu == "triton" and dk._extension.HAS_TRITON):
        pytest.skip(f"{backend_gpu} not available")
    L = shape[0] + 1
    idx = torch.randint(-1, E, shape)
    idx.view(-1)[:: 997] = E + 3  # bad
    probs = torch.rand(shape[0], min(shape[1], 4096), E)
    want = [f64(L, E), f64(L, E + 1), f64(1)]
    lay = list(range(1, L))
    reference.expert_histogram(idx.reshape(shape[0], -1), lay, None, want[0], None, want[2])
    reference.expert_histogram(idx[:, :0].reshape(shape[0], 0), lay, probs, f64(L, E), want[1], f64(1))
    got = [t.cuda() for t in (f64(L, E), f64(L, E + 1), f64(1))]
    dk.ops.expert_histogram(idx.cuda(), lay, None, load=got[0], bad=got[2], backend=backend_gpu)
    dk.ops.expert_histogram(idx[:, :0].cuda(), lay, probs.cuda(), load=f64(L, E).cuda(), gate=got[1], bad=f64(1).cuda(),
                            backend=backend_gpu)
    assert_counts_equal(got[0].cpu(), want[0], "load")
    assert_counts_equal(got[2].cpu(), want[2], "bad")
    assert_sums_close(got[1].cpu(), want[1], "gate", rtol=1e-10)
