"""group_values (csrc/kernels/group_values.h): each program row's value equals
the catalogue's torch formulas (d9d_kernels/metrics/formulas/classification.py,
themselves tested against scikit-learn) evaluated on the same counts, for every
formula, average, layout and absent-class rule, on random and adversarial
counts (empty classes, nothing seen, NaN propagation, NaN/Inf pivots, Σw = 0);
rows pointing outside the buffers give NaN, bad arguments a clear error."""

from __future__ import annotations

import itertools

import pytest
import torch

from d9d_kernels.metrics.formulas import classification as F
from d9d_kernels.ops import group_values as GV
from tests.ops.op_utils import needs_cpp

pytestmark = needs_cpp

_FORMULAS = {GV.ACCURACY: F.accuracy, GV.PRECISION: F.precision, GV.RECALL: F.recall, GV.FBETA: F.fbeta,
             GV.SPECIFICITY: F.specificity, GV.JACCARD: F.jaccard}
_AVG_NAMES = {v: k for k, v in GV.AVERAGES.items()}


def _reference(sum_buf, max_buf, replica, program, beta2) -> list[torch.Tensor]:
    """Per program row, its value by the torch formulas (or NaN where it reads out of bounds)."""
    out = []
    for r, b2 in zip(program.tolist(), beta2.tolist()):
        code, avg, layout, rule, C, off, count, nf, _ = r
        if code in (GV.MEAN, GV.SUM):
            w, sx = sum_buf[off], sum_buf[off + 1]
            px = torch.nan_to_num(replica[count], nan=0.0)
            mean = torch.where(w == 0, torch.full_like(sx, float("nan")), sx / w + px)  # NaN when Σw = 0
            out.append(mean if code == GV.MEAN else sx + w * px)
            continue
        if code in (GV.MAX, GV.MIN):
            out.append(max_buf[off] if code == GV.MAX else -max_buf[off])
            continue
        if code == GV.CONFMAT:  # the [C, C] counts as they are, NaN once a prediction was non-finite
            v = sum_buf[off : off + C * C]
            out.append(torch.full_like(v, float("nan")) if nf >= 0 and sum_buf[nf] > 0 else v)
            continue
        if layout == GV.CLASS_ROWS:
            st = sum_buf[off : off + 3 * C].view(3, C)
            tp, fp, fn = st[0], st[1] - st[0], st[2] - st[0]
            tn = sum_buf[count] - tp - fp - fn
        else:
            st = sum_buf[off : off + 4 * C].view(C, 4)
            tp, fp, tn, fn = st[:, 0], st[:, 1], st[:, 2], st[:, 3]
        kw = dict(average=_AVG_NAMES[avg], multilabel=layout == GV.LABEL_ROWS, top_k=2 if rule else 1)
        f = _FORMULAS[code]
        v = f(tp, fp, tn, fn, beta=b2 ** 0.5, **kw) if code == GV.FBETA else f(tp, fp, tn, fn, **kw)
        if nf >= 0 and sum_buf[nf] > 0:
            v = torch.full_like(v, float("nan"))
        out.append(v)
    return out


def _out_len(r) -> int:
    if r[0] == GV.CONFMAT:
        return r[4] * r[4]
    return r[4] if r[0] >= GV.ACCURACY and r[1] == GV.AVERAGES["none"] else 1


def _run(sum_buf, max_buf, replica, rows, beta2, device="cpu"):
    """The op's outputs split per row (out offsets assigned in order)."""
    program, pos = [], 0
    for r in rows:
        program.append(r[:-1] + [pos])
        pos += _out_len(r)
    prog = torch.tensor(program, dtype=torch.int64).reshape(-1, len(GV.COLUMNS))
    b2 = torch.tensor(beta2, dtype=torch.float64)
    out = torch.full((pos,), -7.0, dtype=torch.float64)
    to = lambda t: t.to(device)  # noqa: E731
    out_d = to(out)
    GV.group_values(to(sum_buf), to(max_buf), to(replica), to(prog), to(b2), out_d)
    got, p = [], 0
    for r in prog.tolist():
        n = _out_len(r)
        got.append(out_d.cpu()[p : p + n])
        p += n
    return got, prog, b2


def _class_counts(gen, C, absent: int) -> tuple[torch.Tensor, float]:
    """class_stats' [3, C] (tp, predicted, target) of a random batch; ``absent``
    classes never predicted nor targeted, the last kept one never a target
    (the two macro rules differ on it); n = valid rows."""
    n = int(torch.randint(0, 60, (1,), generator=gen))
    keep = max(C - absent, 1)
    pred = torch.randint(0, keep, (n,), generator=gen)
    tgt = torch.randint(0, max(keep - 1, 1), (n,), generator=gen)
    tgt = torch.where(torch.rand(n, generator=gen) < 0.4, pred, tgt)  # some rows right
    st = torch.zeros(3, C, dtype=torch.float64)
    st[0].index_add_(0, tgt[pred == tgt], torch.ones(int((pred == tgt).sum()), dtype=torch.float64))
    st[1].index_add_(0, pred, torch.ones(n, dtype=torch.float64))
    st[2].index_add_(0, tgt, torch.ones(n, dtype=torch.float64))
    return st, float(n)


def _label_counts(gen, L) -> torch.Tensor:
    """binary_stats' [L, 4] (tp, fp, tn, fn), some labels all zero."""
    st = torch.randint(0, 9, (L, 4), generator=gen).to(torch.float64)
    st[torch.rand(L, generator=gen) < 0.2] = 0.0
    return st


@pytest.mark.parametrize("seed", range(6))
def test_every_formula_average_layout_equals_the_torch_formulas(seed):
    gen = torch.Generator().manual_seed(seed)
    parts, rows, beta2 = [torch.zeros(3, dtype=torch.float64)], [], []  # 3 leading pad slots
    pos = 3
    for code, avg, rule in itertools.product(_FORMULAS, GV.AVERAGES.values(), (0, 1)):
        C = int(torch.randint(1, 9, (1,), generator=gen))
        st, n = _class_counts(gen, C, absent=int(torch.randint(0, C, (1,), generator=gen)))
        nf = -1
        if seed % 2 and code == GV.FBETA:  # a propagating NaN: an extra slot with a non-finite count
            nf = pos + 3 * C + 1
        parts += [st.reshape(-1), torch.tensor([n, float(seed % 3 == 0)], dtype=torch.float64)]
        rows.append([code, avg, GV.CLASS_ROWS, rule, C, pos, pos + 3 * C, nf, 0])
        beta2.append(float(torch.rand(1, generator=gen)) * 4 if code == GV.FBETA else 0.0)
        pos += 3 * C + 2
        L = int(torch.randint(1, 7, (1,), generator=gen))
        parts.append(_label_counts(gen, L).reshape(-1))
        rows.append([code, avg, GV.LABEL_ROWS, 0, L, pos, 0, -1, 0])
        beta2.append(0.5 if code == GV.FBETA else 0.0)
        pos += 4 * L
    sum_buf = torch.cat(parts)
    max_buf = torch.tensor([3.5, -1.25, float("-inf"), float("nan")], dtype=torch.float64)
    replica = torch.tensor([0.25, float("nan"), float("inf")], dtype=torch.float64)
    w = torch.tensor([[2.0, 5.0], [0.0, 0.0], [0.0, 3.0], [4.0, -1.0]], dtype=torch.float64).reshape(-1)
    base = sum_buf.numel()
    sum_buf = torch.cat([sum_buf, w])
    for i, (code, rep) in enumerate(itertools.product((GV.MEAN, GV.SUM), range(3))):
        rows.append([code, 0, 0, 0, 1, base + 2 * (i % 4), rep, -1, 0])
        beta2.append(0.0)
    for code, o in itertools.product((GV.MAX, GV.MIN), range(4)):
        rows.append([code, 0, 0, 0, 1, o, 0, -1, 0])
        beta2.append(0.0)
    for C, nf in ((1, -1), (3, -1), (3, 0), (2, 1)):  # confusion matrices over the counts; NaN where sum[nf] > 0
        rows.append([GV.CONFMAT, 0, 0, 0, C, 3 + seed, 0, nf, 0])
        beta2.append(0.0)
    sum_buf[1] = float(seed % 2)  # the second NaN row propagates on odd seeds
    got, prog, b2 = _run(sum_buf, max_buf, replica, rows, beta2)
    want = _reference(sum_buf, max_buf, replica, prog, b2)
    for r, g, w_ in zip(prog.tolist(), got, want):
        torch.testing.assert_close(g, w_.reshape(g.shape), rtol=1e-13, atol=1e-15, equal_nan=True, msg=lambda m, r=r: f"{r}: {m}")


def test_nothing_seen():
    """All-zero counts: scores 0 (zero division), means NaN, as the formulas."""
    sum_buf = torch.zeros(40, dtype=torch.float64)
    rows = [[code, avg, lay, 0, 4, 0, 39, -1, 0] for code in _FORMULAS for avg in GV.AVERAGES.values()
            for lay in (GV.CLASS_ROWS, GV.LABEL_ROWS)]
    rows.append([GV.MEAN, 0, 0, 0, 1, 0, 0, -1, 0])
    replica = torch.zeros(1, dtype=torch.float64)
    got, prog, b2 = _run(sum_buf, torch.zeros(0, dtype=torch.float64), replica, rows, [1.0] * len(rows))
    want = _reference(sum_buf, torch.zeros(0, dtype=torch.float64), replica, prog, b2)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.reshape(g.shape), rtol=0, atol=0, equal_nan=True)
    assert torch.isnan(got[-1]).all()


@pytest.mark.parametrize("bad", [
    [GV.ACCURACY, 1, GV.CLASS_ROWS, 0, 5, 8, 0, -1, 0],  # stats run past the buffer
    [GV.ACCURACY, 1, GV.CLASS_ROWS, 0, 2, -1, 0, -1, 0],  # negative offset
    [GV.ACCURACY, 1, GV.CLASS_ROWS, 0, 2, 0, 99, -1, 0],  # count outside
    [GV.RECALL, 1, GV.LABEL_ROWS, 0, 1 << 61, 0, 0, -1, 0],  # 4 * C overflows
    [GV.PRECISION, 0, GV.CLASS_ROWS, 0, 2, 0, 6, 50, 0],  # non-finite slot outside
    [GV.MEAN, 0, 0, 0, 1, 0, 5, -1, 0],  # pivot outside the replica buffer
    [GV.MAX, 0, 0, 0, 1, 3, 0, -1, 0],  # no such max slot
    [42, 0, 0, 0, 1, 0, 0, -1, 0],  # unknown formula
    [GV.FBETA, 9, GV.CLASS_ROWS, 0, 2, 0, 6, -1, 0],  # unknown average
])
def test_rows_outside_the_buffers_give_nan(bad):
    sum_buf = torch.arange(12, dtype=torch.float64)
    max_buf = torch.zeros(2, dtype=torch.float64)
    replica = torch.zeros(1, dtype=torch.float64)
    prog = torch.tensor([bad, [GV.MAX, 0, 0, 0, 1, 0, 0, -1, 1]], dtype=torch.int64)
    out = torch.full((2,), -7.0, dtype=torch.float64)
    GV.group_values(sum_buf, max_buf, replica, prog, torch.zeros(2, dtype=torch.float64), out)
    assert torch.isnan(out[0]) and out[1] == 0.0  # the good row still runs


def test_row_whose_output_falls_outside_writes_nothing():
    prog = torch.tensor([[GV.ACCURACY, GV.AVERAGES["none"], GV.CLASS_ROWS, 0, 3, 0, 9, -1, 0]], dtype=torch.int64)
    out = torch.full((2,), -7.0, dtype=torch.float64)
    GV.group_values(torch.ones(10, dtype=torch.float64), torch.zeros(0, dtype=torch.float64),
                    torch.zeros(0, dtype=torch.float64), prog, torch.zeros(1, dtype=torch.float64), out)
    assert out.tolist() == [-7.0, -7.0]


@pytest.mark.parametrize("arg", ["sum", "max", "replica", "program", "beta", "out"])
def test_bad_arguments_name_the_argument(arg):
    args = dict(sum=torch.zeros(4, dtype=torch.float64), max=torch.zeros(0, dtype=torch.float64),
                replica=torch.zeros(0, dtype=torch.float64),
                program=torch.tensor([[GV.SUM, 0, 0, 0, 1, 0, 0, -1, 0]], dtype=torch.int64),
                beta=torch.zeros(1, dtype=torch.float64), out=torch.zeros(1, dtype=torch.float64))
    args[arg] = args[arg].to(torch.float32) if arg != "program" else args[arg][:, :4]
    with pytest.raises((TypeError, ValueError), match=rf"d9d_kernels\.group_values: argument '{arg}'"):
        GV.group_values(*args.values())


def test_opcheck():
    sum_buf = torch.arange(20, dtype=torch.float64)
    prog = torch.tensor([[GV.FBETA, 1, GV.CLASS_ROWS, 0, 3, 0, 12, -1, 0], [GV.SUM, 0, 0, 0, 1, 2, 0, -1, 1]],
                        dtype=torch.int64)
    args = (sum_buf, torch.zeros(0, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), prog,
            torch.ones(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64))
    torch.library.opcheck(torch.ops.d9d_kernels.group_values, args)


def test_large_confusion_matrix_rows_split_across_threads():
    """A [300, 300] matrix (several parallel tasks on CPU) is copied whole,
    and a propagating NaN count turns all of it NaN."""
    C = 300
    sum_buf = torch.cat([torch.arange(C * C, dtype=torch.float64), torch.tensor([0.0, 2.0], dtype=torch.float64)])
    empty = torch.zeros(0, dtype=torch.float64)
    rows = [[GV.CONFMAT, 0, 0, 0, C, 0, 0, C * C, 0], [GV.CONFMAT, 0, 0, 0, C, 0, 0, C * C + 1, 0]]
    (kept, nan), _, _ = _run(sum_buf, empty, empty, rows, [0.0, 0.0])
    assert torch.equal(kept, sum_buf[: C * C]) and bool(nan.isnan().all())


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_cuda_equals_cpu(seed):
    """The block-per-row CUDA kernel against the CPU op (sums in another order)."""
    gen = torch.Generator().manual_seed(seed)
    parts, rows, pos = [], [], 0
    for code, avg in itertools.product(_FORMULAS, GV.AVERAGES.values()):
        C = int(torch.randint(1, 3000, (1,), generator=gen))
        st, n = _class_counts(gen, C, absent=C // 3)
        parts += [st.reshape(-1), torch.tensor([n], dtype=torch.float64)]
        rows.append([code, avg, GV.CLASS_ROWS, seed % 2, C, pos, pos + 3 * C, -1, 0])
        pos += 3 * C + 1
    for C, nf in ((1, -1), (70, -1), (40, 0), (40, pos - 1)):  # confusion matrices, one NaN-propagating (n > 0)
        rows.append([GV.CONFMAT, 0, 0, 0, C, 0, 0, nf, 0])
    sum_buf = torch.cat(parts)
    empty = torch.zeros(0, dtype=torch.float64)
    beta2 = [2.0] * len(rows)
    cpu, _, _ = _run(sum_buf, empty, empty, rows, beta2)
    cuda, _, _ = _run(sum_buf, empty, empty, rows, beta2, device="cuda")
    for a, b in zip(cuda, cpu):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15, equal_nan=True)


def test_scalars_equal_unbind_on_strided_and_offset_outputs():
    """GV.scalars (the C++ scalar_views) gives what unbind gives: one 0-d tensor
    per element, at its own offset, for a strided view starting mid-storage."""
    from d9d_kernels import _C

    assert hasattr(_C, "scalar_views")
    base = torch.randn(40, dtype=torch.float64)
    base[5] = float("nan")
    for x in (base, base[3:], base[1::3], base[:0]):
        got, want = GV.scalars(x), x.unbind(0)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.shape == () and a.dtype == b.dtype and a.device == b.device and not a.requires_grad
            assert a.data_ptr() == b.data_ptr()
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    a, b = GV.scalars(base[:2])
    a.add_(1.0)  # a value is its own element: writing one leaves the next alone
    assert b.item() == base[1].item() and a.item() == base[0].item()
    with torch.inference_mode():
        assert all(t.is_inference() for t in GV.scalars(torch.zeros(3, dtype=torch.float64)))


def test_scalar_views_argument_errors():
    from d9d_kernels import _C

    for bad, what in ((torch.zeros(2, 2, dtype=torch.float64), "1-D"),
                      (torch.zeros(2, dtype=torch.float64, requires_grad=True), "without grad")):
        with pytest.raises(RuntimeError, match=f"scalar_views: argument 'x' must be .*{what}"):
            _C.scalar_views(bad)


def test_host_compute_equals_the_dispatched_ops():
    """GV.host_compute (one C++ call) == group_values into a new output, unbind,
    and bad_matrix @ sum[bad_index]; bad arguments raise naming the argument."""
    g = torch.Generator().manual_seed(0)
    sum_buf = torch.randint(0, 50, (60,), generator=g).double()
    sum_buf[7] = float("nan")
    empty = torch.empty(0, dtype=torch.float64)
    program = torch.tensor([[GV.MEAN, 0, 0, 0, 1, 0, 2, -1, 0], [GV.SUM, 0, 0, 0, 1, 4, 1, -1, 1],
                            [GV.MEAN, 0, 0, 0, 1, 6, 2, -1, 2]], dtype=torch.int64)
    beta2 = torch.zeros(3, dtype=torch.float64)
    idx = torch.tensor([3, 9, 3, 40], dtype=torch.int64)
    matrix = torch.tensor([[1.0, 0.0, 2.0, 0.0], [0.0, 1.0, 0.0, 1.0]], dtype=torch.float64)
    vals, out, counts = GV.host_compute(sum_buf, empty, empty, program, beta2, 3, 2, [], idx, matrix)
    want = torch.empty(3, dtype=torch.float64)
    GV.group_values(sum_buf, empty, empty, program, beta2, want)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)
    assert len(vals) == 2 and all(v.shape == () for v in vals)
    torch.testing.assert_close(torch.stack(vals), want[:2], rtol=0, atol=0, equal_nan=True)
    assert counts == (matrix @ sum_buf[idx]).tolist()
    assert GV.host_compute(sum_buf, empty, empty, program, beta2, 3, 0, [], idx[:0], matrix[:, :0])[2] == [0.0, 0.0]
    for kwargs, arg in ((dict(n_scalar=4), "n_scalar"), (dict(idx=torch.tensor([3, 9, 3, 60])), "bad_index"),
                        (dict(idx=idx.int()), "bad_index"), (dict(matrix=matrix[:, :3]), "bad_matrix")):
        a = dict(n_scalar=2, idx=idx, matrix=matrix) | kwargs
        with pytest.raises(RuntimeError, match=f"group_compute: argument '{arg}'"):
            GV.host_compute(sum_buf, empty, empty, program, beta2, 3, a["n_scalar"], [], a["idx"], a["matrix"])
    # vector values after the scalars, with their shapes: a [3, 3] confusion matrix and a [2] vector
    program = torch.tensor([[GV.SUM, 0, 0, 0, 1, 4, 1, -1, 0], [GV.CONFMAT, 0, 0, 0, 3, 10, 0, -1, 1],
                            [GV.RECALL, GV.AVERAGES["none"], GV.LABEL_ROWS, 0, 2, 30, 0, -1, 10]], dtype=torch.int64)
    vals, out, _ = GV.host_compute(sum_buf, empty, empty, program, beta2, 12, 1, [[3, 3], [2]], idx[:0], matrix[:, :0])
    want = torch.empty(12, dtype=torch.float64)
    GV.group_values(sum_buf, empty, empty, program, beta2, want)
    assert [tuple(v.shape) for v in vals] == [(), (3, 3), (2,)]
    for v, w in zip(vals, (want[0], want[1:10].view(3, 3), want[10:])):
        assert v.data_ptr() == out.data_ptr() + (w.data_ptr() - want.data_ptr())
        torch.testing.assert_close(v, w, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vals[1], sum_buf[10:19].view(3, 3), rtol=0, atol=0)
    for shapes in ([[3, 3], [3]], [[-1], [2]]):  # more elements than out has; a negative size
        with pytest.raises(RuntimeError, match="group_compute: "):
            GV.host_compute(sum_buf, empty, empty, program, beta2, 12, 1, shapes, idx[:0], matrix[:, :0])
