"""Regressions of the cached fast paths (issue #34's seven findings).

Each test replays one sequence that gave a wrong answer or a late error and
compares with plain PyTorch / torchmetrics on the same data, or with a metric
that never saw the earlier calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchmetrics as tm

import d9d_kernels as dk


# 1. A subclass whose update transforms its inputs and calls super().update(...).
class ScaledMean(dk.WeightedMeanMetric):
    def update(self, values):
        super().update(values * 100.0)


class OneBasedAccuracy(dk.Accuracy):
    def update(self, preds, target):
        super().update(preds - 1, target - 1)


def test_subclass_update_runs_its_own_code_every_call():
    m = ScaledMean()
    x = torch.tensor([1.0, 2.0])
    for _ in range(3):
        m.update(x)
    assert m.compute().item() == pytest.approx(150.0)

    acc = OneBasedAccuracy(task="multiclass", num_classes=3)
    ref = tm.Accuracy(task="multiclass", num_classes=3)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        p = torch.randint(1, 4, (16,), generator=g)
        t = torch.randint(1, 4, (16,), generator=g)
        acc.update(p, t)  # one-based: 3 is in range
        ref.update(p - 1, t - 1)
    assert acc.compute().item() == pytest.approx(ref.compute().item())


# 2. A metric that computed alone, then joins a group, reads its own slot there.
def test_member_value_after_compute_outside_the_group():
    m = dk.SumMetric()
    m.compute()
    g = dk.MetricGroup({"a": dk.SumMetric(), "b": m})
    g["a"].update(100.0)
    g["b"].update(1.0)
    assert g["b"].compute().item() == 1.0
    assert g.compute()["b"].item() == 1.0
    assert g["a"].compute().item() == 100.0


# 3. An int past the float64 range raises at the update and writes nothing.
def test_int_overflow_raises_at_update_on_every_path():
    m = dk.SumMetric()
    m.update(1)
    m.update(2)  # the second call of the int signature runs the compiled path
    with pytest.raises(OverflowError):
        m.update(10**400)
    m.update(4)
    assert m.compute().item() == 7.0


# 4. Tensors made under torch.inference_mode() (an eval loop's tensors).
@pytest.mark.parametrize("make", [
    lambda: dk.CalibrationError(task="multiclass", num_classes=3),
    lambda: dk.MeanIoU(num_classes=3, input_format="index"),
    lambda: dk.DiceScore(num_classes=3, input_format="index"),
], ids=["CalibrationError", "MeanIoU", "DiceScore"])
def test_inference_mode_tensors(make):
    g = torch.Generator().manual_seed(2)
    if "Calibration" in repr(make()):
        preds = torch.softmax(torch.randn(20, 3, generator=g), -1)
        target = torch.randint(0, 3, (20,), generator=g)
        ref = tm.CalibrationError(task="multiclass", num_classes=3)
    else:
        preds = torch.randint(0, 3, (2, 8, 8), generator=g)
        target = torch.randint(0, 3, (2, 8, 8), generator=g)
        ref = None
    plain = make()
    plain.update(preds, target)
    plain.update(preds, target)
    m = make()
    with torch.inference_mode():
        p, t = preds.clone(), target.clone()
        m.update(p, t)
        m.update(p, t)
    np.testing.assert_allclose(m.compute().numpy(), plain.compute().numpy(), rtol=0, atol=0)
    if ref is not None:
        ref.update(preds, target)
        assert m.compute().item() == pytest.approx(ref.compute().item(), abs=1e-6)


# 5. reset() forgets the moment pivot: the next data is centred afresh.
def test_reset_forgets_the_pivot():
    m = dk.WeightedMeanMetric()
    m.update(torch.tensor([1e17], dtype=torch.float64))
    m.reset()
    m.update(torch.tensor([1.5, 2.5]))
    assert m.compute().item() == 2.0

    s = dk.SumMetric()
    s.update(torch.tensor([1e17], dtype=torch.float64))
    s.reset()
    s.update(torch.tensor([1.5, 2.5, 3.25]))
    assert s.compute().item() == 7.25

    f = dk.WeightedMeanMetric()
    f.update(torch.tensor([1e12], dtype=torch.float64))
    f.reset()
    batch = torch.tensor([0.1, 0.2], dtype=torch.float64)
    assert f(batch).item() == pytest.approx(batch.mean().item(), rel=1e-15)

    g = dk.MetricGroup({"loss": dk.WeightedMeanMetric(), "n": dk.SumMetric()})
    g.update(values=torch.tensor([1e17], dtype=torch.float64))
    g["loss"].reset()
    g["n"].reset()
    g.update(values=torch.tensor([1.5, 2.5]))
    assert {k: v.item() for k, v in g.compute().items()} == {"loss": 2.0, "n": 4.0}


# 6. load_state_dict between trigger_sync and wait_sync: compute reads the loaded state.
def test_load_state_dict_while_a_sync_is_in_flight():
    m = dk.SumMetric()
    m.update(1.0)
    other = dk.SumMetric()
    other.update(100.0)
    m.trigger_sync()
    m.load_state_dict(other.state_dict())
    m.wait_sync()
    assert m.compute().item() == 100.0
    m.sync()
    assert m.compute().item() == 100.0


# 7. forward accumulates the same state bits as update, and its batch value is update's value.
def _state_bits(metric) -> list:
    st = metric._storage
    return [v.clone() for v in st.local.values()]


def _same_bits(a: list, b: list) -> None:
    for x, y in zip(a, b):
        assert torch.equal(x.view(torch.int64), y.view(torch.int64)), (x, y)


@pytest.mark.parametrize("case", ["perplexity", "max", "min"])
def test_forward_state_is_bit_identical_to_update(case):
    g = torch.Generator().manual_seed(3)
    if case == "perplexity":
        make = lambda: dk.Perplexity()  # noqa: E731
        batches = [(torch.randn(4, 7, 11, generator=g), torch.randint(0, 11, (4, 7), generator=g)) for _ in range(5)]
    else:
        make = (lambda: dk.MaxMetric()) if case == "max" else (lambda: dk.MinMetric())  # noqa: E731
        batches = [(torch.tensor([0.0, -0.0]),), (torch.tensor([-0.0]),), (torch.tensor([0.0]),),
                   (torch.tensor([-0.0, 0.0]),)]
    upd, fwd, fresh = make(), make(), make()
    for b in batches:
        upd.update(*b)
        v = fwd(*b)
        fresh.reset()
        fresh.update(*b)
        w = fresh.compute()
        assert torch.equal(v.view(-1).double().view(torch.int64), w.view(-1).double().view(torch.int64)), (v, w)
        _same_bits(_state_bits(upd), _state_bits(fwd))
    a, b = upd.compute(), fwd.compute()
    assert torch.equal(a.double().view(torch.int64), b.double().view(torch.int64))
    if case == "perplexity":
        logits = torch.cat([b[0].reshape(-1, 11) for b in batches])
        target = torch.cat([b[1].reshape(-1) for b in batches])
        ref = torch.exp(torch.nn.functional.cross_entropy(logits.double(), target))
        assert a.item() == pytest.approx(ref.item(), rel=1e-6)
    else:
        assert a.item() == 0.0


def test_forward_under_fullgraph_compile():
    m = dk.WeightedMeanMetric()
    ref = dk.WeightedMeanMetric()

    @torch.compile(fullgraph=True, backend="eager")
    def step(x):
        return m(x)

    xs = [torch.randn(8, dtype=torch.float64) for _ in range(3)]
    for x in xs:
        v = step(x)
        assert v.item() == pytest.approx(x.mean().item(), rel=1e-14)
        ref.update(x)
    assert m.compute().item() == pytest.approx(torch.cat(xs).mean().item(), rel=1e-14)
    # each batch is summed about its own pivot, then re-expressed about the state's: equal to rounding
    assert m.compute().item() == pytest.approx(ref.compute().item(), rel=1e-14)
