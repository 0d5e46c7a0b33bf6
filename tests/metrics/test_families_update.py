"""The new metric families keep the update contract (docs/metrics_core.md): no host read of
tensor data in ``update`` (no ``.item()`` / ``bool(tensor)``: checked below
the Python layer with a dispatch mode), state in the packed buffers (reset,
state_dict / load_state_dict round trips), results unchanged by a group."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import d9d_kernels as dk

_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
               torch.ops.aten.item.default}


class _NoHostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _HOST_READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _cases():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 4, generator=g)
    labels = torch.randint(0, 4, (12,), generator=g)
    seg_p, seg_t = torch.randint(0, 4, (2, 5, 5), generator=g), torch.randint(0, 4, (2, 5, 5), generator=g)
    rows = torch.rand(6, 3, generator=g)
    x, y = torch.randn(9, generator=g), torch.randn(9, generator=g)
    return [
        ("ece", lambda: dk.CalibrationError(task="multiclass", num_classes=4), (logits, labels)),
        ("ece_bin", lambda: dk.CalibrationError(task="binary", norm="l2"), (torch.rand(12, generator=g), labels % 2)),
        ("dice", lambda: dk.Dice(num_classes=4, input_format="index"), (seg_p, seg_t)),
        ("gds", lambda: dk.GeneralizedDiceScore(num_classes=4, input_format="index"), (seg_p, seg_t)),
        ("miou", lambda: dk.MeanIoU(num_classes=4, input_format="index", per_class=True, ignore_index=3), (seg_p, seg_t)),
        ("kl", lambda: dk.KLDivergence(), (rows, rows.flip(0))),
        ("cos", lambda: dk.CosineSimilarity(), (rows, rows.flip(0))),
        ("mape", lambda: dk.MeanAbsolutePercentageError(), (x, y)),
        ("smape", lambda: dk.SymmetricMeanAbsolutePercentageError(), (x, y)),
        ("running", lambda: dk.RunningMean(window=2), (x,)),
        ("ema", lambda: dk.ExponentialMovingAverage(decay=0.9), (x,)),
    ]


CASES = _cases()


@pytest.mark.parametrize("name, make, inputs", CASES, ids=[c[0] for c in CASES])
def test_update_reads_nothing_on_the_host(name, make, inputs):
    m = make()
    m.update(*inputs)  # first call: checked path
    with _NoHostReads() as mode:
        m.update(*inputs)
        m.update(*inputs)
    assert mode.reads == [], f"{name}: host reads in update: {mode.reads}"


@pytest.mark.parametrize("name, make, inputs", CASES, ids=[c[0] for c in CASES])
def test_reset_state_dict_and_group_equal_standalone(name, make, inputs):
    a = make()
    a.update(*inputs)
    a.update(*inputs)
    value = a.compute().clone()
    b = make()
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b.compute(), value, equal_nan=True)
    g = dk.MetricGroup({"m": make(), "other": make()})
    g["m"].update(*inputs)
    g["m"].update(*inputs)
    torch.testing.assert_close(g.compute()["m"], value, equal_nan=True)
    a.reset()
    fresh = make()
    torch.testing.assert_close(a.compute(), fresh.compute(), equal_nan=True)
    a.update(*inputs)
    a.update(*inputs)
    torch.testing.assert_close(a.compute(), value, equal_nan=True)


def test_last_inputs_memo_hits_misses_and_never_keeps_a_batch_alive():
    import gc
    import weakref

    from d9d_kernels.metrics._memo import LastInputs

    memo = LastInputs()
    a, b = torch.ones(3), torch.ones(2)
    value = torch.zeros(4)
    memo.put((a, b, None), "k", value)
    assert memo.get((a, b, None), "k") is value
    assert memo.get((a, b, None), "other key") is None
    assert memo.get((a.clone(), b, None), "k") is None  # another tensor
    assert memo.get((a, b, torch.ones(1)), "k") is None  # None vs a tensor
    a.add_(1)  # in-place change of an input
    assert memo.get((a, b, None), "k") is None
    memo.put((a, b, None), "k", value)
    seen = weakref.ref(value)
    del a, value
    gc.collect()
    assert seen() is None  # the input died: the memo dropped its (possibly batch-sized) value


def test_empty_batches_add_nothing():
    """Zero-sample batches (shapes only) are accepted and leave the value as
    before: NaN with no data for the means (torchmetrics' 0/0), 0 for sums."""
    empty_seg = torch.zeros(0, 4, 4, dtype=torch.long)
    cases = [
        (dk.CalibrationError(task="multiclass", num_classes=3), (torch.zeros(0, 3), torch.zeros(0, dtype=torch.long))),
        (dk.Dice(num_classes=3, input_format="index"), (empty_seg, empty_seg)),
        (dk.Dice(num_classes=3, average="none"), (torch.zeros(0, 3, 4, 4), torch.zeros(0, 3, 4, 4, dtype=torch.long))),
        (dk.GeneralizedDiceScore(num_classes=3, input_format="index"), (empty_seg, empty_seg)),
        (dk.MeanIoU(num_classes=3, input_format="index"), (empty_seg, empty_seg)),
        (dk.KLDivergence(), (torch.zeros(0, 3), torch.zeros(0, 3))),
        (dk.MeanAbsolutePercentageError(), (torch.zeros(0), torch.zeros(0))),
    ]
    for m, inputs in cases:
        m.update(*inputs)
        assert torch.isnan(m.compute()).all(), type(m).__name__
    cos = dk.CosineSimilarity()  # reduction="sum": an empty sum
    cos.update(torch.zeros(0, 3), torch.zeros(0, 3))
    assert cos.compute().item() == 0.0


@pytest.mark.parametrize("name, make, inputs", CASES, ids=[c[0] for c in CASES])
def test_update_runs_under_torch_compile_fullgraph(name, make, inputs):
    """fullgraph=True: a host read or a data-dependent shape fails (aot_eager:
    dynamo + fake-tensor tracing without codegen, to keep the test short);
    compiled results equal eager ones."""
    torch._dynamo.reset()
    m, e = make(), make()
    torch.compile(lambda *a: m.update(*a), fullgraph=True, backend="aot_eager")(*inputs)
    e.update(*inputs)
    torch.testing.assert_close(m.compute(), e.compute(), equal_nan=True)
