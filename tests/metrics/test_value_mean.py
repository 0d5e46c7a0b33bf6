"""No data on every metric built on ``ValueMean`` (``d9d_kernels.metrics.value_mean``):
a mean is NaN and a sum 0.0, checked against torchmetrics 1.9 (the independent
reference): nothing updated, and every element masked out (torchmetrics fed an
empty batch, its equivalent)."""

from __future__ import annotations

import warnings

import pytest
import torch

import d9d_kernels as dk

tm = pytest.importorskip("torchmetrics")
from torchmetrics import regression as tmr  # noqa: E402

N = 6


def _pairs(cols=None):
    shape = (N,) if cols is None else (N, cols)
    return lambda n=N: (torch.rand(n, *shape[1:], dtype=torch.float64) + 0.5,
                        torch.rand(n, *shape[1:], dtype=torch.float64) + 0.5)


def _rows(n=N):
    return torch.rand(n, 4, dtype=torch.float64) + 0.1, torch.rand(n, 4, dtype=torch.float64) + 0.1


#: id -> (ours, torchmetrics', inputs of n rows, whether the mask is per row)
CASES = {
    "LogCoshError": (lambda: dk.LogCoshError(), lambda: tm.LogCoshError(), _pairs(), False),
    "LogCoshError-2": (lambda: dk.LogCoshError(num_outputs=2), lambda: tm.LogCoshError(num_outputs=2), _pairs(2),
                       False),
    "MinkowskiDistance": (lambda: dk.MinkowskiDistance(p=3), lambda: tm.MinkowskiDistance(p=3), _pairs(), False),
    "TweedieDevianceScore": (lambda: dk.TweedieDevianceScore(), lambda: tm.TweedieDevianceScore(), _pairs(), False),
    "TweedieDevianceScore-1.5": (lambda: dk.TweedieDevianceScore(power=1.5),
                                 lambda: tm.TweedieDevianceScore(power=1.5), _pairs(), False),
    "MeanAbsolutePercentageError": (lambda: dk.MeanAbsolutePercentageError(),
                                    lambda: tm.MeanAbsolutePercentageError(), _pairs(), False),
    "SymmetricMeanAbsolutePercentageError": (lambda: dk.SymmetricMeanAbsolutePercentageError(),
                                             lambda: tm.SymmetricMeanAbsolutePercentageError(), _pairs(), False),
    "CosineSimilarity-sum": (lambda: dk.CosineSimilarity(), lambda: tm.CosineSimilarity(), _rows, True),
    "CosineSimilarity-mean": (lambda: dk.CosineSimilarity(reduction="mean"),
                              lambda: tm.CosineSimilarity(reduction="mean"), _rows, True),
    "KLDivergence-mean": (lambda: dk.KLDivergence(), lambda: tm.KLDivergence(), _rows, True),
    "KLDivergence-sum": (lambda: dk.KLDivergence(reduction="sum"), lambda: tm.KLDivergence(reduction="sum"),
                         _rows, True),
    "JensenShannonDivergence-mean": (lambda: dk.JensenShannonDivergence(), lambda: tmr.JensenShannonDivergence(),
                                     _rows, True),
    "JensenShannonDivergence-sum": (lambda: dk.JensenShannonDivergence(reduction="sum"),
                                    lambda: tmr.JensenShannonDivergence(reduction="sum"), _rows, True),
}


def _theirs(make, inputs):
    """torchmetrics' value with no data: compute() before any update where it gives one
    (CosineSimilarity raises there), and after an empty batch; the two must agree."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its "compute called before update"
        fed = make()
        fed.update(*inputs(0))
        value = fed.compute()
        try:
            unfed = make().compute()
        except ValueError:  # CosineSimilarity: "No samples to concatenate"
            unfed = value
    torch.testing.assert_close(unfed.double(), value.double(), equal_nan=True)
    return value.double()


@pytest.mark.parametrize("case", list(CASES))
def test_no_data_is_torchmetrics_value(case):
    ours, theirs, inputs, per_row = CASES[case]
    expected = _theirs(theirs, inputs)
    m = ours()
    torch.testing.assert_close(m.compute(), expected, equal_nan=True, msg=f"{case}: nothing updated")
    preds, target = inputs()
    mask = torch.zeros(preds.shape[:1] if per_row else preds.shape, dtype=torch.bool)
    m.update(preds, target, mask=mask)
    torch.testing.assert_close(m.compute(), expected, equal_nan=True, msg=f"{case}: everything masked")


def test_every_value_mean_metric_is_covered():
    from d9d_kernels.metrics.value_mean import ValueMean

    built = {type(make()) for make, _, _, _ in CASES.values()}
    on_base = {getattr(dk, n) for n in dk.__all__
               if isinstance(getattr(dk, n), type) and issubclass(getattr(dk, n), ValueMean)}
    assert on_base == built
