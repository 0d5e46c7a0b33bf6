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


def _same_state(fwd, upd, where) -> None:
    """The states of ``fwd`` and ``upd`` (same layout) hold the same data:
    the same bits for every statistic without a pivot; pivoted sums (the
    batch's own pivot re-expressed about the state's) equal to 1e-12 of
    their size once about one pivot, non-finite in the same places."""
    from d9d_kernels.core.storage import align

    lay = fwd._storage.layout
    for j in range(len(lay.stats)):
        a = {k: v.clone() for k, v in lay.views(fwd._storage.local, j).items()}
        b = {k: v.clone() for k, v in lay.views(upd._storage.local, j).items()}
        if not lay.has_replica(j):
            for k in a:
                assert _equal_nan(a[k], b[k]), (*where, j, k)
            continue
        align(lay.stats[j], a, b)
        for k in a:
            fin = torch.isfinite(a[k])
            assert torch.equal(fin, torch.isfinite(b[k])), (*where, j, k, a[k], b[k])
            scale = float(a[k][fin].abs().max()) if fin.any() else 0.0
            torch.testing.assert_close(a[k][fin], b[k][fin], rtol=1e-12, atol=1e-12 * scale, msg=str((*where, j, k)))


def _forward_and_update_step(fwd, upd, call, where) -> None:
    """``call(g, out, forward)`` on ``fwd`` (forward=True) and on its twin
    ``upd`` (forward=False: update in place of each forward); asserts that
    the two states hold the same data (``_same_state``), ``where`` naming the step in a failure."""
    call(fwd, {}, True)
    call(upd, {}, False)
    _same_state(fwd, upd, where)


@pytest.mark.parametrize("strategy", ["propagate", "ignore"])
def test_forward_state_equals_update_state_with_nan_inf_and_unset_pivots(strategy):
    """The fold (pivots aligned, sums added, maxima maxed) leaves the state
    update() would have (``_same_state``): NaN/Inf batches, batches with no
    valid element before the pivot is set, masks."""
    vals = [torch.tensor([float("nan"), 2.0]), torch.tensor([float("inf")]), torch.tensor([5.0, -1.0]),
            torch.tensor([3.0, float("-inf")]), torch.tensor([7.0])]
    masks = [None, None, torch.tensor([False, True]), None, None]
    for cls in (dk.SumMetric, dk.WeightedMeanMetric, dk.MaxMetric, dk.MinMetric):
        fw, up = cls(nan_strategy=strategy), cls(nan_strategy=strategy)
        for x, mk in zip(vals, masks):
            fw(x, mask=mk)
            up.update(x, mask=mk)
            _same_state(fw, up, (cls.__name__,))
            assert _equal_nan(fw.compute(), up.compute()) or strategy == "error"
    p = torch.tensor([1e6 + 1, 1e6 + 2, float("nan")], dtype=torch.float64)
    t = torch.tensor([1e6 + 1.5, 1e6 + 2.5, 1e6], dtype=torch.float64)
    fw, up = dk.R2Score(nan_strategy=strategy), dk.R2Score(nan_strategy=strategy)
    for sl in (slice(2, 3), slice(0, 2), slice(0, 3)):  # first batch: no valid element (pivot stays unset)
        fw(p[sl], t[sl])
        up.update(p[sl], t[sl])
    if strategy == "propagate":  # a NaN pred's target is summed before any pivot is set: the value is NaN
        assert fw.compute().isnan() and up.compute().isnan()
    else:
        _same_state(fw, up, ("R2Score",))


@pytest.mark.parametrize("strategy", ["error", "propagate"])
def test_forward_state_equals_update_state_in_a_group(strategy):
    """Forwards of a group and of its members mixed with updates leave the
    state bits of the same updates: a NaN batch, a float64 batch (a new input
    signature: its first call runs checked), the confusion matrix, a member
    (kappa) whose statistic no other member shares."""
    kw = dict(task="multiclass", num_classes=C, nan_strategy=strategy)

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

            def call(g, out, forward):
                if step == 6 or not forward:
                    g.update(preds=p, target=t)
                    g["loss"].update(x, weights=w)
                    g["mx"].update(x)
                else:
                    out.update(g(preds=p, target=t))
                    out["loss"] = g["loss"](x, weights=w)
                    out["mx"] = g["mx"](x)

            _forward_and_update_step(fast, slow, call, (kappa, step))
        if strategy == "error":  # the NaN batch's count raises in both
            with pytest.raises(ValueError) as a:
                fast.compute()
            with pytest.raises(ValueError) as b:
                slow.compute()
            assert str(a.value) == str(b.value)
        else:
            for k in ("acc", "cm", "loss", "mx"):
                torch.testing.assert_close(fast.compute()[k], slow.compute()[k], rtol=1e-12, atol=0, equal_nan=True)


def test_forward_of_a_large_confusion_matrix():
    """Forward's reset and fold of a [C, C] matrix mixed with updates: batch
    matrices and the accumulated one equal scikit-learn's, state bits equal
    the same updates'."""
    from sklearn.metrics import confusion_matrix

    K = 100  # a 10 000-cell matrix: a batch of 5 rows leaves most 64-cell blocks at zero
    kw = dict(task="multiclass", num_classes=K)
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

        def call(g, out, forward):
            if step == 4 or not forward:
                g.update(preds=p, target=t)
                g["loss"].update(x)
            else:
                out.update(g(preds=p, target=t))
                ref = confusion_matrix(t.numpy(), p.argmax(1).numpy(), labels=list(range(K)))
                np.testing.assert_array_equal(out["cm"].numpy(), ref)
                out["loss"] = g["loss"](x)

        _forward_and_update_step(fast, slow, call, (step,))
    ref = confusion_matrix(torch.cat(seen_t).numpy(), torch.cat(seen_p).numpy(), labels=list(range(K)))
    np.testing.assert_array_equal(fast.compute()["cm"].numpy(), ref)


def test_forward_interleaved_with_update_planned_and_no_new_allocation():
    kw = dict(task="multiclass", num_classes=C)
    make = lambda: dk.MetricGroup({"acc": dk.Accuracy(**kw), "f1": dk.F1Score(**kw, average="macro"),  # noqa: E731
                                   "loss": dk.WeightedMeanMetric()})
    a, b = make(), make()
    ptrs = set()
    for i, (p, t) in enumerate(_batches("multiclass", 6, 8)):
        if i % 2:
            a(preds=p, target=t)
            ptrs.add(a._storage.scratch.bufs["sum"].data_ptr())
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
