"""torchmetrics constructor arguments taken with torchmetrics' semantics:
``zero_division``, AUROC ``max_fpr``, ``thresholds`` as int / list / tensor,
multilabel ``ConfusionMatrix.plot()``; and the ones that cannot work with a
fixed-size packed state refused with a ``ValueError`` naming what to pass.

Each is compared with torchmetrics 1.9 (and scikit-learn's
``roc_auc_score(max_fpr=...)``) on random inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import d9d_kernels as dk
from tests.metrics._catalogue_utils import _one_thread  # noqa: F401  (autouse: one intra-op thread)

tm = pytest.importorskip("torchmetrics")
tmc = pytest.importorskip("torchmetrics.classification")

C, L = 5, 4
NAN = float("nan")
PREFIX = {"binary": "Binary", "multiclass": "Multiclass", "multilabel": "Multilabel"}




def _close(ours, theirs, atol=1e-6, msg=""):
    np.testing.assert_allclose(ours.detach().double().cpu().numpy(), theirs.detach().double().cpu().numpy(),
                               rtol=0, atol=atol, equal_nan=True, err_msg=msg)


# -- zero_division -------------------------------------------------------------------------------------------------


def _classification_data(task: str, seed: int, sparse: bool):
    """Inputs with 0/0 classes: ``sparse`` leaves classes / labels out of preds
    and target (and, binary, predicts nothing positive)."""
    g = torch.Generator().manual_seed(seed)
    n = 24
    if task == "multiclass":
        hi_p, hi_t = (C - 2, C - 1) if sparse else (C, C)  # class C-1 nowhere; class C-2 never predicted
        return torch.randint(0, hi_p, (n,), generator=g), torch.randint(0, hi_t, (n,), generator=g)
    if task == "multilabel":
        p, t = torch.rand(n, L, generator=g), torch.randint(0, 2, (n, L), generator=g)
        if sparse:
            p[:, 0], t[:, 0] = 0.1, 0  # label 0: nothing predicted, nothing true
            p[:, 1] = 0.2  # label 1: nothing predicted
        return p, t
    p, t = torch.rand(n, generator=g), torch.randint(0, 2, (n,), generator=g)
    if sparse:
        p = p * 0.4  # nothing predicted positive: precision 0/0
        t = torch.zeros_like(t) if seed % 2 else t  # and, every other seed, nothing true: recall 0/0
    return p, t


def _ours(name: str, task: str, average: str, zd, **kw):
    size = {"multiclass": {"num_classes": C}, "multilabel": {"num_labels": L}, "binary": {}}[task]
    if name == "FBetaScore":
        kw["beta"] = 2.0
    return getattr(dk, name)(task=task, average=average, zero_division=zd, **size, **kw)


def _theirs(name: str, task: str, average: str, zd, **kw):
    cls = getattr(tmc, PREFIX[task] + name)
    size = {"multiclass": {"num_classes": C}, "multilabel": {"num_labels": L}, "binary": {}}[task]
    if task != "binary":
        kw["average"] = average
    if name == "FBetaScore":
        kw["beta"] = 2.0
    # validate_args=False: torchmetrics' check admits only 0 and 1; NaN is what its arithmetic gives
    return cls(zero_division=zd, validate_args=False, **size, **kw)


ZD_METRICS = ["Precision", "Recall", "F1Score", "FBetaScore", "JaccardIndex"]


#: (task, average): binary has one label (average is ignored)
TASK_AVERAGES = [("binary", "micro")] + [(task, a) for task in ("multiclass", "multilabel")
                                         for a in ("micro", "macro", "weighted", "none")]


@pytest.mark.parametrize("zd", [0, 1, NAN], ids=["0", "1", "nan"])
@pytest.mark.parametrize("task,average", TASK_AVERAGES)
@pytest.mark.parametrize("name", ZD_METRICS)
def test_zero_division_matches_torchmetrics(name, task, average, zd):
    for seed, sparse in ((0, False), (1, True), (2, True)):
        p, t = _classification_data(task, seed, sparse)
        ours = _ours(name, task, average, zd)
        ours.update(p, t)
        theirs = _theirs(name, task, average, zd)(p, t)
        _close(ours.compute(), theirs, msg=f"{name} {task} {average} zd={zd} seed={seed}")


@pytest.mark.parametrize("zd", [1, NAN], ids=["1", "nan"])
def test_zero_division_in_a_group_compute_and_forward(zd):
    """Members with zero_division != 0 beside members with the default in one
    group: compute(), compute_to_host() and forward give torchmetrics' values."""
    members = {f"{n}_{a}": (n, a) for n in ZD_METRICS for a in ("micro", "macro", "weighted")}
    g = dk.MetricGroup({
        **{k: _ours(n, "multiclass", a, zd) for k, (n, a) in members.items()},
        "acc": dk.Accuracy(task="multiclass", num_classes=C),
        "p0": dk.Precision(task="multiclass", num_classes=C, average="macro"),
    })
    batches = [_classification_data("multiclass", s, True) for s in (3, 4)]
    g.update(preds=batches[0][0], target=batches[0][1])
    batch_vals = g(preds=batches[1][0], target=batches[1][1])
    out = g.compute()
    host = g.compute_to_host().result()
    p = torch.cat([b[0] for b in batches])
    t = torch.cat([b[1] for b in batches])
    for k, (n, a) in members.items():
        _close(out[k], _theirs(n, "multiclass", a, zd)(p, t), msg=k)
        np.testing.assert_allclose(host[k], out[k].item(), rtol=1e-12, equal_nan=True)
        _close(batch_vals[k], _theirs(n, "multiclass", a, zd)(*batches[1]), msg=f"forward {k}")
    _close(out["acc"], tmc.MulticlassAccuracy(num_classes=C, average="micro")(p, t))
    _close(out["p0"], tmc.MulticlassPrecision(num_classes=C, average="macro")(p, t))
    # standalone compute() takes the same formula
    solo = _ours("Precision", "multiclass", "macro", zd)
    solo.update(p, t)
    torch.testing.assert_close(solo.compute(), out["Precision_macro"], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("zd", [1, NAN], ids=["1", "nan"])
def test_zero_division_samplewise_and_ignored_class(zd):
    g = torch.Generator().manual_seed(5)
    p, t = torch.rand(6, L, 7, generator=g) * 0.8, torch.randint(0, 2, (6, L, 7), generator=g)
    ours = dk.Precision(task="multilabel", num_labels=L, average="macro", multidim_average="samplewise",
                        zero_division=zd)
    ours.update(p, t)
    theirs = tmc.MultilabelPrecision(num_labels=L, average="macro", multidim_average="samplewise",
                                     zero_division=zd, validate_args=False)(p, t)
    _close(ours.compute(), theirs.mean(0))  # samplewise: the mean of torchmetrics' per-sample values
    # JaccardIndex whose ignore_index is a class (its own variant class)
    pm, tmm = _classification_data("multiclass", 6, True)
    tmm = torch.where(torch.arange(tmm.numel()) % 5 == 0, torch.zeros_like(tmm), tmm)
    for average in ("micro", "macro", "weighted", "none"):
        ours = dk.JaccardIndex(task="multiclass", num_classes=C, average=average, ignore_index=0, zero_division=zd)
        ours.update(pm, tmm)
        theirs = tmc.MulticlassJaccardIndex(num_classes=C, average=average, ignore_index=0, zero_division=zd)(pm, tmm)
        _close(ours.compute(), theirs, msg=average)


def test_zero_division_taken_and_ignored_as_torchmetrics_or_refused():
    p, t = _classification_data("multiclass", 7, True)
    for name in ("Accuracy", "Specificity"):  # torchmetrics takes it and does not use it
        a = getattr(dk, name)(task="multiclass", num_classes=C, average="macro", zero_division=1)
        b = getattr(dk, name)(task="multiclass", num_classes=C, average="macro")
        a.update(p, t)
        b.update(p, t)
        torch.testing.assert_close(a.compute(), b.compute(), rtol=0, atol=0)
        theirs = getattr(tmc, "Multiclass" + name)(num_classes=C, average="macro", zero_division=1)(p, t)
        _close(a.compute(), theirs)
    with pytest.raises(ValueError, match="Precision: argument 'zero_division' must be 0, 1"):
        dk.Precision(task="binary", zero_division=0.5)
    with pytest.raises(ValueError, match="MatthewsCorrCoef: argument 'zero_division'"):
        dk.MatthewsCorrCoef(task="binary", zero_division=1)
    assert "zero_division=1.0" in repr(dk.Recall(task="binary", zero_division=1))


# -- thresholds ----------------------------------------------------------------------------------------------------


def _ranking_data(task: str, seed: int, n: int = 600):
    g = torch.Generator().manual_seed(seed)
    if task == "binary":
        p = torch.rand(n, generator=g)
        return p, (torch.rand(n, generator=g) < 0.2 + 0.6 * p).long()
    if task == "multilabel":
        p = torch.rand(n, L, generator=g)
        return p, (torch.rand(n, L, generator=g) < 0.2 + 0.6 * p).long()
    t = torch.randint(0, C, (n,), generator=g)
    logits = torch.randn(n, C, generator=g) + 1.5 * torch.nn.functional.one_hot(t, C)
    return logits.softmax(-1), t


THRESHOLDS = {
    "int5": 5,
    "int101": 101,
    "list-grid": [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0],
    "list-inner": [0.2, 0.5, 0.7],  # no 0 / 1: torchmetrics' curve has only these points
    "tensor-linspace": torch.linspace(0, 1, 13),
    "tensor-grid": torch.tensor([0.05, 0.3, 0.35, 0.8]),
}


@pytest.mark.parametrize("task,average", [("binary", "macro")] + [(task, a) for task in ("multiclass", "multilabel")
                                                                   for a in ("macro", "weighted", "none")])
@pytest.mark.parametrize("thr", sorted(THRESHOLDS))
@pytest.mark.parametrize("name", ["AUROC", "AveragePrecision"])
def test_thresholds_match_torchmetrics(name, thr, task, average):
    thresholds = THRESHOLDS[thr]
    size = {"multiclass": {"num_classes": C}, "multilabel": {"num_labels": L}, "binary": {}}[task]
    kw = {} if task == "binary" else {"average": average}
    p, t = _ranking_data(task, 0)
    ours = getattr(dk, name)(task=task, thresholds=thresholds, **size, **kw)
    half = p.shape[0] // 2
    ours.update(p[:half], t[:half])
    ours.update(p[half:], t[half:])
    theirs = getattr(tmc, PREFIX[task] + name)(thresholds=thresholds, **size, **kw)(p, t)
    _close(ours.compute(), theirs, atol=1e-6, msg=f"{name} {task} {thr} {average}")


def test_thresholds_mapping_and_refusals():
    assert dk.AUROC(task="binary", thresholds=11).num_bins == 10  # linspace(0, 1, 11): edges k/10
    assert dk.AUROC(task="binary", thresholds=torch.linspace(0, 1, 11)).num_bins == 10  # float32 values
    assert dk.AveragePrecision(task="binary", thresholds=[0.125, 0.5]).num_bins == 8
    assert dk.AUROC(task="binary", thresholds=[0.1, 0.25], num_bins=20).num_bins == 20
    g = dk.MetricGroup({"auroc": dk.AUROC(task="binary", thresholds=[0.0, 0.5, 1.0], num_bins=10),
                        "ap": dk.AveragePrecision(task="binary", thresholds=11)})
    assert len(g._storage.layout.stats) == 1  # the same 10-bin histogram
    p, t = _ranking_data("binary", 1)
    g.update(preds=p, target=t)
    out = g.compute()
    _close(out["auroc"], tmc.BinaryAUROC(thresholds=[0.0, 0.5, 1.0])(p, t))
    _close(out["ap"], tmc.BinaryAveragePrecision(thresholds=11)(p, t))
    for bad, match in [
        ([0.14142135, 0.17320508, 0.27182818, 0.31415926], "thresholds'.*num_bins"),
        ([0.1, 0.15], "thresholds'.*num_bins"),  # with num_bins=4 below
        ([0.5, 0.1], "increasing"),
        ([0.5, 1.5], r"\[0, 1\]"),
        (1, ">= 2"),
        (torch.rand(2, 2), "1-d"),
        ("10", "must be None, an int"),
    ]:
        kw = {"num_bins": 4} if bad == [0.1, 0.15] else {}
        with pytest.raises(ValueError, match=f"AUROC: argument '{match}" if match.startswith("thr") else match):
            dk.AUROC(task="binary", thresholds=bad, **kw)
    with pytest.raises(ValueError, match="num_bins"):
        dk.AUROC(task="binary", thresholds=5, num_bins=7)


# -- max_fpr -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_fpr", [0.05, 0.2, 0.5, 0.9])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_max_fpr_matches_sklearn(max_fpr, seed):
    skm = pytest.importorskip("sklearn.metrics")
    g = torch.Generator().manual_seed(seed)
    n = 4000
    logits = torch.randn(n, generator=g, dtype=torch.float64)
    target = (torch.rand(n, generator=g, dtype=torch.float64) < torch.sigmoid(1.5 * logits)).long()
    preds = logits if seed == 2 else torch.sigmoid(logits)  # logits: sigmoid in the kernel
    m = dk.AUROC(task="binary", max_fpr=max_fpr, num_bins=10_000)
    m.update(preds[: n // 3], target[: n // 3])
    m.update(preds[n // 3:], target[n // 3:])
    ref = skm.roc_auc_score(target.numpy(), torch.sigmoid(logits).numpy(), max_fpr=max_fpr)
    assert abs(m.compute().item() - ref) < 1e-3
    theirs = tmc.BinaryAUROC(max_fpr=max_fpr, thresholds=51)(torch.sigmoid(logits).float(), target)
    binned = dk.AUROC(task="binary", max_fpr=max_fpr, thresholds=51)
    binned.update(preds, target)
    _close(binned.compute(), theirs, atol=1e-6)  # torchmetrics' binned curve: the same points


def test_max_fpr_edges_and_refusals():
    p, t = _ranking_data("binary", 3)
    full, one = dk.AUROC(task="binary"), dk.AUROC(task="binary", max_fpr=1.0)
    full.update(p, t)
    one.update(p, t)
    torch.testing.assert_close(one.compute(), full.compute(), rtol=0, atol=0)
    only_pos = dk.AUROC(task="binary", max_fpr=0.3)  # undefined (one class): 0.0 as without max_fpr
    only_pos.update(p, torch.ones_like(t))
    assert only_pos.compute().item() == 0.0
    with pytest.raises(ValueError, match="AUROC: argument 'max_fpr' is only taken for task='binary'"):
        dk.AUROC(task="multiclass", num_classes=C, max_fpr=0.5)
    for bad in (0.0, 1.5, "0.5"):
        with pytest.raises(ValueError, match="AUROC: argument 'max_fpr' must be a float in"):
            dk.AUROC(task="binary", max_fpr=bad)


# -- plot, and arguments that need the data's class count ----------------------------------------------------------


def test_multilabel_confusion_matrix_plot():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = dk.ConfusionMatrix(task="multilabel", num_labels=L)
    p, t = _ranking_data("multilabel", 4)
    m.update(p, t)
    fig, axes = m.plot()
    assert len(axes) == L and all("label" in ax.get_title() for ax in axes)
    fig2, grid = plt.subplots(2, 2)
    _, axes2 = m.plot(ax=grid)
    assert list(axes2) == list(grid.reshape(-1))
    with pytest.raises(ValueError, match="argument 'ax'"):
        m.plot(ax=grid[0, 0])
    values = [m(p[:10], t[:10]), m(p[10:20], t[10:20])]  # batch values over steps
    m.plot(values)
    cm = dk.ConfusionMatrix(task="multiclass", num_classes=3)  # 2-d: one heat map, as before
    cm.update(torch.tensor([0, 1, 2]), torch.tensor([0, 2, 2]))
    cm.plot()
    plt.close("all")


def test_num_classes_needed_by_fixed_size_state():
    with pytest.raises(ValueError, match=r"MeanIoU: argument 'num_classes' is required with per_class=True.*"
                                         r"first batch"):
        dk.MeanIoU(per_class=True)
    dk.MeanIoU()  # per_class=False, one-hot inputs: no class count needed
    with pytest.raises(ValueError, match=r"Accuracy: argument 'num_classes' is required for task='multiclass', "
                                         r"also for average='micro'"):
        dk.Accuracy(task="multiclass", num_classes=None, average="micro")
    with pytest.raises(ValueError):  # torchmetrics' task wrapper refuses it too
        tm.Accuracy(task="multiclass", num_classes=None, average="micro")


@pytest.mark.gpu
def test_zero_division_group_on_cuda_matches_cpu():
    """On CUDA the group's compute takes no host read (fused_values' device path): same values as on CPU."""
    def build():
        return dk.MetricGroup({"p1": _ours("Precision", "multiclass", "macro", 1),
                               "jn": _ours("JaccardIndex", "multiclass", "weighted", NAN),
                               "f1": _ours("F1Score", "multiclass", "micro", 1),
                               "acc": dk.Accuracy(task="multiclass", num_classes=C)})

    cpu, gpu = build(), build().to("cuda")
    p, t = _classification_data("multiclass", 8, True)
    cpu.update(preds=p, target=t)
    gpu.update(preds=p.cuda(), target=t.cuda())
    a, b = cpu.compute(), gpu.compute()
    for k in a:
        torch.testing.assert_close(b[k].cpu(), a[k], rtol=1e-12, atol=1e-12, equal_nan=True)


def test_samplewise_members_differing_in_zero_division_keep_their_own_scores():
    """Two samplewise Precision members that differ only in zero_division: each equals its
    standalone twin (their per-sample sums must not be shared)."""
    kw = dict(task="multiclass", num_classes=4, average="macro", multidim_average="samplewise")
    g = torch.Generator().manual_seed(0)
    preds, target = torch.randint(0, 4, (3, 10), generator=g), torch.randint(0, 4, (3, 10), generator=g)
    group = dk.MetricGroup({"z0": dk.Precision(**kw, zero_division=0), "z1": dk.Precision(**kw, zero_division=1)})
    group.update(preds=preds, target=target)
    for name, zd in (("z0", 0), ("z1", 1)):
        solo = dk.Precision(**kw, zero_division=zd)
        solo.update(preds, target)
        torch.testing.assert_close(group.compute()[name], solo.compute(), rtol=0, atol=0)
    assert not torch.equal(group.compute()["z0"], group.compute()["z1"])


@pytest.mark.parametrize("name,kw", [("MeanSquaredError", {}), ("MeanSquaredError", dict(squared=False)),
                                     ("MeanAbsoluteError", {}), ("PearsonCorrCoef", {})])
def test_num_outputs_per_column_matches_torchmetrics_and_sklearn(name, kw):
    """num_outputs=5 on [N, 5]: one value per column (torchmetrics; scikit-learn's
    multioutput='raw_values'); the same through forward, a group and compute_to_host;
    a 2-D input of another width raises naming num_outputs, and the state is intact."""
    from sklearn.metrics import mean_absolute_error, mean_squared_error

    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(16, 5, generator=g), torch.randn(16, 5, generator=g)) for _ in range(3)]
    ours, group = getattr(dk, name)(num_outputs=5, **kw), dk.MetricGroup({"m": getattr(dk, name)(num_outputs=5, **kw)})
    theirs = getattr(tm, name)(num_outputs=5, **kw)
    for i, (x, y) in enumerate(batches):
        batch = ours(x, y) if i == 2 else ours.update(x, y)
        group.update(preds=x, target=y)
        theirs.update(x, y)
    torch.testing.assert_close(batch.float(), getattr(tm, name)(num_outputs=5, **kw)(*batches[2]), rtol=1e-5, atol=1e-6)
    want = theirs.compute()
    for got in (ours.compute(), group.compute()["m"], torch.tensor(ours.compute_to_host().result())):
        assert got.shape == (5,)
        torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-6)
    x, y = torch.cat([b[0] for b in batches]).numpy(), torch.cat([b[1] for b in batches]).numpy()
    if name == "MeanAbsoluteError":
        ref = mean_absolute_error(y, x, multioutput="raw_values")
    elif name == "MeanSquaredError":
        ref = mean_squared_error(y, x, multioutput="raw_values") ** (1.0 if kw.get("squared", True) else 0.5)
    else:
        ref = np.array([np.corrcoef(x[:, j], y[:, j])[0, 1] for j in range(5)])
    np.testing.assert_allclose(ours.compute().numpy(), ref, rtol=1e-5)
    before = ours.compute()
    with pytest.raises(ValueError, match=rf"{name}: argument 'num_outputs' is 5 .* pass num_outputs=4"):
        ours.update(torch.randn(3, 4), torch.randn(3, 4))
    torch.testing.assert_close(ours.compute(), before, rtol=0, atol=0)


def test_torchmetrics_base_settings_accepted_or_refused_with_what_to_use():
    """torchmetrics' Metric keyword arguments on every exported class: the ones that behave
    the same here are taken; the others raise ValueError naming the argument and the way
    to get that behaviour, never a TypeError."""
    from d9d_kernels.core.metric import Metric

    same = dict(validate_args=False, compute_on_cpu=True, compute_with_cache=False, dist_sync_on_step=False,
                sync_on_compute=False, process_group=None, dist_sync_fn=None, distributed_available_fn=None)
    plain = [dk.SumMetric, lambda **k: dk.Accuracy(task="multiclass", num_classes=3, **k), dk.MeanSquaredError,
             lambda **k: dk.AUROC(task="binary", **k), dk.Perplexity]
    for make in plain:
        m = make(**same)
        assert isinstance(m, Metric)
    for name, value in (("dist_sync_on_step", True), ("sync_on_compute", True), ("process_group", object()),
                        ("dist_sync_fn", print)):
        with pytest.raises(ValueError, match=rf"argument '{name}'.* is not supported: .*ctx"):
            dk.Accuracy(task="multiclass", num_classes=3, **{name: value})
    m = dk.MeanMetric(validate_args=True)
    m.update(torch.tensor([1.0, 3.0]))
    assert m.compute().item() == 2.0
