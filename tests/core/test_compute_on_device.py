"""compute() on GPU state makes no host read (d9d's collector runs it on a side
stream). Without a GPU the device policy ``core.metric.host_checks`` is
switched to the GPU's answer and every way a tensor reaches the host
(``item``, ``tolist``, ``bool``, ``float``, ``int``) raises; the values must
equal the checked CPU computation, and bad inputs give NaN there while
``compute_to_host().result()`` still raises."""

from __future__ import annotations

import math

import pytest
import torch

import d9d_kernels as dk
from d9d_kernels.core import metric as core_metric
from tests.metrics.test_catalogue_group import _all_metric_updates

_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


@pytest.fixture
def device_policy(monkeypatch):
    """Within ``with device_policy():`` compute() behaves as on a GPU and host reads raise."""
    import contextlib

    @contextlib.contextmanager
    def on_device():
        with monkeypatch.context() as mp:
            mp.setattr(core_metric, "host_checks", lambda device: False)
            for name in _HOST_READS:
                def refuse(*a, _name=name, **k):
                    raise AssertionError(f"compute() read a tensor on the host (Tensor.{_name})")
                mp.setattr(torch.Tensor, name, refuse)
            yield

    return on_device


def _same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
        return
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_every_metric_computes_without_host_reads(device_policy):
    for m, args in _all_metric_updates():
        m.update(*args)
        expected = m.compute()
        with device_policy():
            got = m.compute()
        _same(got, expected)


def test_group_computes_without_host_reads(device_policy):
    cases = _all_metric_updates(seed=1)
    g = dk.MetricGroup({f"m{i}": m for i, (m, _) in enumerate(cases)})
    for i, (_, args) in enumerate(cases):
        g[f"m{i}"].update(*args)
    expected = g.compute()
    g.sync()
    with device_policy():
        got = g.compute()
        solo = {k: g[k].compute() for k in g}
    _same(got, expected)
    _same(solo, expected)


def test_bad_inputs_give_nan_on_device_and_raise_at_the_host_read(device_policy):
    g = dk.MetricGroup({"acc": dk.Accuracy(task="multiclass", num_classes=3),
                        "mean": dk.WeightedMeanMetric(nan_strategy="error"),
                        "n": dk.SumMetric()})
    g.update(preds=torch.tensor([0, 1, 2]), target=torch.tensor([0, 1, 7]))  # 7 is out of range
    g["mean"].update(torch.tensor([1.0, 3.0]))
    g["n"].update(2.0)
    with pytest.raises(ValueError, match="1 invalid"):
        g.compute()  # CPU state: compute() raises
    with device_policy():
        vals = g.compute()
        acc = g["acc"].compute()
    assert math.isnan(vals["acc"]) and math.isnan(acc)
    assert vals["mean"] == 2.0 and vals["n"] == 2.0
    with device_policy(), pytest.raises(AssertionError):
        g.compute_to_host().result()  # the host read is where it raises: never inside compute()
    with pytest.raises(ValueError, match="target_out_of_range=1"):
        g.compute_to_host().result()
