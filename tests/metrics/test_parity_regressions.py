"""Values that disagreed silently with torchmetrics 1.9 (issue #35, first part).

Every expected value comes from torchmetrics and/or scikit-learn on the same
inputs, never from d9d_kernels. Each case is checked on ``compute()``, a
``MetricGroup``'s ``compute()``, ``forward`` and ``compute_to_host()``
(one formula, the metric's own ``_compute``, reached four ways).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from sklearn.metrics import explained_variance_score, jaccard_score, r2_score

import d9d_kernels as dk

tm = pytest.importorskip("torchmetrics")


def _every_path(make, *args):
    """The value of ``make()`` on ``args`` by compute(), group compute(),
    forward and compute_to_host(); the group holds Accuracy / Recall members
    on the same inputs so that statistics merge as in real use."""
    m = make()
    m.update(*args)
    fwd = make()
    batch = fwd(*args)
    members = {"m": make()}
    if len(args) == 2 and args[1].dtype == torch.int64:
        kw = dict(task="multiclass", num_classes=members["m"].num_classes, nan_strategy=members["m"].nan_strategy)
        members.update(acc=dk.Accuracy(**kw), rec=dk.Recall(**kw, average="macro"))
    g = dk.MetricGroup(members)
    g.update(*args) if len(members) == 1 else g.update(preds=args[0], target=args[1])
    out = {"compute": m.compute(), "group": g.compute()["m"], "forward": batch, "forward state": fwd.compute(),
           "host": torch.tensor(m.compute_to_host().result(), dtype=torch.float64),
           "group host": torch.tensor(g.compute_to_host().result()["m"], dtype=torch.float64)}
    return out


def _assert_all(got: dict, want, atol=1e-6):
    want = torch.as_tensor(np.asarray(want, dtype=np.float64))
    for path, v in got.items():
        torch.testing.assert_close(v.double().cpu().reshape(want.shape), want, rtol=1e-5, atol=atol, msg=path)


# -- 1. JaccardIndex with ignore_index inside the class range ----------------

JAC_T = torch.tensor([0, 1, 1, 2, 2, 0])
JAC_P = torch.tensor([1, 1, 0, 2, 1, 0])


def test_jaccard_ignore_index_in_range_issue_case():
    for average, want in [("macro", 5 / 12), ("micro", 0.4), ("weighted", 5 / 12), ("none", [0.0, 1 / 3, 0.5])]:
        kw = dict(task="multiclass", num_classes=3, ignore_index=0, average=average)
        theirs = tm.JaccardIndex(**kw)(JAC_P, JAC_T)
        np.testing.assert_allclose(theirs.numpy(), want, atol=1e-6)
        if average in ("macro", "micro"):  # scikit-learn: labels without the ignored class, on the kept rows
            keep = JAC_T != 0
            sk = jaccard_score(JAC_T[keep].numpy(), JAC_P[keep].numpy(), labels=[1, 2], average=average)
            np.testing.assert_allclose(sk, want, atol=1e-12)
        _assert_all(_every_path(lambda: dk.JaccardIndex(**kw), JAC_P, JAC_T), want)  # noqa: B023


CLASS_METRICS = ["JaccardIndex", "Accuracy", "Precision", "Recall", "F1Score", "Specificity"]
AVERAGES = ["micro", "macro", "weighted", "none"]


def test_ignore_index_in_range_matches_torchmetrics_random():
    """Every classification metric with an ignore_index inside the class
    range, on random and adversarial batches (the ignored class predicted,
    absent classes, everything ignored), index and score preds."""
    gen = torch.Generator().manual_seed(0)
    C = 5
    for trial in range(12):
        n = int(torch.randint(1, 40, (1,), generator=gen))
        ign = int(torch.randint(0, C, (1,), generator=gen))
        target = torch.randint(0, C, (n,), generator=gen)
        if trial % 4 == 1:
            target[:] = ign  # every row ignored
        if trial % 4 == 2:
            target[target == (ign + 1) % C] = ign  # a class absent from the target
        scores = torch.randn(n, C, generator=gen)
        if trial % 3 == 0:
            scores[:, ign] += 2.0  # the ignored class predicted often
        preds = scores if trial % 2 else scores.argmax(1)
        for name in CLASS_METRICS:
            for average in AVERAGES:
                kw = dict(task="multiclass", num_classes=C, ignore_index=ign, average=average)
                # no rows left: 0.0 here (docs/metrics.md, "no data"), torchmetrics' JaccardIndex divides 0 by 0
                theirs = torch.nan_to_num(getattr(tm, name)(**kw)(preds, target), nan=0.0)
                got = _every_path(lambda: getattr(dk, name)(**kw), preds, target)  # noqa: B023
                _assert_all(got, theirs.numpy(), atol=1e-6)


# -- 2. R2Score / ExplainedVariance per output column -------------------------


def _randn_32x5():
    torch.manual_seed(0)
    return torch.randn(32, 5), torch.randn(32, 5)


@pytest.mark.parametrize("name, want", [("R2Score", -1.4808), ("ExplainedVariance", -1.4270)])
def test_multioutput_issue_case(name, want):
    x, y = _randn_32x5()
    theirs = getattr(tm, name)()(x, y)
    np.testing.assert_allclose(theirs.item(), want, atol=1e-4)
    _assert_all(_every_path(lambda: getattr(dk, name)(num_outputs=5), x, y), theirs.item())


@pytest.mark.parametrize("name, sk", [("R2Score", r2_score), ("ExplainedVariance", explained_variance_score)])
@pytest.mark.parametrize("multioutput", ["raw_values", "uniform_average", "variance_weighted"])
def test_multioutput_matches_torchmetrics_and_sklearn(name, sk, multioutput):
    gen = torch.Generator().manual_seed(7)
    for M, n in [(2, 3), (3, 17), (4, 40)]:
        x = torch.randn(n, M, generator=gen, dtype=torch.float64)
        y = torch.randn(n, M, generator=gen, dtype=torch.float64) * torch.arange(1, M + 1) + 1e3  # offset, scales
        y[:, 0] = 2.5  # a constant target column: force_finite (0.0)
        half = n // 2
        m = getattr(dk, name)(num_outputs=M, multioutput=multioutput)
        m.update(x[:half], y[:half])
        m.update(x[half:], y[half:])
        want = sk(y.numpy(), x.numpy(), multioutput=multioutput)
        np.testing.assert_allclose(m.compute().numpy(), want, rtol=1e-9, atol=1e-9)
        theirs = getattr(tm, name)(multioutput=multioutput)(x, y)
        np.testing.assert_allclose(m.compute().numpy(), theirs.numpy(), rtol=1e-7, atol=1e-9)


def test_r2_adjusted_matches_torchmetrics():
    x, y = _randn_32x5()
    for adjusted, mo in [(1, "uniform_average"), (3, "raw_values"), (2, "variance_weighted"), (40, "uniform_average")]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torchmetrics warns when it falls back (adjusted >= n - 1)
            theirs = tm.R2Score(adjusted=adjusted, multioutput=mo)(x, y)
        make = lambda: dk.R2Score(adjusted=adjusted, multioutput=mo, num_outputs=5)  # noqa: E731, B023
        _assert_all(_every_path(make, x, y), theirs.numpy(), atol=1e-5)


@pytest.mark.parametrize("name", ["R2Score", "ExplainedVariance"])
def test_multioutput_width_mismatch_raises_and_keeps_state(name):
    x, y = _randn_32x5()
    m = getattr(dk, name)()
    m.update(x[:, 0], y[:, 0])
    before = m.compute()
    with pytest.raises(ValueError, match=rf"{name}: argument 'num_outputs' .*pass num_outputs=5"):
        m.update(x, y)
    torch.testing.assert_close(m.compute(), before)
    m5 = getattr(dk, name)(num_outputs=5)
    with pytest.raises(ValueError, match=rf"{name}: argument 'preds' must be \[N, 5\]"):
        m5.update(x[:, 0], y[:, 0])
    with pytest.raises(ValueError, match=rf"{name}: argument 'num_outputs' .*pass num_outputs=3"):
        m5.update(x[:, :3], y[:, :3])
    with pytest.raises(ValueError, match=rf"{name}: argument 'multioutput'"):
        getattr(dk, name)(multioutput="mean")


# -- 3. Specificity with top_k > 1 -------------------------------------------

SPEC_P = torch.tensor([[0.1, 0.2, 0.7], [0.4, 0.4, 0.2], [0.3, 0.3, 0.4], [0.3, 0.3, 0.4]])
SPEC_T = torch.tensor([0, 1, 2, 0])


def test_specificity_top_k_issue_case():
    for top_k, average, want in [(2, "micro", 0.875), (3, "macro", 1.0)]:
        kw = dict(task="multiclass", num_classes=3, top_k=top_k, average=average)
        np.testing.assert_allclose(tm.Specificity(**kw)(SPEC_P, SPEC_T).item(), want, atol=1e-6)
        _assert_all(_every_path(lambda: dk.Specificity(**kw), SPEC_P, SPEC_T), want)  # noqa: B023
    # Recall / Accuracy agree under top_k; Precision / F1 keep the rule docs/metrics.md documents
    # (a row predicts all its top-k classes: micro precision = hits / (k * rows))
    kw = dict(task="multiclass", num_classes=3, top_k=2, average="micro")
    for name in ("Recall", "Accuracy"):
        _assert_all(_every_path(lambda: getattr(dk, name)(**kw), SPEC_P, SPEC_T),  # noqa: B023
                    getattr(tm, name)(**kw)(SPEC_P, SPEC_T).item())
    m = dk.Precision(**kw)
    m.update(SPEC_P, SPEC_T)
    np.testing.assert_allclose(m.compute().item(), 3 / (2 * 4))


@pytest.mark.parametrize("average", AVERAGES)
def test_specificity_top_k_matches_torchmetrics_random(average):
    """Distinct scores (torch.topk's choice among ties is unspecified), a
    class never a target but predicted, ignore_index, NaN rows (dropped by
    nan_strategy="ignore"; torchmetrics gets the batch without them); NaN
    rows and out-of-range targets still raise under "error"."""
    gen = torch.Generator().manual_seed(11)
    C = 6
    for trial in range(10):
        n = int(torch.randint(2, 50, (1,), generator=gen))
        scores = torch.rand(n, C, generator=gen) + torch.arange(C) * 1e-4  # no ties
        target = torch.randint(0, C - 1, (n,), generator=gen)  # class C-1 never a target
        k = int(torch.randint(2, C + 1, (1,), generator=gen))
        ign = 2 if trial % 2 else None
        bad = torch.rand(n, generator=gen) < 0.1
        dirty = scores.clone()
        dirty[bad, 0] = float("nan")
        kw = dict(task="multiclass", num_classes=C, top_k=k, average=average, ignore_index=ign)
        theirs = tm.Specificity(**kw)(scores[~bad], target[~bad])
        got = _every_path(lambda: dk.Specificity(**kw, nan_strategy="ignore"), dirty, target)  # noqa: B023
        _assert_all(got, theirs.numpy())
    p = SPEC_P.clone()
    p[1, 0] = float("nan")
    for strategy, preds, target in [("error", p, SPEC_T), ("ignore", SPEC_P, torch.tensor([0, 1, 7, 0]))]:
        m = dk.Specificity(task="multiclass", num_classes=3, top_k=2, average=average, nan_strategy=strategy)
        m.update(preds, target)
        with pytest.raises(ValueError, match="Specificity"):
            m.compute()


# -- 4. Aggregation nan_strategy ----------------------------------------------

AGG = ["SumMetric", "MeanMetric", "MaxMetric", "MinMetric", "RunningMean"]


def _ours(name, values, **kw):
    m = getattr(dk, name)(**kw)
    for v in values:
        m.update(v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = m.compute()
        host = m.compute_to_host().result()
    torch.testing.assert_close(torch.tensor(host, dtype=torch.float64), out.double(), equal_nan=True)
    return out, [str(w.message) for w in caught]


def _theirs(name, values, **kw):
    m = getattr(tm, name)(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for v in values:
            m.update(v.clone())
        return m.compute()


def test_aggregation_default_drops_nan_as_torchmetrics_and_warns():
    values = [torch.tensor([1.0, float("nan"), 2.0])]
    for name in AGG:
        want = _theirs(name, values)
        assert not torch.isnan(want)
        got, msgs = _ours(name, values)
        torch.testing.assert_close(got.double(), want.double(), msg=name)
        assert any(name in m and "nan_strategy='warn'" in m for m in msgs), msgs
        g = dk.MetricGroup({"a": getattr(dk, name)(), "b": dk.Accuracy(task="binary")})
        g["a"].update(values[0])
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            torch.testing.assert_close(g.compute()["a"].double(), want.double(), msg=name)


def test_aggregation_nan_strategies_match_torchmetrics_random():
    gen = torch.Generator().manual_seed(3)
    for name, strategy in [(n, s) for n in AGG for s in ("warn", "ignore", "disable", 0.0, -3.5, 10.0)]:
        for _ in range(5):
            values = []
            for _ in range(int(torch.randint(1, 4, (1,), generator=gen))):
                v = torch.randn(int(torch.randint(1, 9, (1,), generator=gen)), generator=gen)
                v[torch.rand(v.shape, generator=gen) < 0.3] = float("nan")
                values.append(v)
            values.append(torch.full((2,), float("nan")))  # an all-NaN update
            want = _theirs(name, values, nan_strategy=strategy)
            got, _ = _ours(name, values, nan_strategy=strategy)
            torch.testing.assert_close(got.double(), want.double(), equal_nan=True, rtol=1e-5, atol=1e-6,
                                       msg=f"{name} {strategy}")


def test_aggregation_impute_with_weights_and_numbers_matches_torchmetrics():
    ours = dk.MeanMetric(nan_strategy=2.0)
    theirs = tm.MeanMetric(nan_strategy=2.0)
    for v, w in [(torch.tensor([1.0, 4.0]), torch.tensor([float("nan"), 3.0])), (float("nan"), 5.0), (3.0, 1.0),
                 (float("nan"), 1.0)]:
        ours.update(v, weight=w)
        theirs.update(v.clone() if isinstance(v, torch.Tensor) else v, w.clone() if isinstance(w, torch.Tensor) else w)
    torch.testing.assert_close(ours.compute(), theirs.compute().double())


def test_aggregation_takes_torchmetrics_nan_strategies_and_names_bad_ones():
    for name in AGG:
        for ok in ("warn", "ignore", "error", "disable", "propagate", 0.0, -1.5):
            assert getattr(dk, name)(nan_strategy=ok) is not None
        for bad in ("bogus", True, None):
            with pytest.raises(ValueError, match=rf"{name}: argument 'nan_strategy'"):
                getattr(dk, name)(nan_strategy=bad)
