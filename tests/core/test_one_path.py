"""One path per lifecycle step: the recorded update plans, forward and
compute give the same bits however a batch arrives (eager update, forward,
``torch.compile(fullgraph=True)`` update and forward; a forward's moment
sums, about the batch's own pivot, equal to rounding), and the recorder
plans exactly the updates it can replay.

The CUDA-graph replay is checked against eager updates in
tests/core/test_cuda_graph.py (gpu marker)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import confusion_matrix, f1_score, roc_auc_score

import d9d_kernels as dk
from d9d_kernels.core import plan
from d9d_kernels.core.statistic import SUM, Slot, Statistic, statistic
from tests.core.test_forward import _same_state
from tests.metrics._catalogue_utils import _one_thread  # noqa: F401

C = 5


def _group():
    kw = dict(task="multiclass", num_classes=C)
    return dk.MetricGroup({
        "acc": dk.Accuracy(**kw), "f1": dk.F1Score(**kw, average="macro"), "cm": dk.ConfusionMatrix(**kw),
        "top2": dk.Accuracy(**kw, top_k=2),
    })


def _solo():
    return {"loss": dk.WeightedMeanMetric(), "tokens": dk.SumMetric(), "peak": dk.MaxMetric(),
            "auroc": dk.AUROC(task="binary"), "mse": dk.MeanSquaredError()}


def _batches(n_batches=5):
    g = torch.Generator().manual_seed(3)
    for i in range(n_batches):
        n = (12, 12, 7)[i % 3]  # repeated signatures: recorded, then replayed
        logits = torch.randn(n, C, generator=g)
        if i == 3:
            logits[1, 2] = float("nan")
        yield dict(preds=logits, target=torch.randint(0, C, (n,), generator=g),
                   loss=torch.rand((), generator=g) * 3, tokens=float(n * (i + 1)),
                   p=torch.rand(n, generator=g), t=torch.randint(0, 2, (n,), generator=g),
                   x=torch.randn(n, generator=g, dtype=torch.float64))


def _feed(g, solo, b, forward: bool):
    call = (lambda m, *a, **k: m(*a, **k)) if forward else (lambda m, *a, **k: m.update(*a, **k))
    call(g, preds=b["preds"], target=b["target"])
    call(solo["loss"], b["loss"], weights=b["tokens"])
    call(solo["tokens"], b["tokens"])
    call(solo["peak"], b["x"])
    call(solo["auroc"], b["p"], b["t"])
    call(solo["mse"], b["x"], b["x"] * 0.5)


def _bits(m) -> torch.Tensor:
    return torch.cat([m._storage.local[k].view(torch.int64) for k in ("sum", "max", "replica")])


def _run(mode: str):
    g, solo = _group(), _solo()
    if mode.startswith("compiled"):
        torch._dynamo.reset()
        backend = "aot_eager" if mode == "compiled_update" else "eager"
        step = torch.compile(lambda b: _feed(g, solo, b, forward=mode == "compiled_forward"),
                             fullgraph=True, backend=backend)
    else:
        step = lambda b: _feed(g, solo, b, forward=mode == "forward")  # noqa: E731
    batches = list(_batches())
    for b in batches:
        step(b)
    return g, solo, batches


@pytest.mark.parametrize("mode", ["forward", "compiled_update", "compiled_forward"])
def test_every_way_in_gives_the_update_bits(mode):
    want_g, want_solo, batches = _run("update")
    got_g, got_solo, _ = _run(mode)
    assert torch.equal(_bits(got_g), _bits(want_g)), mode
    for k in want_solo:
        if mode.endswith("forward") and want_solo[k]._storage.layout.pivoted:
            # forward sums each batch about its own pivot (its value is a fresh metric's), then
            # re-expresses it about the state's: the same data, equal to rounding
            _same_state(got_solo[k], want_solo[k], (mode, k))
        else:
            assert torch.equal(_bits(got_solo[k]), _bits(want_solo[k])), (mode, k)
    # and the values are the references' (not only equal to each other)
    p = torch.cat([b["preds"] for b in batches])
    t = torch.cat([b["target"] for b in batches])
    ok = ~p.isnan().any(1)
    with pytest.raises(ValueError, match="nonfinite_preds=1"):  # nan_strategy="error": the NaN row raises
        got_g.compute()
    np.testing.assert_array_equal(got_g["cm"]._compute_unchecked(got_g["cm"]._states()).numpy(),
                                  confusion_matrix(t[ok].numpy(), p[ok].argmax(1).numpy(), labels=range(C)))
    f1 = f1_score(t[ok].numpy(), p[ok].argmax(1).numpy(), average="macro", labels=range(C), zero_division=0)
    assert got_g["f1"]._compute_unchecked(got_g["f1"]._states()).item() == pytest.approx(f1, rel=1e-12)
    w = torch.tensor([b["tokens"] for b in batches], dtype=torch.float64)
    losses = torch.stack([b["loss"] for b in batches]).double()
    assert got_solo["loss"].compute().item() == pytest.approx(((losses * w).sum() / w.sum()).item(), rel=1e-12)
    assert got_solo["tokens"].compute().item() == w.sum().item()
    assert got_solo["peak"].compute().item() == torch.cat([b["x"] for b in batches]).max().item()
    auroc = roc_auc_score(torch.cat([b["t"] for b in batches]).numpy(), torch.cat([b["p"] for b in batches]).numpy())
    assert got_solo["auroc"].compute().item() == pytest.approx(auroc, abs=2e-3)  # binned scores


def _plan_of(m):
    (p,) = m._storage.plans.values()
    return p


def test_the_recorder_plans_exactly_what_it_can_replay():
    x = torch.randn(6)
    m = dk.SumMetric()
    m.update(x)
    p = _plan_of(m)
    assert isinstance(p, plan.Plan) and [str(f) for f, _ in p.steps] == ["d9d_kernels.weighted_moments.default"]
    n = dk.SumMetric()  # a Python number: replayed as a fill of the new value
    n.update(2.5)
    n.update(4.0)
    assert isinstance(_plan_of(n), plan.Plan) and n.compute().item() == 6.5
    twice = dk.MeanSquaredError()  # one tensor passed as both inputs: its source is ambiguous
    twice.update(x, x)
    assert _plan_of(twice) is plan._UNPLANNED
    cal = dk.CalibrationError(task="binary")  # writes its state with torch ops: nothing to replay
    cal.update(torch.rand(6), torch.randint(0, 2, (6,)))
    assert _plan_of(cal) is plan._UNPLANNED
    idx = dk.Accuracy(task="multiclass", num_classes=C)  # int32 targets are converted: derived, not replayed
    idx.update(torch.randn(6, C), torch.randint(0, C, (6,), dtype=torch.int32))
    assert _plan_of(idx) is plan._UNPLANNED


@statistic
class _IgnoreFromInput(Statistic):
    """class_stats counts whose ignore_index is an update input (a number)."""

    def slots(self):
        return [Slot("stats", SUM, (1, 3, C)), Slot("extras", SUM, (2,)), Slot("bad", SUM, (2,))]

    def update(self, state, preds, target, ignore):
        dk.ops.class_stats(preds, target, num_classes=C, stats=state["stats"], extras=state["extras"],
                           bad=state["bad"], ignore_index=ignore)


class _Counts(dk.Metric):
    def _statistics(self):
        return {"s": _IgnoreFromInput()}

    def update(self, preds, target, ignore):
        self._feed({"s": dict(preds=preds, target=target, ignore=ignore)})

    def _compute(self, states):
        return states["s"]["stats"][0, 2]  # targets per class, the ignored ones left out


def test_an_input_number_reaching_an_op_as_a_constant_is_never_frozen_into_a_plan():
    """A scalar op argument equal to a Python-number input may be that input:
    the recorder leaves such a signature on the checked path, so a later
    value could never be replaced by the recorded one. (A user subclass's
    update is never planned; the recorder is called on its calls directly.)"""
    m = _Counts()
    t = torch.tensor([0, 1, 2, 3, 4, 4])
    p = torch.zeros(6, dtype=torch.int64)
    with plan._Recorder() as rec:
        m.update(p, t, 4)
    frozen, why = plan.Plan.record(m._storage, rec.calls, (p, t, 4), {})
    assert frozen is None and "a number argument equal to one of its Python-number inputs (4)" in why, why
    assert isinstance(plan.Plan.record(m._storage, rec.calls, (p, t, 4.0), {})[0], plan.Plan)  # 4.0 is not the int 4
    m.update(p, t, 1)
    want = np.bincount(t[t != 4].numpy(), minlength=C) + np.bincount(t[t != 1].numpy(), minlength=C)
    np.testing.assert_array_equal(m.compute().numpy(), want)
