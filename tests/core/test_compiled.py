"""Compiled update plans (d9d_kernels/core/compiled.py, csrc/cpu/plan_runner.cpp):
after the first call of a signature an update is one C++ call. Its state must
be bit-identical to the Python plan path's (D9D_KERNELS_COMPILED=0) on every
catalogue family, the runner must actually take the calls it can, new or
changed signatures must fall back (and bad input still raise), and the
values must match independent references."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, top_k_accuracy_score

import d9d_kernels as dk
from d9d_kernels.core import compiled, plan
from d9d_kernels.core.statistic import KINDS
from tests.metrics._catalogue_utils import _one_thread  # noqa: F401

pytestmark = pytest.mark.skipif(compiled.runner_class() is None, reason="extension without PlanRunner")

C, L = 7, 4
MC = dict(task="multiclass", num_classes=C)


def _batch(step: int):
    """Inputs of one call; the batch size changes at step 3 (a second
    signature) and returns at step 4 (the first again)."""
    g = torch.Generator().manual_seed(100 + step)
    n = 24 if step == 3 else 16
    logits = torch.randn(n, C, generator=g)
    logits[0, 1] = logits[0, 2]  # a tie
    x, y = torch.randn(n, generator=g) * 3 + 1e3, torch.randn(n, generator=g)
    x[1] = float("nan") if step == 2 else x[1]
    return {
        "logits": logits, "labels": torch.randint(0, C, (n,), generator=g),
        "idx": torch.randint(0, C, (n,), generator=g), "mask": torch.rand(n, generator=g) > 0.3,
        "x": x, "y": y, "w": torch.rand(n, generator=g),
        "v0": torch.rand((), generator=g), "w0": torch.rand((), generator=g) * 100,
        "probs": torch.rand(n, generator=g), "bits": torch.randint(0, 2, (n,), generator=g),
        "ml_probs": torch.rand(n, L, generator=g), "ml_bits": torch.randint(0, 2, (n, L), generator=g),
        "seq": torch.randn(2, n, C, generator=g), "seq_labels": torch.randint(0, C, (2, n), generator=g),
        "num": float(step) * 0.75 - 1.0, "count": (3, 3, 5, 7, 3, 3)[step],
    }


# name -> (factory, update(metric, batch), compiled: whether every step lowers to the runner)
CASES = {
    "weighted_mean_0d_tensors": (dk.WeightedMeanMetric, lambda m, b: m.update(values=b["v0"], weights=b["w0"]), True),
    "weighted_mean_numbers": (dk.WeightedMeanMetric, lambda m, b: m.update(b["num"], weights=b["count"]), True),
    "weighted_mean_tensor_number_weight": (dk.WeightedMeanMetric, lambda m, b: m.update(b["x"], weights=b["count"]), True),
    "weighted_mean_masked": (dk.WeightedMeanMetric, lambda m, b: m.update(b["x"], weights=b["w"], mask=b["mask"]), True),
    # flattened inputs: a contiguous [n, L] (a view made in C++), a transposed one and one
    # that requires grad (both reshaped by the dispatcher)
    "weighted_mean_2d": (dk.WeightedMeanMetric, lambda m, b: m.update(b["ml_probs"], weights=b["ml_probs"] + 1), True),
    "weighted_mean_2d_transposed": (
        dk.WeightedMeanMetric, lambda m, b: m.update(b["ml_probs"].t(), weights=(b["ml_probs"] + 1).t()), True),
    "sum_requires_grad": (dk.SumMetric, lambda m, b: m.update(b["ml_probs"].requires_grad_()), True),
    "mean_ignore_nan": (lambda: dk.WeightedMeanMetric(nan_strategy="ignore"), lambda m, b: m.update(b["x"]), True),
    "sum_number": (dk.SumMetric, lambda m, b: m.update(b["num"]), True),
    "max_0d": (dk.MaxMetric, lambda m, b: m.update(b["v0"]), True),
    "min_masked": (dk.MinMetric, lambda m, b: m.update(b["x"], mask=b["mask"]), True),
    "max_number": (dk.MaxMetric, lambda m, b: m.update(b["num"]), True),
    "mse": (dk.MeanSquaredError, lambda m, b: m.update(b["x"], b["y"]), None),
    "r2_weighted": (dk.R2Score, lambda m, b: m.update(b["x"], b["y"], weights=b["w"]), None),
    "pearson": (dk.PearsonCorrCoef, lambda m, b: m.update(b["x"], b["y"]), None),
    "accuracy_logits": (lambda: dk.Accuracy(**MC), lambda m, b: m.update(b["logits"], b["labels"]), True),
    "top3_masked": (lambda: dk.Accuracy(**MC, top_k=3), lambda m, b: m.update(b["logits"], b["labels"], mask=b["mask"]), True),
    "f1_indices": (lambda: dk.F1Score(**MC, average="macro"), lambda m, b: m.update(b["idx"], b["labels"]), True),
    "confmat_ignore": (lambda: dk.ConfusionMatrix(**MC, ignore_index=0), lambda m, b: m.update(b["logits"], b["labels"]), True),
    "cohen_kappa": (lambda: dk.CohenKappa(**MC), lambda m, b: m.update(b["logits"], b["labels"]), True),
    "perplexity": (lambda: dk.Perplexity(num_classes=C), lambda m, b: m.update(b["seq"], b["seq_labels"]), None),
    "accuracy_sequences": (lambda: dk.Accuracy(**MC), lambda m, b: m.update(b["seq"], b["seq_labels"]), None),
    "binary_f1": (lambda: dk.F1Score(task="binary"), lambda m, b: m.update(b["probs"], b["bits"]), False),
    "multilabel_f1": (lambda: dk.F1Score(task="multilabel", num_labels=L), lambda m, b: m.update(b["ml_probs"], b["ml_bits"]), False),
    "binary_auroc": (lambda: dk.AUROC(task="binary", num_bins=64), lambda m, b: m.update(b["probs"], b["bits"]), False),
    "multiclass_ap": (lambda: dk.AveragePrecision(**MC, num_bins=64), lambda m, b: m.update(b["logits"], b["labels"]), False),
}


def _bits(storage) -> dict:
    return {k: storage.local[k].clone().view(torch.int64) for k in KINDS}


def _run(make, call, steps=6):
    m = make()
    for s in range(steps):
        call(m, _batch(s))
    return m


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_state_is_bit_identical_to_the_python_plan(monkeypatch, name):
    make, call, lowers = CASES[name]
    fast = _run(make, call)
    monkeypatch.setenv("D9D_KERNELS_COMPILED", "0")
    ref = _run(make, call)
    assert not ref._storage.compiled
    got, want = _bits(fast._storage), _bits(ref._storage)
    for k in KINDS:
        assert torch.equal(got[k], want[k]), f"{name}: {k} state differs"
    entry = fast._storage.compiled.get(id(fast))
    runner = None if entry is None else entry.runner
    if lowers is True:
        assert runner is not None and len(runner) >= 1, f"{name}: compiled"
    elif lowers is False:
        assert runner is None, f"{name}: statistics without compile_step stay on the Python plan"
    torch.testing.assert_close(fast.compute(), ref.compute(), rtol=0, atol=0, equal_nan=True)


def test_runner_takes_the_calls(monkeypatch):
    """After planning, neither the Python plan nor the checked update runs."""
    m = dk.WeightedMeanMetric()
    b = _batch(0)
    m.update(values=b["v0"], weights=b["w0"])

    def boom(*a, **k):
        raise AssertionError("the Python plan path ran")

    monkeypatch.setattr(plan.Plan, "run", boom)
    monkeypatch.setattr(dk.WeightedMeanMetric, "_inputs", boom)
    for s in range(5):
        m.update(values=_batch(s)["v0"], weights=_batch(s)["w0"])
    vals = [float(_batch(s)["v0"]) for s in [0, *range(5)]]
    ws = [float(_batch(s)["w0"]) for s in [0, *range(5)]]
    assert m.compute().item() == pytest.approx(np.average(vals, weights=ws), rel=1e-6)


def _group():
    return dk.MetricGroup({
        "loss": dk.WeightedMeanMetric(),
        "acc": dk.Accuracy(**MC, average="micro"),
        "top3": dk.Accuracy(**MC, average="micro", top_k=3),
        "f1": dk.F1Score(**MC, average="macro"),
        "precision": dk.Precision(**MC, average="macro"),
        "recall": dk.Recall(**MC, average="macro"),
        "cm": dk.ConfusionMatrix(**MC),
        "peak": dk.MaxMetric(),
    })


def _feed_group(g, steps=6):
    for s in range(steps):
        b = _batch(s)
        g["loss"].update(values=b["v0"], weights=b["w0"])
        g["peak"].update(b["v0"])
        if s % 2:
            g.update(preds=b["logits"], target=b["labels"], mask=b["mask"])
        else:
            g.update(preds=b["logits"], target=b["labels"])


def test_group_compiled_equals_python_plan_and_sklearn(monkeypatch):
    g = _group()
    _feed_group(g)
    runners = g._storage.compiled
    assert {id(g), id(g["loss"]), id(g["peak"])} <= set(runners), "group and member updates compiled"
    monkeypatch.setenv("D9D_KERNELS_COMPILED", "0")
    ref = _group()
    _feed_group(ref)
    got, want = _bits(g._storage), _bits(ref._storage)
    for k in KINDS:
        assert torch.equal(got[k], want[k]), k

    out = g.compute()
    p, t, scores, losses, ws = [], [], [], [], []
    for s in range(6):
        b = _batch(s)
        keep = b["mask"] if s % 2 else torch.ones_like(b["labels"], dtype=torch.bool)
        p.append(b["logits"].argmax(1)[keep])
        t.append(b["labels"][keep])
        scores.append(b["logits"][keep])
        losses.append(float(b["v0"]))
        ws.append(float(b["w0"]))
    p, t, scores = torch.cat(p).numpy(), torch.cat(t).numpy(), torch.cat(scores).numpy()
    assert out["acc"].item() == pytest.approx(accuracy_score(t, p), abs=1e-12)
    assert out["top3"].item() == pytest.approx(top_k_accuracy_score(t, scores, k=3, labels=range(C)), abs=1e-12)
    assert out["f1"].item() == pytest.approx(f1_score(t, p, average="macro", labels=range(C), zero_division=0), abs=1e-12)
    np.testing.assert_array_equal(out["cm"].numpy(), confusion_matrix(t, p, labels=range(C)))
    assert out["loss"].item() == pytest.approx(np.average(losses, weights=ws), rel=1e-9)
    assert out["peak"].item() == pytest.approx(max(losses))


def test_changed_metadata_falls_back_and_bad_input_leaves_state():
    g = _group()
    _feed_group(g, steps=2)
    before = _bits(g._storage)
    b = _batch(0)
    with pytest.raises((TypeError, ValueError), match="target"):
        g.update(preds=b["logits"], target=b["labels"].float())  # same shapes, another dtype: not the runner's
    with pytest.raises((TypeError, ValueError)):
        g["loss"].update(values=b["v0"], weights=torch.ones(3))  # bad weights shape
    after = _bits(g._storage)
    for k in KINDS:
        assert torch.equal(before[k], after[k]), k


def test_fast_update_runs_only_the_owners_local_runner():
    """_C.fast_update is the planned wrapper's compiled branch: it runs (True)
    only for a metric outside a group's routing whose runner is bound to the
    local views and whose signature matches; otherwise False with nothing
    written. Its argument errors are Python's TypeError."""
    if compiled.fast_update is compiled._not_taken:
        pytest.skip("extension without fast_update")
    g = _group()
    _feed_group(g, steps=2)
    loss, st = g["loss"], g._storage
    b = _batch(0)
    kw = dict(values=b["v0"], weights=b["w0"])
    before = _bits(st)
    assert compiled.fast_update(loss, (), dict(values=b["v0"], weights=torch.ones(2))) is False  # no signature
    assert compiled.fast_update(dk.WeightedMeanMetric(), (), kw) is False  # never planned: no runner
    loss.__dict__["_collector"] = []  # inside g.update's routing
    try:
        assert compiled.fast_update(loss, (), kw) is False
    finally:
        loss.__dict__["_collector"] = None
    st.forward_begin()  # a forward points the update at the scratch copy
    try:
        assert compiled.fast_update(loss, (), kw) is False
    finally:
        st.forward_end(fold=False)
    after = _bits(st)
    for k in KINDS:
        assert torch.equal(before[k], after[k]), k
    st.dirty = False
    assert compiled.fast_update(loss, (), kw) is True and st.dirty is True
    want = np.average([float(_batch(s)["v0"]) for s in (0, 1, 0)], weights=[float(_batch(s)["w0"]) for s in (0, 1, 0)])
    assert loss.compute().item() == pytest.approx(want, rel=1e-12)
    with pytest.raises(TypeError, match="fast_update"):
        compiled.fast_update(loss, [], kw)
    with pytest.raises(TypeError, match="fast_update"):
        compiled.fast_update(loss, ())


def test_moving_drops_runners():
    m = dk.WeightedMeanMetric()
    for s in range(2):
        m.update(values=_batch(s)["v0"], weights=_batch(s)["w0"])
    assert m._storage.compiled
    m.to("cpu")
    assert not m._storage.compiled
    m.update(values=torch.tensor(1.0), weights=torch.tensor(2.0))
    m.update(values=torch.tensor(3.0), weights=torch.tensor(2.0))
    assert m._storage.compiled


def test_torch_compile_traces_the_python_path():
    """torch.compile(fullgraph=True) never meets the C++ runner (a graph break)."""
    g = _group()
    _feed_group(g, steps=2)  # runners exist

    @torch.compile(fullgraph=True, backend="eager")
    def step(logits, labels, loss, w):
        g["loss"].update(values=loss, weights=w)
        g.update(preds=logits, target=labels)

    ref = _group()
    _feed_group(ref, steps=2)
    for s in range(2, 4):
        b = _batch(s)
        step(b["logits"], b["labels"], b["v0"], b["w0"])
        ref["loss"].update(values=b["v0"], weights=b["w0"])
        ref.update(preds=b["logits"], target=b["labels"])
    got, want = _bits(g._storage), _bits(ref._storage)
    for k in KINDS:
        assert torch.equal(got[k], want[k]), k


def test_forward_runs_the_scratch_runner_and_equals_the_python_plan(monkeypatch):
    """forward() points the update at a scratch copy: the state's runner must
    not run there, its copy bound to the scratch views (compiled.on_scratch)
    does, with no Python plan; batch values and state equal the Python plan's."""
    def run(g, steps=range(4)):
        outs = []
        for s in steps:
            b = _batch(s)
            g["loss"].update(values=b["v0"], weights=b["w0"])
            g.update(preds=b["logits"], target=b["labels"])
            outs.append(g(preds=b["logits"], target=b["labels"]))
            outs.append({"loss": g["loss"](values=b["v0"], weights=b["w0"])})
        return outs

    g = _group()
    got = run(g, range(2))
    assert id(g) in g._storage.compiled
    assert compiled.on_scratch(g._storage, g._storage.compiled[id(g)]) is not None

    def boom(*a, **k):
        raise AssertionError("the Python plan path ran")

    with monkeypatch.context() as mp:
        mp.setattr(plan.Plan, "run", boom)
        got += run(g, range(2, 4))
    monkeypatch.setenv("D9D_KERNELS_COMPILED", "0")
    ref = _group()
    want = run(ref)
    for o, w in zip(got, want):
        for k in w:
            torch.testing.assert_close(o[k], w[k], rtol=0, atol=0, equal_nan=True, msg=k)
    a, b = _bits(g._storage), _bits(ref._storage)
    for k in KINDS:
        assert torch.equal(a[k], b[k]), k


def test_scratch_runner_not_made_when_a_constant_is_not_a_state_view(monkeypatch):
    """A compiled step whose op constants include a tensor that is not one of
    the state views cannot be moved to the scratch: forward keeps the Python
    plan for that owner and still equals it."""
    m = dk.WeightedMeanMetric()
    b = _batch(0)
    m.update(values=b["v0"], weights=b["w0"])
    m(values=b["v0"], weights=b["w0"])  # allocates the scratch
    st = m._storage
    entry = st.compiled[id(m)]
    nargs, kwnames, checks, steps = entry.adds[0]
    op, overload, consts, slots = steps[0]
    foreign = [(pos, v.clone() if isinstance(v, torch.Tensor) else v) for pos, v in consts]
    entry.adds[0] = (nargs, kwnames, checks, [(op, overload, foreign, slots)])
    entry.scratch = None
    assert compiled.on_scratch(st, entry) is None
    ref = dk.WeightedMeanMetric()
    ref.update(values=b["v0"], weights=b["w0"])
    ref(values=b["v0"], weights=b["w0"])
    for s in range(1, 4):
        bs = _batch(s)
        torch.testing.assert_close(m(values=bs["v0"], weights=bs["w0"]), ref(values=bs["v0"], weights=bs["w0"]),
                                   rtol=0, atol=0)
    torch.testing.assert_close(m.compute(), ref.compute(), rtol=0, atol=0)
