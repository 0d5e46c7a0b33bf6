"""Shared helpers of the catalogue tests: random classification inputs and
scikit-learn references computed on the rows a metric must keep."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

IGNORE = -100


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def multiclass_data(rng, n, C, kind, absent, ignore, masked, shape3d=False):
    """preds (indices / probs / logits), target, mask, and the kept numpy rows.

    ``absent``: "none", "one" (class C-1 never in target nor preds), "all"
    (every row dropped by the mask).
    """
    hi = C - 1 if absent == "one" else C
    target = rng.integers(0, hi, size=n)
    if kind == "indices":
        preds = torch.from_numpy(rng.integers(0, hi, size=n))
        pred_lab = preds.numpy()
    else:
        logits = rng.normal(0, 2, size=(n, C))
        if absent == "one":
            logits[:, C - 1] = -50.0
        preds = torch.from_numpy(softmax(logits) if kind == "probs" else logits)
        if kind == "probs_f32":
            preds = preds.float()
        pred_lab = preds.double().numpy().argmax(-1) if n else np.zeros(0, dtype=np.int64)
    keep = np.ones(n, dtype=bool)
    if ignore is not None:
        drop = rng.random(n) < 0.2
        target = np.where(drop, ignore, target)
        keep &= target != ignore
    mask = None
    if masked or absent == "all":
        m = rng.random(n) < 0.7
        if absent == "all":
            m[:] = False
        mask = torch.from_numpy(m)
        keep &= m
    target_t = torch.from_numpy(target)
    if shape3d and n % 2 == 0 and n > 0:
        # [B, T] / [B, T, C]
        target_t = target_t.reshape(2, n // 2)
        preds = preds.reshape(2, n // 2, *preds.shape[1:])
        mask = None if mask is None else mask.reshape(2, n // 2)
    return preds, target_t, mask, target[keep], pred_lab[keep], keep


def binary_data(rng, shape, kind, ignore, masked):
    """preds/target of ``shape`` ([N] binary or [N, L] multilabel)."""
    target = rng.integers(0, 2, size=shape)
    if kind == "ints":
        preds = rng.integers(0, 2, size=shape)
        prob = preds.astype(np.float64)
    elif kind == "probs":
        prob = rng.random(shape)
        preds = prob
    else:  # logits
        preds = rng.normal(0, 3, size=shape)
        prob = None
    keep = np.ones(shape, dtype=bool)
    if ignore is not None:
        drop = rng.random(shape) < 0.2
        target = np.where(drop, ignore, target)
        keep &= target != ignore
    mask = None
    if masked:
        m = rng.random(shape) < 0.7
        mask = torch.from_numpy(m)
        keep &= m
    if prob is None:
        # INPUT_AUTO: logits iff a kept pred lies outside [0, 1] (always for these logits unless nothing is kept)
        out = ((preds < 0) | (preds > 1)) & keep
        prob = sigmoid(preds) if out.any() else preds
    return torch.from_numpy(preds), torch.from_numpy(target), mask, prob, target, keep


def quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **k)


def close(actual: torch.Tensor, expected, atol=1e-12, msg=""):
    a = actual.detach().cpu().double().numpy()
    e = np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{msg}: shape {a.shape} != {e.shape}"
    np.testing.assert_allclose(a, e, rtol=0, atol=atol, err_msg=msg)


@pytest.fixture(autouse=True)
def _one_thread():
    """Small tensors: intra-op threads only add contention on a shared 2-core box."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
