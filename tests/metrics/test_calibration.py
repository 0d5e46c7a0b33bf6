"""CalibrationError vs torchmetrics 1.9 (which keeps every confidence) on
random, logit, tied-on-bin-edge and ignore_index inputs, over several
updates; bad input raises naming the argument and leaves the state intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torchmetrics.classification import BinaryCalibrationError, MulticlassCalibrationError

import d9d_kernels as dk
from tests.metrics._catalogue_utils import quiet


def _tm(task, n_bins, norm, C=None, ignore_index=None):
    if task == "binary":
        return BinaryCalibrationError(n_bins=n_bins, norm=norm, ignore_index=ignore_index)
    return MulticlassCalibrationError(num_classes=C, n_bins=n_bins, norm=norm, ignore_index=ignore_index)


def _batches(rng, task, kind, C, dtype):
    out = []
    for n in (37, 1, 64):
        if task == "binary":
            if kind == "edges":  # exactly on bin edges, 0 and 1 included
                p = rng.integers(0, 11, size=n) / 10.0
            else:
                p = rng.random(n) if kind == "probs" else rng.normal(0, 3, n)
            t = rng.integers(0, 2, size=n)
            preds = torch.tensor(p, dtype=dtype)
        else:
            logits = rng.normal(0, 2, size=(n, C))
            if kind == "probs":
                e = np.exp(logits)
                logits = e / e.sum(-1, keepdims=True)
            elif kind == "edges":
                logits = np.zeros((n, C))
                logits[np.arange(n), rng.integers(0, C, n)] = rng.integers(0, 3, n) / 2.0
            t = rng.integers(0, C, size=n)
            preds = torch.tensor(logits, dtype=dtype)
        out.append((preds, torch.tensor(t)))
    return out


@pytest.mark.parametrize("task", ["binary", "multiclass"])
@pytest.mark.parametrize("kind", ["probs", "logits", "edges"])
@pytest.mark.parametrize("norm", ["l1", "l2", "max"])
@pytest.mark.parametrize("n_bins", [1, 3, 15])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_torchmetrics(task, kind, norm, n_bins, dtype):
    rng = np.random.default_rng(n_bins * 7 + len(kind))
    C = 4
    m = dk.CalibrationError(task=task, n_bins=n_bins, norm=norm, num_classes=C if task == "multiclass" else None)
    ref = _tm(task, n_bins, norm, C)
    for preds, target in _batches(rng, task, kind, C, dtype):
        m.update(preds, target)
        quiet(ref.update, preds, target)
    np.testing.assert_allclose(m.compute().item(), float(quiet(ref.compute)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("task", ["binary", "multiclass"])
def test_ignore_index_mask_and_channel_first(task):
    rng = np.random.default_rng(3)
    C = 5
    m = dk.CalibrationError(task=task, n_bins=10, num_classes=C if task == "multiclass" else None, ignore_index=-1)
    ref = _tm(task, 10, "l1", C, ignore_index=-1)
    for _ in range(3):
        t = rng.integers(0, 2 if task == "binary" else C, size=(2, 6, 7))
        t[rng.random(t.shape) < 0.2] = -1
        t = torch.tensor(t)
        if task == "binary":
            preds = torch.tensor(rng.random((2, 6, 7)))
        else:
            preds = torch.tensor(rng.normal(0, 2, (2, C, 6, 7)))  # channel-first, as torchmetrics takes it
        keep = torch.tensor(rng.random((2, 6, 7)) < 0.8)
        m.update(preds, t, mask=keep)
        quiet(ref.update, preds, torch.where(keep, t, torch.full_like(t, -1)))
    np.testing.assert_allclose(m.compute().item(), float(quiet(ref.compute)), rtol=1e-6, atol=1e-7)


def test_in_group_one_update():
    rng = np.random.default_rng(5)
    g = dk.MetricGroup({"ece": dk.CalibrationError(task="multiclass", num_classes=3),
                        "mce": dk.CalibrationError(task="multiclass", num_classes=3, norm="max"),
                        "acc": dk.Accuracy(task="multiclass", num_classes=3)})
    preds, target = torch.tensor(rng.normal(0, 2, (50, 3))), torch.tensor(rng.integers(0, 3, 50))
    g.update(preds=preds, target=target)
    out = g.compute()
    for key, norm in (("ece", "l1"), ("mce", "max")):
        ref = _tm("multiclass", 15, norm, 3)
        np.testing.assert_allclose(out[key].item(), float(quiet(ref, preds, target)), rtol=1e-5, atol=1e-6)


def test_bad_input_names_metric_and_argument_state_intact():
    m = dk.CalibrationError(task="multiclass", num_classes=3, n_bins=5)
    preds, target = torch.softmax(torch.randn(8, 3, dtype=torch.float64), 1), torch.randint(0, 3, (8,))
    m.update(preds, target)
    before = m.compute().item()
    with pytest.raises(ValueError, match=r"CalibrationError.*'preds'"):
        m.update(preds[:, :2], target)
    with pytest.raises(TypeError, match=r"CalibrationError.*'target'"):
        m.update(preds, target.double())
    with pytest.raises(TypeError, match=r"CalibrationError.*'preds'"):
        m.update(target, target)
    assert m.compute().item() == before
    with pytest.raises(ValueError, match=r"CalibrationError.*'norm'"):
        dk.CalibrationError(task="binary", norm="l3")
    with pytest.raises(ValueError, match=r"CalibrationError.*'task'"):
        dk.CalibrationError(task="multilabel")
    with pytest.raises(ValueError, match=r"CalibrationError.*'num_classes'"):
        dk.CalibrationError(task="multiclass")
    # out-of-range target: counted on the device, raised by compute with the count
    m.update(preds, torch.full((8,), 7))
    with pytest.raises(ValueError, match=r"CalibrationError: 8 invalid"):
        m.compute()


def test_nan_strategy():
    preds, target = torch.tensor([0.2, float("nan"), 0.9]), torch.tensor([0, 1, 1])
    prop = dk.CalibrationError(task="binary")
    prop.update(preds, target)  # torchmetrics' own reading of a NaN score
    np.testing.assert_allclose(prop.compute().item(), float(quiet(BinaryCalibrationError(), preds, target)), rtol=1e-6)
    ign = dk.CalibrationError(task="binary", nan_strategy="ignore")
    ign.update(preds, target)
    ref = quiet(BinaryCalibrationError(), preds[[0, 2]], target[[0, 2]])
    np.testing.assert_allclose(ign.compute().item(), float(ref), rtol=1e-6)
    err = dk.CalibrationError(task="binary", nan_strategy="error")
    err.update(preds, target)
    with pytest.raises(ValueError, match="1 invalid"):
        err.compute()


def test_norms_in_a_group_bin_once(monkeypatch):
    from d9d_kernels.metrics.calibration import CalibrationError as CE

    calls = []
    real = CE._binned
    monkeypatch.setattr(CE, "_binned", lambda self, *a: calls.append(1) or real(self, *a))
    g = dk.MetricGroup({n: dk.CalibrationError(task="multiclass", num_classes=3, norm=n) for n in ("l1", "l2", "max")})
    preds, target = torch.randn(20, 3, dtype=torch.float64), torch.randint(0, 3, (20,))
    for _ in range(2):
        g.update(preds=preds.clone(), target=target.clone())
    assert len(calls) == 2  # once per group update
    out = g.compute()
    for n in ("l1", "l2", "max"):
        ref = _tm("multiclass", 15, n, 3)
        quiet(ref.update, preds, target)
        quiet(ref.update, preds, target)
        np.testing.assert_allclose(out[n].item(), float(quiet(ref.compute)), rtol=1e-5, atol=1e-6)


def test_error_inside_a_group_names_the_member_and_updates_nobody():
    g = dk.MetricGroup({"ece": dk.CalibrationError(task="multiclass", num_classes=3),
                        "acc": dk.Accuracy(task="multiclass", num_classes=3)})
    preds, target = torch.softmax(torch.randn(10, 3, dtype=torch.float64), 1), torch.randint(0, 3, (10,))
    g.update(preds=preds, target=target)
    before = {k: v.clone() for k, v in g.compute().items()}
    with pytest.raises(TypeError, match=r"MetricGroup\['ece'\] \(CalibrationError\).*'target'"):
        g.update(preds=preds, target=target.double())  # float labels: refused by both, ECE is checked first
    after = g.compute()
    for k in before:
        torch.testing.assert_close(after[k], before[k])
