"""Helpers shared by tests/ops: state factories, comparisons, adversarial inputs."""

from __future__ import annotations

import torch

FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def f64(*shape, fill: float = 0.0) -> torch.Tensor:
    return torch.full(shape, fill, dtype=torch.float64)


def assert_counts_equal(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    """Exact equality (counts are integers in float64), NaN == NaN."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    if not bool(same.all()):
        bad = (~same).nonzero()[:5].tolist()
        raise AssertionError(f"{what}: counts differ at {bad}: got {got.flatten()[:20]}, want {want.flatten()[:20]}")


def assert_sums_close(got: torch.Tensor, want: torch.Tensor, what: str = "", rtol: float = 1e-10) -> None:
    """float64 sums agree to rounding; atol scales with the largest magnitude."""
    scale = float(torch.nan_to_num(want, nan=0.0, posinf=0.0, neginf=0.0).abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * (1.0 + scale), equal_nan=True, msg=lambda m: f"{what}: {m}")


def sprinkle(x: torch.Tensor, frac: float = 0.05, values=(float("nan"), float("inf"), float("-inf"))) -> torch.Tensor:
    """A copy of x with about `frac` of the entries replaced by `values`."""
    x = x.clone()
    flat = x.view(-1)
    n = flat.numel()
    if n == 0:
        return x
    k = max(1, int(n * frac))
    idx = torch.randperm(n)[:k]
    vals = torch.tensor(values, dtype=x.dtype)[torch.randint(len(values), (k,))]
    flat[idx] = vals
    return x


def noncontig(x: torch.Tensor) -> torch.Tensor:
    """Same values, non-contiguous storage (every other element of a 2x buffer)."""
    buf = torch.empty((*x.shape[:-1], x.shape[-1] * 2) if x.dim() else (2,), dtype=x.dtype)
    if x.dim() == 0:
        return x
    buf[..., ::2] = x
    out = buf[..., ::2]
    assert not out.is_contiguous() or x.numel() <= 1
    return out


# ---- contract helpers: opcheck, torch.compile, bad input ---------------------------------

import pytest  # noqa: E402

import d9d_kernels as dk  # noqa: E402

needs_cpp = pytest.mark.skipif("cpp" not in dk.ops.backends(), reason="compiled extension d9d_kernels._C not built")


def assert_rejects(fn, op: str, arg: str, states) -> None:
    """fn() raises an error naming the op and the argument; `states` are unchanged."""
    before = [s.clone() for s in states if s is not None and s.device.type != "meta"]
    with pytest.raises((ValueError, TypeError, RuntimeError)) as ei:
        fn()
    msg = str(ei.value)
    assert f"d9d_kernels.{op}" in msg and f"'{arg}'" in msg, msg
    after = [s for s in states if s is not None and s.device.type != "meta"]
    for a, b in zip(after, before):
        assert_counts_equal(a, b, f"state changed by a rejected call ({arg})")


def assert_compiled_matches_eager(fn, make_args) -> None:
    """fn(*args) under torch.compile(fullgraph=True) leaves the same state as eager."""
    torch._dynamo.reset()
    eager, compiled = make_args(), make_args()
    fn(*eager)
    torch.compile(fn, fullgraph=True)(*compiled)
    for a, b in zip(eager, compiled):
        if isinstance(a, torch.Tensor) and a.dtype == torch.float64:
            assert_sums_close(b, a, "compiled vs eager", rtol=1e-12)
