"""moments_recenter / moments_center: the specification against sums and means
computed directly with numpy, and every compiled kernel against the specification."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from d9d_kernels import _extension, reference
from d9d_kernels.ops import moments_pivot

NAN = float("nan")


def direct_sums(x, y, w, px, py):
    """reference.MOMENTS of (x, y, w) about (px, py), straight from the definitions (numpy)."""
    dx, dy = x - px, y - py
    return np.array([w.sum(), (w * dx).sum(), (w * dx * dx).sum(), (w * dy).sum(), (w * dy * dy).sum(),
                     (w * dx * dy).sum(), (w * np.abs(x - y)).sum(), (w * (x - y) ** 2).sum(), float(len(x))])


def entries(n_entries: int, seed: int, scale=1.0, shift=0.0):
    """Per entry: data, its sums about a random pivot (NaN = 0 for some), and the pivots."""
    rng = np.random.default_rng(seed)
    data, sums, pivots = [], [], []
    for e in range(n_entries):
        n = int(rng.integers(1, 40))
        x = rng.normal(shift, scale, n) + e
        y = rng.normal(0.0, scale, n)  # about 0: an unset (NaN = 0) y pivot is within it
        w = rng.random(n)
        p = np.array([rng.normal(shift + e, scale), rng.normal(0.0, scale)])  # within the data
        if e % 3 == 1:
            p[1] = NAN
        sums.append(direct_sums(x, y, w, np.nan_to_num(p[0]), np.nan_to_num(p[1])))
        data.append((x, y, w))
        pivots.append(p)
    return data, torch.tensor(np.array(sums)), torch.tensor(np.array(pivots))


def impls(name):
    out = [pytest.param(getattr(reference, name), id="torch")]
    if _extension.CPP_ERROR is None and _extension._has_kernel(name, "CPU"):
        out.append(pytest.param(getattr(torch.ops.d9d_kernels, name).default, id="cpp"))
    return out


@pytest.mark.parametrize("recenter", impls("moments_recenter"))
def test_recenter_equals_direct_sums_about_the_new_pivot(recenter):
    data, sums, pivots = entries(7, seed=1, scale=3.0, shift=2.0)
    new = torch.tensor(np.random.default_rng(2).normal(0, 5, (7, 2)))
    new[2, 0] = NAN  # NaN = sums about 0
    recenter(sums, pivots, new)
    assert torch.equal(pivots.isnan(), new.isnan()) and torch.equal(pivots.nan_to_num(), new.nan_to_num())
    for e, (x, y, w) in enumerate(data):
        want = direct_sums(x, y, w, *np.nan_to_num(new[e].numpy()))
        np.testing.assert_allclose(sums[e].numpy(), want, rtol=1e-11, atol=1e-9)


@pytest.mark.parametrize("recenter", impls("moments_recenter"))
def test_recenter_takes_leading_dims_and_leaves_empty_entries_empty(recenter):
    _, sums, pivots = entries(6, seed=3)
    sums[4] = 0.0  # no data: stays 0 whatever the shift
    sums, pivots = sums.reshape(2, 3, 9).clone(), pivots.reshape(2, 3, 2).clone()
    want_s, want_p = sums.clone(), pivots.clone()
    new = torch.full((2, 3, 2), 7.5, dtype=torch.float64)
    reference.moments_recenter(want_s, want_p, new)
    recenter(sums, pivots, new)
    torch.testing.assert_close(sums, want_s, rtol=1e-14, atol=1e-12)
    assert torch.equal(sums[1, 1], torch.zeros(9, dtype=torch.float64)) and torch.equal(pivots, new)


@pytest.mark.parametrize("center", impls("moments_center"))
@pytest.mark.parametrize("paired", [True, False])
def test_center_is_the_weighted_mean_where_there_is_data(center, paired):
    data, sums, pivots = entries(5, seed=4, scale=2.0, shift=1e3)
    sums[3] = 0.0  # an entry without data keeps its centre
    before = torch.tensor([[11.0, 12.0]] * 5, dtype=torch.float64)
    centre, off = before.clone(), torch.zeros(1, dtype=torch.bool)
    center(sums, pivots, paired, 1e3, centre, off)
    for e, (x, y, w) in enumerate(data):
        if e == 3:
            assert torch.equal(centre[e], before[e])
            continue
        assert centre[e, 0].item() == pytest.approx(np.average(x, weights=w), rel=1e-13)
        if paired:
            assert centre[e, 1].item() == pytest.approx(np.average(y, weights=w), rel=1e-13)
        else:
            assert centre[e, 1].item() == 12.0
    assert not off.item()  # pivots drawn from the data's own scale


@pytest.mark.parametrize("center", impls("moments_center"))
def test_center_flags_sums_about_a_far_pivot_and_never_clears_the_flag(center):
    rng = np.random.default_rng(5)
    x, y, w = rng.normal(0, 1, 30), rng.normal(0, 1, 30), rng.random(30)
    near = torch.tensor(direct_sums(x, y, w, 0.1, -0.2))[None]
    far = torch.tensor(direct_sums(x, y, w, 1e7, 0.0))[None]  # |d| + |p| ~ 2e7 against |mean| + std ~ 1
    for sums, piv, want in ((near, [[0.1, -0.2]], False), (far, [[1e7, 0.0]], True)):
        off = torch.zeros(1, dtype=torch.bool)
        center(sums, torch.tensor(piv, dtype=torch.float64), True, 1e3, torch.zeros(1, 2, dtype=torch.float64), off)
        assert off.item() is want
    off = torch.ones(1, dtype=torch.bool)
    center(near, torch.tensor([[0.1, -0.2]], dtype=torch.float64), True, 1e3, torch.zeros(1, 2, dtype=torch.float64), off)
    assert off.item()


@pytest.mark.parametrize("center", impls("moments_center"))
def test_center_of_non_finite_sums_is_never_written_or_flagged(center):
    sums = torch.tensor([[2.0, NAN, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0],
                         [2.0, float("inf"), 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]], dtype=torch.float64)
    centre, off = torch.full((2, 2), 3.0, dtype=torch.float64), torch.zeros(1, dtype=torch.bool)
    center(sums, torch.zeros(2, 2, dtype=torch.float64), False, 1e3, centre, off)
    assert torch.equal(centre, torch.full((2, 2), 3.0, dtype=torch.float64)) and not off.item()


@pytest.mark.skipif(not _extension._has_kernel("moments_center", "CPU"), reason="extension not built")
def test_bad_arguments_name_the_op_and_the_argument():
    f64 = lambda *s: torch.zeros(*s, dtype=torch.float64)  # noqa: E731
    op = torch.ops.d9d_kernels
    with pytest.raises(ValueError, match="moments_recenter: argument 'moments'"):
        op.moments_recenter(f64(2, 8), f64(2, 2), f64(2, 2))
    with pytest.raises(ValueError, match="moments_recenter: argument 'new_pivot'"):
        op.moments_recenter(f64(2, 9), f64(2, 2), f64(3, 2))
    with pytest.raises(TypeError, match="moments_center: argument 'pivot'"):
        op.moments_center(f64(1, 9), torch.zeros(1, 2), True, 1e3, f64(1, 2), torch.zeros(1, dtype=torch.bool))
    with pytest.raises(TypeError, match="moments_center: argument 'off'"):
        op.moments_center(f64(1, 9), f64(1, 2), True, 1e3, f64(1, 2), f64(1))


@pytest.mark.gpu
def test_cuda_kernels_match_the_specification():
    if not torch.cuda.is_available() or not _extension._has_kernel("moments_recenter", "CUDA"):
        pytest.skip("no CUDA kernels here")
    _, sums, pivots = entries(300, seed=6, scale=4.0, shift=50.0)  # more entries than one block
    new = torch.tensor(np.random.default_rng(7).normal(0, 9, (300, 2)))
    want_s, want_p = sums.clone(), pivots.clone()
    reference.moments_recenter(want_s, want_p, new)
    got_s, got_p = sums.cuda(), pivots.cuda()
    moments_pivot.moments_recenter(got_s, got_p, new.cuda())
    torch.testing.assert_close(got_s.cpu(), want_s, rtol=1e-14, atol=1e-12)
    assert torch.equal(got_p.cpu(), want_p)
    for paired in (True, False):
        c_want, o_want = torch.zeros(300, 2, dtype=torch.float64), torch.zeros(1, dtype=torch.bool)
        reference.moments_center(want_s, want_p, paired, 1.0, c_want, o_want)
        c_got, o_got = torch.zeros(300, 2, dtype=torch.float64, device="cuda"), torch.zeros(1, dtype=torch.bool, device="cuda")
        moments_pivot.moments_center(got_s, got_p, paired, 1.0, c_got, o_got)
        torch.testing.assert_close(c_got.cpu(), c_want, rtol=1e-14, atol=0)
        assert o_got.item() == o_want.item()
