"""moments_recenter / moments_center: the specification against sums and means
computed directly with numpy, and every compiled kernel against the specification."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from d9d_kernels import _extension, reference
from d9d_kernels.ops import moments_pivot

NAN = float("nan")
F64 = torch.float64


def direct_sums(x, y, w, px, py):
    """reference.MOMENTS of (x, y, w) about (px, py), straight from the definitions (numpy)."""
    dx, dy = x - px, y - py
    return np.array([w.sum(), (w * dx).sum(), (w * dx * dx).sum(), (w * dy).sum(), (w * dy * dy).sum(),
                     (w * dx * dy).sum(), (w * np.abs(x - y)).sum(), (w * (x - y) ** 2).sum(), float(len(x))])


def entries(n_entries: int, seed: int, scale=1.0, shift=0.0):
    """Per entry: data, its sums about a pivot within it (NaN = 0 for some y), and the pivots."""
    rng = np.random.default_rng(seed)
    data, sums, pivots = [], [], []
    for e in range(n_entries):
        n = int(rng.integers(1, 40))
        x = rng.normal(shift, scale, n) + e
        y = rng.normal(0.0, scale, n)  # about 0: an unset (NaN = 0) y pivot is within it
        w = rng.random(n)
        p = np.array([rng.normal(shift + e, scale), rng.normal(0.0, scale)])
        if e % 3 == 1:
            p[1] = NAN
        sums.append(direct_sums(x, y, w, np.nan_to_num(p[0]), np.nan_to_num(p[1])))
        data.append((x, y, w))
        pivots.append(p)
    return data, torch.tensor(np.array(sums)), torch.tensor(np.array(pivots))


def scattered(sums, pivots, paired, seed):
    """The entries placed at shuffled offsets of larger flat buffers, with junk between them
    (as a storage interleaves statistics), and the table that addresses them."""
    rng = np.random.default_rng(seed)
    B = len(sums)
    order = rng.permutation(B)
    flat_s, flat_p = torch.full((B * 12 + 5,), 123.0, dtype=F64), torch.full((B * 3 + 1,), -7.0, dtype=F64)
    rows = []
    for k, e in enumerate(order):
        mo, po = 5 + 12 * k, 1 + 3 * k
        flat_s[mo:mo + 9], flat_p[po:po + 2] = sums[e], pivots[e]
        rows.append((e, mo, po))
    rows.sort()
    table = torch.tensor([(mo, po, int(paired)) for _, mo, po in rows], dtype=torch.int64)
    return flat_s, flat_p, table


def impls(name):
    out = [pytest.param(getattr(reference, name), id="torch")]
    if _extension.CPP_ERROR is None and _extension._has_kernel(name, "CPU"):
        out.append(pytest.param(getattr(torch.ops.d9d_kernels, name).default, id="cpp"))
    return out


def gather(flat, table, col, n):
    return torch.stack([flat[o:o + n] for o in table[:, col].tolist()])


@pytest.mark.parametrize("recenter", impls("moments_recenter"))
def test_recenter_equals_direct_sums_about_the_new_pivot(recenter):
    data, sums, pivots = entries(7, seed=1, scale=3.0, shift=2.0)
    new = torch.tensor(np.random.default_rng(2).normal(0, 5, (7, 2)))
    new[2, 0] = NAN  # NaN = sums about 0
    flat_s, flat_p, table = scattered(sums, pivots, True, seed=3)
    flat_new = flat_p.clone()
    for e, po in enumerate(table[:, 1].tolist()):
        flat_new[po:po + 2] = new[e]
    junk_s, junk_p = flat_s.clone(), flat_p.clone()
    recenter(flat_s, flat_p, flat_new, table)
    got_p = gather(flat_p, table, 1, 2)
    assert torch.equal(got_p.isnan(), new.isnan()) and torch.equal(got_p.nan_to_num(), new.nan_to_num())
    for e, (x, y, w) in enumerate(data):
        want = direct_sums(x, y, w, *np.nan_to_num(new[e].numpy()))
        np.testing.assert_allclose(gather(flat_s, table, 0, 9)[e].numpy(), want, rtol=1e-11, atol=1e-9)
    touched = torch.zeros_like(flat_s, dtype=torch.bool)
    for mo in table[:, 0].tolist():
        touched[mo:mo + 9] = True
    assert torch.equal(flat_s[~touched], junk_s[~touched])  # nothing outside the table's entries moves
    assert (flat_p == -7.0).sum() == (junk_p == -7.0).sum()


@pytest.mark.parametrize("recenter", impls("moments_recenter"))
def test_recenter_of_consecutive_entries_and_empty_ones(recenter):
    _, sums, pivots = entries(6, seed=3)
    sums[4] = 0.0  # no data: stays 0 whatever the shift
    want_s, want_p = sums.clone().reshape(-1), pivots.clone().reshape(-1)
    new = torch.full((12,), 7.5, dtype=F64)
    table = moments_pivot.consecutive(6, False, torch.device("cpu"))
    reference.moments_recenter(want_s, want_p, new, table)
    got_s, got_p = sums.reshape(-1).clone(), pivots.reshape(-1).clone()
    recenter(got_s, got_p, new, table)
    torch.testing.assert_close(got_s, want_s, rtol=1e-14, atol=1e-12)
    assert torch.equal(got_s.view(6, 9)[4], torch.zeros(9, dtype=F64)) and torch.equal(got_p, new)


@pytest.mark.parametrize("center", impls("moments_center"))
@pytest.mark.parametrize("paired", [True, False])
def test_center_is_the_weighted_mean_where_there_is_data(center, paired):
    data, sums, pivots = entries(5, seed=4, scale=2.0, shift=1e3)
    sums[3] = 0.0  # an entry without data keeps its centre
    flat_s, flat_p, table = scattered(sums, pivots, paired, seed=5)
    centre, off = torch.full_like(flat_p, 11.0), torch.zeros(1, dtype=torch.bool)
    center(flat_s, flat_p, table, 1e3, centre, off)
    got = gather(centre, table, 1, 2)
    for e, (x, y, w) in enumerate(data):
        if e == 3:
            assert got[e].tolist() == [11.0, 11.0]
            continue
        assert got[e, 0].item() == pytest.approx(np.average(x, weights=w), rel=1e-13)
        if paired:
            assert got[e, 1].item() == pytest.approx(np.average(y, weights=w), rel=1e-13)
        else:
            assert got[e, 1].item() == 11.0
    assert not off.item()  # pivots within the data's own spread


@pytest.mark.parametrize("center", impls("moments_center"))
def test_center_flags_sums_about_a_far_pivot_and_never_clears_the_flag(center):
    rng = np.random.default_rng(5)
    x, y, w = rng.normal(0, 1, 30), rng.normal(0, 1, 30), rng.random(30)
    table = torch.tensor([[0, 0, 1]])
    near = torch.tensor(direct_sums(x, y, w, 0.1, -0.2))
    far = torch.tensor(direct_sums(x, y, w, 1e7, 0.0))  # |d| + |p| ~ 2e7 against |mean| + std ~ 1
    for sums, piv, want in ((near, [0.1, -0.2], False), (far, [1e7, 0.0], True)):
        off = torch.zeros(1, dtype=torch.bool)
        center(sums, torch.tensor(piv, dtype=F64), table, 1e3, torch.zeros(2, dtype=F64), off)
        assert off.item() is want
    off = torch.ones(1, dtype=torch.bool)
    center(near, torch.tensor([0.1, -0.2], dtype=F64), table, 1e3, torch.zeros(2, dtype=F64), off)
    assert off.item()


@pytest.mark.parametrize("center", impls("moments_center"))
def test_center_of_non_finite_sums_is_never_written_or_flagged(center):
    sums = torch.tensor([2.0, NAN, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0,
                         2.0, float("inf"), 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0], dtype=F64)
    centre, off = torch.full((4,), 3.0, dtype=F64), torch.zeros(1, dtype=torch.bool)
    center(sums, torch.zeros(4, dtype=F64), moments_pivot.consecutive(2, False, torch.device("cpu")), 1e3, centre, off)
    assert torch.equal(centre, torch.full((4,), 3.0, dtype=F64)) and not off.item()


@pytest.mark.skipif(not _extension._has_kernel("moments_center", "CPU"), reason="extension not built")
def test_bad_arguments_name_the_op_and_the_argument():
    f64 = lambda *s: torch.zeros(*s, dtype=F64)  # noqa: E731
    op, t = torch.ops.d9d_kernels, torch.tensor([[0, 0, 1]])
    with pytest.raises(ValueError, match="moments_recenter: argument 'sums'"):
        op.moments_recenter(f64(2, 9), f64(2), f64(2), t)
    with pytest.raises(ValueError, match="moments_recenter: argument 'new_pivots'"):
        op.moments_recenter(f64(9), f64(2), f64(3), t)
    with pytest.raises(ValueError, match="moments_recenter: argument 'table' row 0 = \\(4, 0\\) is outside"):
        op.moments_recenter(f64(9), f64(2), f64(2), torch.tensor([[4, 0, 0]]))
    with pytest.raises(TypeError, match="moments_center: argument 'pivots'"):
        op.moments_center(f64(9), torch.zeros(2), t, 1e3, f64(2), torch.zeros(1, dtype=torch.bool))
    with pytest.raises(TypeError, match="moments_center: argument 'off'"):
        op.moments_center(f64(9), f64(2), t, 1e3, f64(2), f64(1))
    s = f64(9)
    with pytest.raises(ValueError, match="table"):
        op.moments_recenter(s, f64(2), f64(2), torch.tensor([[0, 0, 0], [9, 0, 0]]))
    assert torch.equal(s, f64(9))  # a bad row anywhere: nothing written


@pytest.mark.gpu
def test_cuda_kernels_match_the_specification():
    if not torch.cuda.is_available() or not _extension._has_kernel("moments_recenter", "CUDA"):
        pytest.skip("no CUDA kernels here")
    _, sums, pivots = entries(300, seed=6, scale=4.0, shift=50.0)  # more entries than one block
    flat_s, flat_p, table = scattered(sums, pivots, True, seed=8)
    table[::2, 2] = 0
    new = flat_p + torch.tensor(np.random.default_rng(7).normal(0, 9, flat_p.shape))
    want_s, want_p = flat_s.clone(), flat_p.clone()
    reference.moments_recenter(want_s, want_p, new, table)
    got_s, got_p = flat_s.cuda(), flat_p.cuda()
    moments_pivot.moments_recenter(got_s, got_p, new.cuda(), table.cuda())
    torch.testing.assert_close(got_s.cpu(), want_s, rtol=1e-14, atol=1e-12)
    assert torch.equal(got_p.cpu().nan_to_num(), want_p.nan_to_num())
    c_want, o_want = torch.zeros_like(want_p), torch.zeros(1, dtype=torch.bool)
    reference.moments_center(want_s, want_p, table, 1.0, c_want, o_want)
    c_got, o_got = torch.zeros_like(got_p), torch.zeros(1, dtype=torch.bool, device="cuda")
    moments_pivot.moments_center(got_s, got_p, table.cuda(), 1.0, c_got, o_got)
    torch.testing.assert_close(c_got.cpu(), c_want, rtol=1e-14, atol=0)
    assert o_got.item() == o_want.item()
