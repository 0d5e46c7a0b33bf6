"""forward: ``metric(...)`` / ``g(**inputs)`` accumulates AND returns the batch value.

Every catalogue metric against torchmetrics' own forward on the same batches:
the batch values and the accumulated compute(); groups against
torchmetrics' MetricCollection; custom add_state metrics against plain torch;
forward interleaved with update equals update alone (pivots, NaN, maxima)."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
import torch
import torchmetrics as tm
import torchmetrics.text

import d9d_kernels as dk
import d9d_kernels.metrics  # noqa: F401  (fills core.metric.FUSED, read by the one-call forward tests)
from d9d_kernels.core import compiled
from d9d_kernels.core.plan import Plan
from tests.metrics._catalogue_utils import _one_thread  # noqa: F401

C, L = 5, 3


def _batches(task: str, seed: int, n_batches: int = 4, sizes=(17, 32, 9, 40)):
    g = torch.Generator().manual_seed(seed)
    for b in range(n_batches):
        n = sizes[b % len(sizes)]
        if task == "multiclass":
            preds = torch.randn(n, C, generator=g)
            target = torch.randint(0, C, (n,), generator=g)
        elif task == "multiclass_idx":
            preds = torch.randint(0, C, (n,), generator=g)
            target = torch.randint(0, C, (n,), generator=g)
        elif task == "binary":
            preds = torch.rand(n, generator=g)
            target = torch.randint(0, 2, (n,), generator=g)
        elif task == "multilabel":
            preds = torch.rand(n, L, generator=g)
            target = torch.randint(0, 2, (n, L), generator=g)
        else:  # regression
            target = torch.randn(n, generator=g, dtype=torch.float64) + 3.0
            preds = target + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
        yield preds, target


def _tm_kwargs(task):
    return {"multiclass": dict(task="multiclass", num_classes=C), "multiclass_idx": dict(task="multiclass", num_classes=C),
            "binary": dict(task="binary"), "multilabel": dict(task="multilabel", num_labels=L)}[task]


CLASSIFICATION = [
    # (name, d9d factory, torchmetrics factory, tasks)
    ("Accuracy", lambda kw: dk.Accuracy(**kw), lambda kw: tm.Accuracy(**kw), None),
    ("Accuracy-macro", lambda kw: dk.Accuracy(**kw, average="macro"), lambda kw: tm.Accuracy(**kw, average="macro"), None),
    ("Precision-macro", lambda kw: dk.Precision(**kw, average="macro"), lambda kw: tm.Precision(**kw, average="macro"), None),
    ("Recall-weighted", lambda kw: dk.Recall(**kw, average="weighted"), lambda kw: tm.Recall(**kw, average="weighted"), None),
    ("F1-none", lambda kw: dk.F1Score(**kw, average="none"), lambda kw: tm.F1Score(**kw, average="none"), None),
    ("FBeta", lambda kw: dk.FBetaScore(**kw, beta=2.0, average="macro"),
     lambda kw: tm.FBetaScore(**kw, beta=2.0, average="macro"), None),
    ("Specificity", lambda kw: dk.Specificity(**kw, average="macro"), lambda kw: tm.Specificity(**kw, average="macro"), None),
    ("Jaccard", lambda kw: dk.JaccardIndex(**kw), lambda kw: tm.JaccardIndex(**kw), None),
    ("MCC", lambda kw: dk.MatthewsCorrCoef(**kw), lambda kw: tm.MatthewsCorrCoef(**kw), None),
    ("Kappa", lambda kw: dk.CohenKappa(**kw), lambda kw: tm.CohenKappa(**kw), ("multiclass", "binary")),
    ("ConfMat", lambda kw: dk.ConfusionMatrix(**kw), lambda kw: tm.ConfusionMatrix(**kw), None),
    ("ConfMat-true", lambda kw: dk.ConfusionMatrix(**kw, normalize="true"),
     lambda kw: tm.ConfusionMatrix(**kw, normalize="true"), ("multiclass",)),
    ("Top2", lambda kw: dk.Accuracy(**kw, top_k=2), lambda kw: tm.Accuracy(**kw, top_k=2), ("multiclass",)),
]


def _close(a, b, atol, msg):
    a = a.detach().double().cpu().numpy()
    b = torch.as_tensor(b).detach().double().cpu().numpy()
    assert a.shape == b.shape, f"{msg}: shape {a.shape} vs {b.shape}"
    np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=msg, equal_nan=True)


def _run_pair(ours, theirs, batches, atol, kwargs=lambda p, t: ((p, t), {})):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, (p, t) in enumerate(batches):
            a, k = kwargs(p, t)
            _close(ours(*a, **k), theirs(*a, **k), atol, f"batch {i}")
        _close(ours.compute(), theirs.compute(), atol, "accumulated compute()")


@pytest.mark.parametrize("task", ["multiclass", "multiclass_idx", "binary", "multilabel"])
@pytest.mark.parametrize("case", CLASSIFICATION, ids=[c[0] for c in CLASSIFICATION])
def test_classification_forward_matches_torchmetrics(task, case):
    name, ours, theirs, tasks = case
    base = "multiclass" if task == "multiclass_idx" else task
    if tasks is not None and base not in tasks:
        pytest.skip(f"{name}: {task} not compared")
    if name == "Top2" and task == "multiclass_idx":
        pytest.skip("top_k needs scores")
    kw = _tm_kwargs(task)
    _run_pair(ours(kw), theirs(kw), _batches(task, seed=hash(name) % 1000), atol=1e-6)  # torchmetrics: float32


@pytest.mark.parametrize("cls", ["MeanSquaredError", "MeanAbsoluteError", "R2Score", "PearsonCorrCoef", "ExplainedVariance"])
def test_regression_forward_matches_torchmetrics(cls):
    _run_pair(getattr(dk, cls)(), getattr(tm, cls)(), _batches("regression", 3), atol=1e-6)  # torchmetrics: float32 states


def test_regression_forward_with_large_offset_keeps_pivot_exactness():
    """Batch values about the state's pivot: exact for 1e9 + noise (torchmetrics float64 reference)."""
    from sklearn.metrics import r2_score

    g = torch.Generator().manual_seed(5)
    ours, ours_v = dk.R2Score(), dk.PearsonCorrCoef()
    ps, ts = [], []
    for _ in range(4):
        t = 1e9 + torch.randn(30, generator=g, dtype=torch.float64)
        p = t + 0.3 * torch.randn(30, generator=g, dtype=torch.float64)
        ps.append(p.numpy()), ts.append(t.numpy())
        _close(ours(p, t), r2_score(t.numpy(), p.numpy()), 1e-6, "r2 batch")
        _close(ours_v(p, t), np.corrcoef(p.numpy() - 1e9, t.numpy() - 1e9)[0, 1], 1e-6, "pearson batch")
    _close(ours.compute(), r2_score(np.concatenate(ts), np.concatenate(ps)), 1e-6, "r2 total")
    assert ours._storage.local["replica"][0].item() > 1e9 - 10  # pivot set near the data


@pytest.mark.parametrize("cls", ["SumMetric", "MaxMetric", "MinMetric", "MeanMetric"])
def test_aggregation_forward_matches_torchmetrics(cls):
    g = torch.Generator().manual_seed(7)
    ours, theirs = getattr(dk, cls)(), getattr(tm, cls)().set_dtype(torch.float64)
    for n in (5, 1, 12):
        x = torch.randn(n, generator=g, dtype=torch.float64) * 10
        _close(ours(x), theirs(x), 1e-12, f"{cls} batch")
    _close(ours(2.5), theirs(2.5), 1e-12, f"{cls} number")
    _close(ours.compute(), theirs.compute(), 1e-12, f"{cls} total")


def test_weighted_mean_forward_matches_torchmetrics_mean_with_weights():
    g = torch.Generator().manual_seed(8)
    ours, ours_mm, theirs = dk.WeightedMeanMetric(), dk.MeanMetric(), tm.MeanMetric().set_dtype(torch.float64)
    for n in (6, 3, 9):
        x = torch.randn(n, generator=g, dtype=torch.float64)
        w = torch.rand(n, generator=g, dtype=torch.float64)
        ref = theirs(x, w)
        _close(ours(x, weights=w), ref, 1e-12, "weighted mean batch")
        _close(ours_mm(x, weight=w), ref, 1e-12, "MeanMetric batch")
    _close(ours.compute(), theirs.compute(), 1e-12, "total")
    _close(ours_mm.compute(), theirs.compute(), 1e-12, "total")


@pytest.mark.parametrize("cls", ["AUROC", "AveragePrecision"])
@pytest.mark.parametrize("task", ["binary", "multiclass", "multilabel"])
def test_ranking_forward_matches_torchmetrics_exact_within_bins(cls, task):
    kw = _tm_kwargs(task)
    ours = getattr(dk, cls)(**kw, num_bins=10_000)
    theirs = getattr(tm, cls)(**kw)  # exact (thresholds=None): within the bins' 1e-3
    # batches large enough that every class has positives and negatives (the
    # macro conventions for an absent class differ: docs/metrics.md)
    batches = [(p.double(), t) for p, t in _batches(task, 11, sizes=(80, 120, 60))]
    if task == "multiclass":
        batches = [(p.softmax(-1), t) for p, t in batches]
    _run_pair(ours, theirs, batches, atol=2e-3)


def test_perplexity_forward_matches_torchmetrics():
    g = torch.Generator().manual_seed(9)
    ours, ours_v, theirs = dk.Perplexity(ignore_index=0), dk.Perplexity(ignore_index=0, num_classes=11), \
        torchmetrics.text.Perplexity(ignore_index=0)
    for B, T in ((2, 7), (3, 5)):
        logits = torch.randn(B, T, 11, generator=g)
        tgt = torch.randint(0, 11, (B, T), generator=g)
        ref = theirs(logits, tgt)
        _close(ours(logits, tgt), ref, 1e-4, "perplexity batch")
        _close(ours_v(logits, tgt), ref, 1e-4, "perplexity (vocab) batch")
    _close(ours.compute(), theirs.compute(), 1e-4, "perplexity total")


def test_group_forward_matches_metric_collection_with_prefix():
    kw = dict(task="multiclass", num_classes=C)
    g = dk.MetricGroup({
        "acc": dk.Accuracy(**kw), "top2": dk.Accuracy(**kw, top_k=2), "f1": dk.F1Score(**kw, average="macro"),
        "cm": dk.ConfusionMatrix(**kw), "mcc": dk.MatthewsCorrCoef(**kw), "loss": dk.WeightedMeanMetric(),
    }, prefix="train/", postfix="_x")
    col = tm.MetricCollection({
        "acc": tm.Accuracy(**kw), "top2": tm.Accuracy(**kw, top_k=2), "f1": tm.F1Score(**kw, average="macro"),
        "cm": tm.ConfusionMatrix(**kw), "mcc": tm.MatthewsCorrCoef(**kw),
    }, prefix="train/", postfix="_x")
    loss_ref = tm.MeanMetric().set_dtype(torch.float64)
    assert len(g._storage.layout.stats) == 2  # acc, top2, f1, cm, mcc share one class statistic
    for p, t in _batches("multiclass", 21):
        ours = g(preds=p, target=t)
        ref = col(p, t)
        assert sorted(ours) == sorted(ref)  # routed members only (not "loss"), prefixed keys
        for k in ref:
            _close(ours[k], ref[k], 1e-6, k)
        lv = p.double().logsumexp(-1).mean()
        _close(g["loss"](lv, weights=float(len(t))), loss_ref(lv, float(len(t))), 1e-12, "loss member forward")
    total, ref = g.compute(), col.compute()
    assert set(total) == set(ref) | {"train/loss_x"}
    for k in ref:
        _close(total[k], ref[k], 1e-6, k)
    _close(total["train/loss_x"], loss_ref.compute(), 1e-12, "loss")


def test_member_forward_feeds_the_members_it_shares_with():
    kw = dict(task="multiclass", num_classes=C)
    g = dk.MetricGroup({"acc": dk.Accuracy(**kw), "f1": dk.F1Score(**kw, average="macro")})
    ref_acc, ref_f1 = tm.Accuracy(**kw), tm.F1Score(**kw, average="macro")
    for p, t in _batches("multiclass", 4):
        _close(g["acc"](p, t), ref_acc(p, t), 1e-6, "acc batch")
        ref_f1.update(p, t)
    _close(g.compute()["f1"], ref_f1.compute(), 1e-6, "f1 fed through acc's shared statistic")


class _RMS(dk.Metric):
    def __init__(self):
        super().__init__()
        self.add_state("sum_sq", kind="sum", shape=())
        self.add_state("count", kind="sum", shape=())
        self.add_state("peak", kind="max", shape=())
        self.add_state("offset", kind="sum", shape=(), init=10.0)  # non-zero reset value

    def _update(self, values):
        self.sum_sq += values.double().square().sum()
        self.count += values.numel()
        self.peak = torch.maximum(self.peak, values.double().abs().max())
        self.offset += 1.0

    def _compute(self, state):
        return torch.stack([(state["sum_sq"] / state["count"]).sqrt(), state["peak"], state["offset"]])


def test_custom_add_state_metric_forward_matches_plain_torch():
    g = torch.Generator().manual_seed(12)
    m = _RMS()
    seen = []
    for n in (4, 7, 2):
        x = torch.randn(n, generator=g)
        seen.append(x.double())
        batch = m(x)
        _close(batch, torch.stack([x.double().square().mean().sqrt(), x.double().abs().max(), torch.tensor(11.0)]),
               1e-12, "custom batch")
    allx = torch.cat(seen)
    _close(m.compute(), torch.stack([allx.square().mean().sqrt(), allx.abs().max(), torch.tensor(13.0)]), 1e-12, "custom total")


def _equal_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.nan_to_num(a, nan=123.25), torch.nan_to_num(b, nan=123.25)) and \
        torch.equal(torch.isnan(a), torch.isnan(b))


def _count_one_calls(monkeypatch, record):
    """Returns ``FUSED["forward"]`` wrapped to call ``record(owner, took)``
    after each call (``took``: it ran the one call), for the test to install
    where it wants the one call; and counts the C++ steady state
    (``compiled.fast_forward``, tried first, on the shortcut the last one call
    of the same input names left) the same way wherever it ran."""
    from d9d_kernels.core import group, metric
    from d9d_kernels.core.metric import FUSED

    one_call, fast = FUSED["forward"], compiled.fast_forward

    def first(*a):
        r = one_call(*a)
        record(a[0], r is not None)
        return r

    def steady(owner, args, kwargs):
        r = fast(owner, args, kwargs)
        if r is not None:
            record(owner, True)
        return r

    monkeypatch.setattr(group, "_fast_forward", steady)
    monkeypatch.setattr(metric, "_fast_forward", steady)
    return first


def _no_steady_state(monkeypatch):
    from d9d_kernels.core import group, metric

    monkeypatch.setattr(group, "_fast_forward", lambda *a: None)
    monkeypatch.setattr(metric, "_fast_forward", lambda *a: None)


def _fast_and_slow_step(monkeypatch, counted, fast, slow, call, where) -> None:
    """``call(g, out)`` on ``fast`` (its forward may take the one call, counted)
    and on its twin ``slow`` (never); asserts the outputs and the state bits
    are equal, ``where`` naming the step in a failure."""
    from d9d_kernels.core.metric import FUSED

    got, want = {}, {}
    for g, out in ((fast, got), (slow, want)):
        monkeypatch.setitem(FUSED, "forward", counted if g is fast else (lambda *a: None))
        call(g, out)
    assert got.keys() == want.keys()
    for k in want:
        assert _equal_nan(got[k], want[k]), (*where, k)
    for k in ("sum", "max", "replica"):  # replica: an unset pivot is NaN
        assert _equal_nan(fast._storage.local[k], slow._storage.local[k]), (*where, k)


@pytest.mark.parametrize("native", [True, False], ids=["scratch_ranges", "torch ops"])
@pytest.mark.parametrize("strategy", ["propagate", "ignore"])
def test_forward_state_equals_update_state_with_nan_inf_and_unset_pivots(strategy, native, monkeypatch):
    """The fold (sums added, maxima maxed, pivots copied) leaves exactly the
    state update() would have: NaN/Inf batches, batches with no valid element
    before the pivot is set, masks; by the C++ reset and fold (CPU) and by
    the torch ops (other devices)."""
    from d9d_kernels.core import storage

    assert storage._SCRATCH_RANGES is not None
    if not native:
        monkeypatch.setattr(storage, "_SCRATCH_RANGES", None)
    vals = [torch.tensor([float("nan"), 2.0]), torch.tensor([float("inf")]), torch.tensor([5.0, -1.0]),
            torch.tensor([3.0, float("-inf")]), torch.tensor([7.0])]
    masks = [None, None, torch.tensor([False, True]), None, None]
    for cls in (dk.SumMetric, dk.WeightedMeanMetric, dk.MaxMetric, dk.MinMetric):
        fw, up = cls(nan_strategy=strategy), cls(nan_strategy=strategy)
        for x, mk in zip(vals, masks):
            fw(x, mask=mk)
            up.update(x, mask=mk)
            for k in ("sum", "max", "replica"):
                assert _equal_nan(fw._storage.local[k], up._storage.local[k]), (cls.__name__, k)
    p = torch.tensor([1e6 + 1, 1e6 + 2, float("nan")], dtype=torch.float64)
    t = torch.tensor([1e6 + 1.5, 1e6 + 2.5, 1e6], dtype=torch.float64)
    fw, up = dk.R2Score(nan_strategy=strategy), dk.R2Score(nan_strategy=strategy)
    for sl in (slice(2, 3), slice(0, 2), slice(0, 3)):  # first batch: no valid element (pivot stays unset)
        fw(p[sl], t[sl])
        up.update(p[sl], t[sl])
    for k in ("sum", "replica"):
        assert _equal_nan(fw._storage.local[k], up._storage.local[k]), k


def test_scratch_ranges_equal_the_torch_ops():
    """_C.scratch_ranges (forward's reset and fold on CPU) against the torch
    ops it stands for, on NaN, Inf, signed zeros and non-zero reset values."""
    from d9d_kernels import _C

    gen = torch.Generator().manual_seed(0)
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.5], dtype=torch.float64)

    def values(n):
        x = torch.randn(n, generator=gen, dtype=torch.float64)
        pick = torch.rand(n, generator=gen) < 0.4
        return torch.where(pick, special[torch.randint(0, 6, (n,), generator=gen)], x)

    for kind, with_init, n in itertools.product((0, 1, 2), (False, True), (37, 200_003)):  # one task; several
        state, scratch, init = values(n), values(n), values(n) if with_init else None
        for fold in (False, True):
            s_got, x_got = state.clone(), scratch.clone()
            _C.scratch_ranges([(kind, s_got, x_got, init)], fold)
            s_want, x_want = state.clone(), scratch.clone()
            if not fold:
                if kind == 2:
                    x_want.copy_(s_want)
                elif init is None:
                    x_want.zero_()
                else:
                    x_want.copy_(init)
            elif kind == 0:
                s_want.add_(x_want if init is None else x_want - init)
            elif kind == 1:
                torch.maximum(s_want, x_want, out=s_want)
            else:
                s_want.copy_(x_want)
            assert _equal_nan(s_got, s_want) and _equal_nan(x_got, x_want), (kind, with_init, n, fold)
    ok = torch.zeros(4, dtype=torch.float64)
    for bad, what in (((3, ok, ok.clone(), None), "kind 3"), ((0, ok, torch.zeros(4), None), "scratch"),
                      ((0, ok, ok.clone(), torch.zeros(3, dtype=torch.float64)), "reset value"),
                      ((0, torch.zeros(8, dtype=torch.float64)[::2], ok.clone(), None), "state")):
        with pytest.raises(RuntimeError, match=f"scratch_ranges: argument 'ranges' holds .*{what}"):
            _C.scratch_ranges([bad], True)


@pytest.mark.parametrize("strategy", ["error", "propagate"])
def test_forward_in_one_call_equals_the_python_steps(strategy, monkeypatch):
    """PlanRunner.forward (reset, update, fold and batch values in one C++
    call) against forward's Python steps: the same values and the same state
    bits over forwards of a group and of its members mixed with updates, a
    NaN batch, the confusion matrix, a new input signature (its first call
    runs checked) and a member outside the group_values program (kappa: the
    group's forward keeps the Python steps)."""
    kw = dict(task="multiclass", num_classes=C, nan_strategy=strategy)
    ran = []  # (kappa, owner class) of each forward that took the one call
    counted = _count_one_calls(monkeypatch, lambda owner, took: took and ran.append((kappa, type(owner).__name__)))

    def make(kappa):
        ms = {"loss": dk.WeightedMeanMetric(), "acc": dk.Accuracy(**kw), "top2": dk.Accuracy(**kw, top_k=2),
              "f1": dk.F1Score(**kw, average="macro"), "cm": dk.ConfusionMatrix(**kw), "mx": dk.MaxMetric()}
        if kappa:
            ms["kappa"] = dk.CohenKappa(**kw)
        return dk.MetricGroup(ms)

    for kappa in (False, True):
        fast, slow = make(kappa), make(kappa)
        gen = torch.Generator().manual_seed(int(kappa))
        for step in range(8):
            n = (17, 32, 9)[step % 3]
            p = torch.randn(n, C, generator=gen, dtype=torch.float64 if step == 5 else torch.float32)
            if step == 3:
                p[2, 1] = float("nan")
            t = torch.randint(0, C, (n,), generator=gen)
            x = torch.randn(n, generator=gen)
            w = 2.0 if step % 2 else torch.rand(n, generator=gen)

            def call(g, out):
                if step == 6:
                    g.update(preds=p, target=t)
                else:
                    out.update(g(preds=p, target=t))
                out["loss"] = g["loss"](x, weights=w)
                out["mx"] = g["mx"](x)

            _fast_and_slow_step(monkeypatch, counted, fast, slow, call, (kappa, step))
        if strategy == "error":  # the NaN batch's count raises in both
            with pytest.raises(ValueError) as a:
                fast.compute()
            with pytest.raises(ValueError) as b:
                slow.compute()
            assert str(a.value) == str(b.value)
        else:
            for k in ("acc", "cm", "loss", "mx"):
                assert _equal_nan(fast.compute()[k], slow.compute()[k]), k
    # after the first call of each input signature; never the group with kappa routed
    assert ran.count((False, "MetricGroup")) >= 2 and ran.count((True, "MetricGroup")) == 0, ran
    assert ran.count((True, "WeightedMeanMetric")) >= 2 and ran.count((True, "MaxMetric")) >= 2, ran


def test_one_call_forward_of_a_large_sparse_confusion_matrix(monkeypatch):
    """The one-call forward folds and resets the scratch in one pass that
    skips the blocks a small batch left at zero (most of a [C, C] matrix):
    batch values and state bits equal forward's Python steps over forwards
    of the group and of a member mixed with updates (the scratch protocol
    between the two paths), and the matrices equal scikit-learn's."""
    from sklearn.metrics import confusion_matrix

    K = 100  # a 10 000-cell matrix: a batch of 5 rows leaves most 64-cell blocks at zero
    kw = dict(task="multiclass", num_classes=K)
    took = []  # owner class of each forward that took the one call
    counted = _count_one_calls(monkeypatch, lambda owner, ran: ran and took.append(type(owner).__name__))

    def make():
        return dk.MetricGroup({"cm": dk.ConfusionMatrix(**kw), "acc": dk.Accuracy(**kw), "loss": dk.WeightedMeanMetric()})

    fast, slow = make(), make()
    gen = torch.Generator().manual_seed(7)
    seen_t, seen_p = [], []
    for step in range(8):
        n = (5, 3, 64)[step % 3]
        p, t = torch.randn(n, K, generator=gen), torch.randint(0, K, (n,), generator=gen)
        x = torch.randn(n, generator=gen)
        seen_t.append(t)
        seen_p.append(p.argmax(1))

        def call(g, out):
            if step == 4:
                g.update(preds=p, target=t)
            else:
                out.update(g(preds=p, target=t))
                ref = confusion_matrix(t.numpy(), p.argmax(1).numpy(), labels=list(range(K)))
                np.testing.assert_array_equal(out["cm"].numpy(), ref)
            out["loss"] = g["loss"](x)

        _fast_and_slow_step(monkeypatch, counted, fast, slow, call, (step,))
    ref = confusion_matrix(torch.cat(seen_t).numpy(), torch.cat(seen_p).numpy(), labels=list(range(K)))
    np.testing.assert_array_equal(fast.compute()["cm"].numpy(), ref)
    # after the first call of each of the 3 input signatures: the one call
    assert took.count("MetricGroup") >= 3 and took.count("WeightedMeanMetric") >= 4, took


def test_forward_in_one_call_that_raises_leaves_the_state_and_resets_every_range(monkeypatch):
    """An error inside PlanRunner.forward (after its scratch writes) leaves
    the state as it was, and the next forward resets every scratch range."""
    _no_steady_state(monkeypatch)  # the runner is replaced below; the steady state reaches it by its capsule
    kw = dict(task="multiclass", num_classes=C)
    make = lambda: dk.MetricGroup({"acc": dk.Accuracy(**kw), "cm": dk.ConfusionMatrix(**kw)})  # noqa: E731
    g, twin = make(), make()
    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(12, C, generator=gen), torch.randint(0, C, (12,), generator=gen)) for _ in range(3)]
    for m in (g, twin):
        m(preds=batches[0][0], target=batches[0][1])
        m(preds=batches[0][0], target=batches[0][1])  # a known signature: the one-call path from here
    st = g._storage
    runner = st.compiled[id(g)].scratch[2]
    real = runner.runner

    class Raising:
        def forward(self, args, kwargs, reset, select):
            for b in st.scratch.values():
                b.fill_(7.0)  # what a failing op may have written
            raise RuntimeError("kernel failed")

    before = {k: v.clone() for k, v in st.local.items()}
    runner.runner = Raising()
    with pytest.raises(RuntimeError, match="kernel failed"):
        g(preds=batches[1][0], target=batches[1][1])
    runner.runner = real
    assert all(torch.equal(st.local[k], before[k]) for k in before)
    covered = sum(r[2].numel() for r in st.scratch_dirty.ranges if r[0] == "sum")
    assert covered == st.layout.sizes["sum"]  # every statistic's range, not only the signature's
    got, want = g(preds=batches[2][0], target=batches[2][1]), twin(preds=batches[2][0], target=batches[2][1])
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert all(torch.equal(st.local[k], twin._storage.local[k]) for k in before)


def test_forward_steady_state_runs_only_on_a_valid_shortcut(monkeypatch):
    """compiled.fast_forward (a forward in one C++ call on the shortcut the
    last one-call forward of the same input names left) gives the Python
    steps' values and state bits, for a group's positional inputs too; it returns None with the state and the
    scratch untouched for other input names, inside a forward, after a
    Python-path forward of a member moved the scratch on, with a new fused
    plan, after .to() dropped the runners, and for an unmatched signature;
    an error inside it leaves the state and marks every scratch range for
    reset; its argument errors are TypeError."""
    if compiled.fast_forward is compiled._no_shortcut:
        pytest.skip("extension without fast_forward")
    from d9d_kernels.core.metric import FUSED

    kw = dict(task="multiclass", num_classes=C)
    make = lambda: dk.MetricGroup({"acc": dk.Accuracy(**kw), "cm": dk.ConfusionMatrix(**kw),  # noqa: E731
                                   "loss": dk.WeightedMeanMetric()})
    g, twin = make(), make()
    gen = torch.Generator().manual_seed(11)

    def batch(n=13):
        return dict(preds=torch.randn(n, C, generator=gen), target=torch.randint(0, C, (n,), generator=gen))

    def python_steps(b, twin=twin):  # the twin's forward, never the one call
        monkeypatch.setitem(FUSED, "forward", lambda *a: None)
        try:
            return twin(**b)
        finally:
            monkeypatch.undo()

    def same_state():
        return all(_equal_nan(g._storage.local[k], twin._storage.local[k]) for k in g._storage.local)

    for _ in range(2):  # the first forward runs the Python steps, the second the one call: it leaves the shortcut
        b = batch()
        g(**b), python_steps(b)
    st = g._storage
    cut = st.compiled[id(g)].shortcuts[frozenset(b)]
    assert isinstance(cut, compiled.ForwardShortcut) and cut.dirty is st.scratch_dirty

    b = batch()
    st.dirty = False
    got, want = compiled.fast_forward(g, (), b), python_steps(b)
    assert st.dirty is True and list(got) == list(want) == ["acc", "cm"]
    assert all(torch.equal(got[k], want[k]) for k in want) and same_state()
    # a group's positional inputs are named first, then take it too (from the third forward on)
    pos, pos_twin = (dk.MetricGroup({"acc": dk.Accuracy(**kw), "cm": dk.ConfusionMatrix(**kw)}) for _ in range(2))
    with pytest.MonkeyPatch.context() as mp:
        took = []
        _count_one_calls(mp, lambda owner, ran: ran and took.append(owner))
        for _ in range(3):
            b = batch()
            got, want = pos(b["preds"], b["target"]), python_steps(b, pos_twin)
            assert all(torch.equal(got[k], want[k]) for k in want)
    assert took == [pos]
    assert all(_equal_nan(pos._storage.local[k], pos_twin._storage.local[k]) for k in pos._storage.local)

    def not_taken(owner, args, kwargs):
        st = owner._storage
        local = {k: v.clone() for k, v in st.local.items()}
        scratch = {k: v.clone() for k, v in (st.scratch or {}).items()}
        assert compiled.fast_forward(owner, args, kwargs) is None
        assert all(_equal_nan(st.local[k], local[k]) for k in local)
        assert all(_equal_nan(st.scratch[k], scratch[k]) for k in scratch)

    b = batch()
    not_taken(g, (), dict(preds=b["preds"]))  # other input names: no shortcut
    not_taken(g, (), dict(b, preds=b["preds"].double()))  # no signature matches
    st.forward_begin()  # a forward runs
    try:
        not_taken(g, (), b)
    finally:
        st.forward_end(fold=False)
    plan = g.__dict__["_fused_plan"]
    g.__dict__["_fused_plan"] = object()  # a new fused plan
    try:
        not_taken(g, (), b)
    finally:
        g.__dict__["_fused_plan"] = plan
    got, want = g(**b), python_steps(b)  # still valid: the steady state
    assert all(torch.equal(got[k], want[k]) for k in want) and same_state()

    # a member's forward through the Python steps moves the scratch on
    x = torch.randn(5, generator=gen)
    monkeypatch.setitem(FUSED, "forward", lambda *a: None)
    _no_steady_state(monkeypatch)
    g["loss"](x), twin["loss"](x)
    monkeypatch.undo()
    b = batch()
    not_taken(g, (), b)
    got, want = g(**b), python_steps(b)
    assert all(torch.equal(got[k], want[k]) for k in want) and same_state()

    # an error inside the call: nothing folded, every range reset by the next forward
    b = batch()
    g(**b), python_steps(b)  # the shortcut again
    shortcuts = st.compiled[id(g)].shortcuts
    cut = shortcuts[frozenset(b)]
    shortcuts[frozenset(b)] = cut._replace(select=[("acc", 99)])
    local = {k: v.clone() for k, v in st.local.items()}
    with pytest.raises(RuntimeError, match="value index 99 outside"):
        compiled.fast_forward(g, (), b)
    assert all(_equal_nan(st.local[k], local[k]) for k in local) and st.scratch_dirty is cut.all_dirty
    b = batch()
    got, want = g(**b), python_steps(b)
    assert all(torch.equal(got[k], want[k]) for k in want) and same_state()

    for m in (g, twin):  # .to() drops the runners: not taken until a one call leaves a new shortcut
        m.to("cpu")
    not_taken(g, (), b)
    for _ in range(3):
        b = batch()
        got, want = g(**b), python_steps(b)
        assert all(torch.equal(got[k], want[k]) for k in want) and same_state()
    with pytest.raises(TypeError, match="fast_forward"):
        compiled.fast_forward(g, [], b)
    with pytest.raises(TypeError, match="fast_forward"):
        compiled.fast_forward(g, ())


def test_forward_interleaved_with_update_planned_and_no_new_allocation():
    kw = dict(task="multiclass", num_classes=C)
    make = lambda: dk.MetricGroup({"acc": dk.Accuracy(**kw), "f1": dk.F1Score(**kw, average="macro"),  # noqa: E731
                                   "loss": dk.WeightedMeanMetric()})
    a, b = make(), make()
    ptrs = set()
    for i, (p, t) in enumerate(_batches("multiclass", 6, 8)):
        if i % 2:
            a(preds=p, target=t)
            ptrs.add(a._storage.scratch["sum"].data_ptr())
        else:
            a.update(preds=p, target=t)
        a["loss"](p.mean(), weights=float(len(t)))
        b.update(preds=p, target=t)
        b["loss"].update(p.mean(), weights=float(len(t)))
    assert len(ptrs) == 1  # one scratch per storage, reused
    assert any(isinstance(v, Plan) for v in a._storage.plans.values())  # forward runs the planned kernels
    for k in ("sum", "replica"):
        assert torch.allclose(a._storage.local[k], b._storage.local[k], rtol=1e-14, atol=0, equal_nan=True)


def test_forward_batch_value_never_aliases_the_scratch():
    m = dk.ConfusionMatrix(task="multiclass", num_classes=3)
    first = m(torch.tensor([0, 1]), torch.tensor([0, 1]))
    kept = first.clone()
    m(torch.tensor([2, 2]), torch.tensor([0, 0]))
    assert torch.equal(first, kept)


def test_forward_errors_leave_state_and_name_the_member():
    g = dk.MetricGroup({"acc": dk.Accuracy(task="multiclass", num_classes=3), "mse": dk.MeanSquaredError()})
    g(preds=torch.tensor([0, 1]), target=torch.tensor([0, 2]))
    before = {k: v.clone() for k, v in g._storage.local.items()}
    with pytest.raises(ValueError, match=r"MetricGroup\['acc'\] \(Accuracy\) \(inputs routed there by g\.update"):
        g(preds=torch.tensor([0, 1, 2]), target=torch.tensor([0, 2]))
    with pytest.raises(ValueError, match=r"MetricGroup\['mse'\] \(MeanSquaredError\)\.update: argument 'target'"):
        g["mse"](torch.zeros(3), torch.zeros(2))
    for k, v in before.items():
        assert torch.equal(g._storage.local[k], v)
    # a bad class index is counted, not raised, by forward; compute() raises it
    v = g["acc"](torch.tensor([0]), torch.tensor([9]))
    assert math.isfinite(v.item()) or math.isnan(v.item())
    with pytest.raises(ValueError, match="target_out_of_range"):
        g.compute()


def test_forward_on_cuda_has_no_host_sync():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    kw = dict(task="multiclass", num_classes=C)
    g = dk.MetricGroup({"acc": dk.Accuracy(**kw), "f1": dk.F1Score(**kw, average="macro"),
                        "loss": dk.WeightedMeanMetric(), "peak": dk.MaxMetric()}, device="cuda")
    p, t = torch.randn(64, C, device="cuda"), torch.randint(0, C, (64,), device="cuda")
    g(preds=p, target=t)
    g["loss"](p.mean(), weights=64.0)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            g(preds=p, target=t)
            g["loss"](p.mean(), weights=64.0)
            g["peak"](p.max())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    ref = tm.Accuracy(**kw).to("cuda")
    _close(g(preds=p, target=t)["acc"], ref(p, t), 1e-6, "cuda batch")


def test_forward_after_to_and_custom_member_in_a_group():
    g = dk.MetricGroup({"rms": _RMS(), "s": dk.SumMetric()})
    x = torch.tensor([3.0, -4.0])
    out = g(values=x)
    assert out["rms"].tolist() == [math.sqrt(12.5), 4.0, 11.0] and out["s"].item() == -1.0
    g.to("cpu")  # buffers re-allocated: the scratch and its cached ranges too
    out = g(values=torch.tensor([1.0]))
    assert out["rms"].tolist() == [1.0, 1.0, 11.0] and out["s"].item() == 1.0
    total = g.compute()
    assert total["rms"].tolist() == [math.sqrt(26 / 3), 4.0, 12.0] and total["s"].item() == 0.0


def test_first_forward_inside_inference_mode_then_outside():
    """The scratch and its cached views are normal tensors even when the first
    forward runs under torch.inference_mode() (an eval loop before training)."""
    g = dk.MetricGroup({"acc": dk.Accuracy(task="multiclass", num_classes=C), "loss": dk.MeanMetric()})
    ref, ref_loss = tm.Accuracy(task="multiclass", num_classes=C), tm.MeanMetric().set_dtype(torch.float64)
    for i, (p, t) in enumerate(_batches("multiclass", 13)):
        ctx = torch.inference_mode() if i % 2 == 0 else torch.enable_grad()
        with ctx:
            _close(g(preds=p, target=t)["acc"], ref(p, t), 1e-6, f"acc batch {i}")
            _close(g["loss"](p.double().mean()), ref_loss(p.double().mean()), 1e-12, f"loss batch {i}")
    _close(g.compute()["acc"], ref.compute(), 1e-6, "acc total")


def test_forward_in_one_call_returns_the_routed_members_under_their_keys(monkeypatch):
    """The one-call forward makes tensors only for the members the inputs
    were routed to, under their prefixed/postfixed keys, each a new tensor
    equal to the Python steps' value; a select that names no value raises
    before anything is touched."""
    from d9d_kernels.core.metric import FUSED

    kw = dict(task="multiclass", num_classes=C)
    make = lambda: dk.MetricGroup({"loss": dk.WeightedMeanMetric(), "acc": dk.Accuracy(**kw),  # noqa: E731
                                   "cm": dk.ConfusionMatrix(**kw)}, prefix="train/", postfix="_b")
    fast, slow = make(), make()
    calls = []  # per forward of `fast`: whether it took the one call
    counted = _count_one_calls(monkeypatch, lambda owner, took: calls.append(took))
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        p, t = torch.randn(11, C, generator=gen), torch.randint(0, C, (11,), generator=gen)
        monkeypatch.setitem(FUSED, "forward", counted)
        got = fast(preds=p, target=t)
        monkeypatch.setitem(FUSED, "forward", lambda *a: None)
        want = slow(preds=p, target=t)
        assert list(got) == list(want) == ["train/acc_b", "train/cm_b"]
        for k in want:
            assert torch.equal(got[k], want[k]), (step, k)
        assert got["train/acc_b"].untyped_storage().data_ptr() == got["train/cm_b"].untyped_storage().data_ptr()
        assert all(got[k].untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
                   for k in got for b in fast._storage.scratch.values())
    assert calls[-2:] == [True, True], calls
    st = fast._storage
    runner = st.compiled[id(fast)].scratch[2].runner
    before = {k: v.clone() for k, v in st.local.items()}
    scratch = {k: v.clone() for k, v in st.scratch.items()}
    for bad in (9, -1, 2**70):
        with pytest.raises(RuntimeError, match="value index -?[0-9]+ outside the 3 values"):
            runner.forward((), dict(preds=p, target=t), st.scratch_dirty.reset, [("x", bad)])
    assert all(_equal_nan(st.local[k], before[k]) for k in before)
    assert all(_equal_nan(st.scratch[k], scratch[k]) for k in scratch)
