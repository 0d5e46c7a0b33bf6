"""Every metric and group pickles and deep-copies, and the copy works.

The copy keeps the state (local and synced) and the configuration; what
belongs to the process (update plans, compiled runners, fused plans, forward
scratch, memo and routing caches, sync handshakes) is rebuilt at first use.
Checked over the whole exported catalogue: ``compute()`` of the copy equals
the original's, further updates on the copy equal the same updates on a
fresh metric (so the copy works), and the original does not move (so it is
independent). Also through a spawned process: a pickled metric is updated
there, sent back and merged (``merge_state``).
"""

from __future__ import annotations

import concurrent.futures
import copy
import functools
import inspect
import multiprocessing
import pickle

import pytest
import torch

import d9d_kernels as dk
from tests.metrics._catalogue_utils import _one_thread  # noqa: F401  (autouse: one intra-op thread)

C, L = 5, 3


# -- inputs: each a function of a torch.Generator returning update's positional args ------------------------------


def _mc(g):
    return torch.randn(8, C, generator=g), torch.randint(0, C, (8,), generator=g)


def _bin(g):
    return torch.randn(8, generator=g), torch.randint(0, 2, (8,), generator=g)


def _ml(g):
    return torch.rand(8, L, generator=g), torch.randint(0, 2, (8, L), generator=g)


def _reg(g):
    return torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)


def _pos(g):
    return torch.rand(8, generator=g) + 0.1, torch.rand(8, generator=g) + 0.1


def _values(g):
    return (torch.randn(8, generator=g),)


def _seg(g):
    return torch.randint(0, 3, (2, 4, 4), generator=g), torch.randint(0, 3, (2, 4, 4), generator=g)


def _prob_rows(g):
    return torch.randn(8, 4, generator=g).softmax(-1), torch.randn(8, 4, generator=g).softmax(-1)


def _rows(g):
    return torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g)


def _routing(g):
    """MoE routing of 2 layers: top-2 of 5 experts for 6 tokens, one dropped slot, the gate softmax."""
    probs = torch.softmax(torch.randn(2, 6, 5, generator=g), -1)
    idx = probs.topk(2, -1).indices
    idx[0, 0, 1] = -1
    return idx, None, probs


def _calib(g):
    return torch.rand(8, generator=g), torch.randint(0, 2, (8,), generator=g)


class RootMeanSquare(dk.Metric):
    """A custom metric from add_state slots (module level: pickled by reference)."""

    def __init__(self):
        super().__init__()
        self.add_state("sum_sq", kind="sum", shape=())
        self.add_state("count", kind="sum", shape=())
        self.add_state("peak", kind="max", shape=())

    def _update(self, values):
        self.sum_sq += values.double().square().sum()
        self.count += values.numel()
        self.peak = torch.maximum(self.peak, values.double().abs().max())

    def _compute(self, state):
        return torch.stack([(state["sum_sq"] / state["count"]).sqrt(), state["peak"]])


_CLASSIFICATION = ["Accuracy", "Precision", "Recall", "F1Score", "Specificity", "JaccardIndex", "MatthewsCorrCoef",
                   "CohenKappa", "ConfusionMatrix"]


def _cases() -> dict:
    """{id: (factory, inputs)} over every exported metric class, plus the counting or
    formula some arguments select (multiclass top_k > 1, JaccardIndex's ignored class)
    and torchmetrics arguments."""
    cases = {}
    for name in ["StatScores", "HammingDistance", "NegativePredictiveValue"]:
        cls = getattr(dk, name)
        cases[f"{name}-multiclass"] = (lambda cls=cls: cls(task="multiclass", num_classes=C), _mc)
        cases[f"{name}-top2"] = (lambda cls=cls: cls(task="multiclass", num_classes=C, top_k=2), _mc)
    for name in _CLASSIFICATION:
        cls = getattr(dk, name)
        cases[f"{name}-multiclass"] = (lambda cls=cls: cls(task="multiclass", num_classes=C), _mc)
        cases[f"{name}-binary"] = (lambda cls=cls: cls(task="binary"), _bin)
        if name != "CohenKappa":
            cases[f"{name}-multilabel"] = (lambda cls=cls: cls(task="multilabel", num_labels=L), _ml)
    cases.update({
        "FBetaScore-top2": (lambda: dk.FBetaScore(task="multiclass", beta=2.0, num_classes=C, top_k=2), _mc),
        "Precision-zero_division": (lambda: dk.Precision(task="multiclass", num_classes=C, average="macro",
                                                         zero_division=1), _mc),
        "Specificity-top2": (lambda: dk.Specificity(task="multiclass", num_classes=C, top_k=2), _mc),
        "JaccardIndex-ignored-class": (lambda: dk.JaccardIndex(task="multiclass", num_classes=C, ignore_index=0), _mc),
        "Accuracy-samplewise": (lambda: dk.Accuracy(task="multilabel", num_labels=L, multidim_average="samplewise"),
                                lambda g: (torch.rand(4, L, 3, generator=g), torch.randint(0, 2, (4, L, 3), generator=g))),
        "AUROC-multiclass": (lambda: dk.AUROC(task="multiclass", num_classes=C, num_bins=64), _mc),
        "AUROC-binary": (lambda: dk.AUROC(task="binary", num_bins=64), _bin),
        "AUROC-max_fpr": (lambda: dk.AUROC(task="binary", num_bins=64, max_fpr=0.3), _bin),
        "AUROC-thresholds-list": (lambda: dk.AUROC(task="binary", thresholds=[0.0, 0.25, 0.5, 0.9]), _bin),
        "AveragePrecision-multilabel": (lambda: dk.AveragePrecision(task="multilabel", num_labels=L, thresholds=11), _ml),
        "Perplexity": (lambda: dk.Perplexity(ignore_index=0), _mc),
        "CalibrationError": (lambda: dk.CalibrationError(task="binary", n_bins=5), _calib),
        "Dice": (lambda: dk.Dice(num_classes=3, input_format="index"), _seg),
        "DiceScore": (lambda: dk.DiceScore(num_classes=3, input_format="index", aggregation_level="global"), _seg),
        "GeneralizedDiceScore": (lambda: dk.GeneralizedDiceScore(num_classes=3, input_format="index"), _seg),
        "MeanIoU": (lambda: dk.MeanIoU(num_classes=3, input_format="index", per_class=True), _seg),
        "KLDivergence": (lambda: dk.KLDivergence(), _prob_rows),
        "CosineSimilarity": (lambda: dk.CosineSimilarity(reduction="mean"), _rows),
        "RunningMean": (lambda: dk.RunningMean(window=3), _values),
        "ExponentialMovingAverage": (lambda: dk.ExponentialMovingAverage(decay=0.9), _values),
        "SumMetric": (lambda: dk.SumMetric(), _values),
        "MeanMetric": (lambda: dk.MeanMetric(), _values),
        "WeightedMeanMetric": (lambda: dk.WeightedMeanMetric(), _values),
        "MaxMetric": (lambda: dk.MaxMetric(), _values),
        "MinMetric": (lambda: dk.MinMetric(), _values),
        "custom-add_state": (RootMeanSquare, _values),
        "ExpertLoad": (lambda: dk.ExpertLoad(num_experts=5, num_layers=2, top_k=2, with_probs=True), _routing),
    })
    for name in ["MeanSquaredError", "MeanAbsoluteError", "R2Score", "PearsonCorrCoef", "ExplainedVariance",
                 "MeanAbsolutePercentageError", "SymmetricMeanAbsolutePercentageError"]:
        cases[name] = (getattr(dk, name), _reg)
    covered = {k.split("-")[0] for k in cases}
    for name in dk.__all__:  # metrics added to the catalogue later: built from their signature (_generic)
        cls = getattr(dk, name)
        if (isinstance(cls, type) and issubclass(cls, dk.Metric) and cls not in (dk.Metric, dk.MetricGroup)
                and name not in covered):
            cases[name] = (cls, None)
    return cases


#: values for required constructor arguments of catalogue metrics without an explicit case
_REQUIRED = {"threshold": lambda: 0.5, "p": lambda: 2.0, "num_classes": lambda: 3, "window": lambda: 3,
             "base_metric": dk.SumMetric, "min_recall": lambda: 0.5, "min_precision": lambda: 0.5,
             "min_specificity": lambda: 0.5, "min_sensitivity": lambda: 0.5}
_RECIPES = (_pos, _reg, _values, _prob_rows, _rows, _mc, _bin, _ml)


@functools.cache
def _generic(cls) -> tuple:
    """``(factory, inputs)`` of a metric without an explicit case: the first
    constructor arguments and input recipe that construct, update and compute."""
    params = [p for p in inspect.signature(cls.__init__).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    names = {p.name for p in params}
    if "task" in names:
        configs = [({"task": "multiclass", "num_classes": C}, (_mc,)), ({"task": "multilabel", "num_labels": L}, (_ml,)),
                   ({"task": "binary"}, (_bin,))]
    else:
        configs = [({}, _RECIPES)]
    required = [p.name for p in params if p.default is p.empty and p.name != "task"]
    if any(n not in _REQUIRED for n in required):
        pytest.fail(f"{cls.__name__}: required argument(s) {required} unknown; add a case to "
                    "tests/core/test_pickle.py::_cases")
    for kw, recipes in configs:
        def make(kw=kw):
            return cls(**kw, **{n: _REQUIRED[n]() for n in required})
        for recipe in recipes:
            try:
                m = make()
                m.update(*recipe(torch.Generator().manual_seed(0)))
                m.compute()
            except (TypeError, ValueError, RuntimeError):
                continue
            return make, recipe
    pytest.fail(f"{cls.__name__}: no input recipe fits; add a case to tests/core/test_pickle.py::_cases")


def _case(name: str) -> tuple:
    factory, inputs = CASES[name]
    return _generic(factory) if inputs is None else (factory, inputs)


CASES = _cases()


def _roundtrip(obj, how: str):
    return pickle.loads(pickle.dumps(obj)) if how == "pickle" else copy.deepcopy(obj)


def _same(a, b):
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
        return
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _close(a, b):
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _close(a[k], b[k])
        return
    torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, equal_nan=True)


def _batches(inputs, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [inputs(g) for _ in range(n)]




@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_copy_keeps_state_and_works(case, how):
    factory, inputs = _case(case)
    b1, b2, b3 = _batches(inputs)
    m = factory()
    m.update(*b1)
    m(*b2)  # forward: scratch buffers, fused plan, compiled runner where there is one
    m.update(*b2)  # the planned path (a second call of the signature)
    before = m.compute()
    c = _roundtrip(m, how)
    assert type(c) is type(m) and repr(c) == repr(m)
    assert c._storage is not m._storage and c._storage.layout.detail == m._storage.layout.detail
    _same(c.compute(), before)
    c.update(*b3)
    c.update(*b3)
    fresh = factory()
    for b in (b1, b2, b2, b3, b3):
        fresh.update(*b)
    _close(c.compute(), fresh.compute())
    _same(m.compute(), before)  # the original is independent of the copy
    # the copy's forward works too (its scratch is made afresh)
    _close(c(*b1), factory()(*b1))


@pytest.mark.parametrize("case", sorted(CASES))
def test_copy_after_sync_keeps_synced_state(case):
    factory, inputs = _case(case)
    b1, b2 = _batches(inputs, 2, seed=1)
    m = factory()
    m.update(*b1)
    m.sync()  # no process group: the synced snapshot is the local state
    c = pickle.loads(pickle.dumps(m))
    assert c._storage.synced is not None and not c._storage.dirty and not c._storage.sync.handshakes
    _same(c.compute(), m.compute())
    c.update(*b2)
    fresh = factory()
    fresh.update(*b1)
    fresh.update(*b2)
    _close(c.compute(), fresh.compute())
    c.sync()
    _close(c.compute(), fresh.compute())


def _group():
    return dk.MetricGroup({
        "acc": dk.Accuracy(task="multiclass", num_classes=C),
        "f1": dk.F1Score(task="multiclass", num_classes=C, average="macro"),
        "p1": dk.Precision(task="multiclass", num_classes=C, average="macro", zero_division=1),
        "cm": dk.ConfusionMatrix(task="multiclass", num_classes=C),
        "auroc": dk.AUROC(task="multiclass", num_classes=C, num_bins=32),
        "loss": dk.WeightedMeanMetric(),
        "peak": dk.MaxMetric(),
    }, prefix="val/")


def _feed(g, batch, values):
    p, t = batch
    g.update(preds=p, target=t)
    g["loss"].update(values=values)
    g["peak"].update(values)


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_group_copy(how):
    gen = torch.Generator().manual_seed(2)
    batches = [(_mc(gen), torch.randn(8, generator=gen)) for _ in range(4)]
    g = _group()
    _feed(g, *batches[0])
    g(preds=batches[1][0][0], target=batches[1][0][1])  # group forward
    g.compute()
    g.compute_to_host().result()  # fused plans and host programs cached
    before = g.compute()
    c = _roundtrip(g, how)
    assert c._storage is not g._storage and list(c.keys()) == list(g.keys()) and c.prefix == "val/"
    for name, m in c.items():  # members keep pointing at the copy's one storage
        assert m._storage is c._storage and m._group is c and m._label == g[name]._label
        assert m is not g[name]
    assert len(c._storage.layout.stats) == len(g._storage.layout.stats)  # shared statistics stay shared
    _same(c.compute(), before)
    _feed(c, *batches[2])
    c(preds=batches[3][0][0], target=batches[3][0][1])
    fresh = _group()
    _feed(fresh, *batches[0])
    fresh.update(preds=batches[1][0][0], target=batches[1][0][1])
    _feed(fresh, *batches[2])
    fresh.update(preds=batches[3][0][0], target=batches[3][0][1])
    _close(c.compute(), fresh.compute())
    assert c.compute_to_host().result().keys() == fresh.compute_to_host().result().keys()
    _same(g.compute(), before)


def test_member_pickles_with_its_group():
    g = _group()
    gen = torch.Generator().manual_seed(3)
    _feed(g, _mc(gen), torch.randn(8, generator=gen))
    acc = pickle.loads(pickle.dumps(g["acc"]))
    assert acc._group is not None and acc._group["acc"] is acc and acc._storage is acc._group._storage
    _same(acc.compute(), g["acc"].compute())
    _same(acc._group.compute(), g.compute())


def test_clone_layout_describes_the_same_members():
    """clone() is a deepcopy: the layout's member description (schema-mismatch messages) is the original's."""
    g = _group()
    c = g["f1"].clone()._group
    assert c._storage.layout.detail == g._storage.layout.detail and '"F1Score"' in c._storage.layout.detail


# -- through another process ---------------------------------------------------------------------------------------


def _update_in_child(blob: bytes) -> bytes:
    """Runs in a spawned process: unpickles (metric, update args or kwargs) pairs,
    updates each metric there and sends them back pickled."""
    torch.set_num_threads(1)
    items = pickle.loads(blob)
    for m, batch in items:
        if isinstance(batch, dict):
            m.update(**batch)
        else:
            m.update(*batch)
    return pickle.dumps([m for m, _ in items])


def test_pickled_metrics_update_in_a_spawned_process_and_merge_back():
    gen = torch.Generator().manual_seed(4)
    here, there = _mc(gen), _mc(gen)
    values_here, values_there = _values(gen), _values(gen)
    makers = [
        lambda: dk.F1Score(task="multiclass", num_classes=C, average="macro"),
        lambda: dk.AUROC(task="multiclass", num_classes=C, num_bins=32),
        RootMeanSquare,
        lambda: dk.MetricGroup({"acc": dk.Accuracy(task="multiclass", num_classes=C),
                                "ppl": dk.Perplexity(num_classes=C)}),
    ]
    local = [mk() for mk in makers]
    inputs_here = [here, here, values_here, dict(preds=here[0], target=here[1])]
    inputs_there = [there, there, values_there, dict(preds=there[0], target=there[1])]
    for m, b in zip(local, inputs_here):
        m.update(**b) if isinstance(b, dict) else m.update(*b)
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        back = pickle.loads(pool.submit(_update_in_child, pickle.dumps(list(zip(local, inputs_there)))).result(120))
    for m, b_here, b_there, mk, r in zip(local, inputs_here, inputs_there, makers, back):
        # the child's copy held "here" before its own update: merged, "here" counts twice
        m.merge_state(r)
        expect = mk()
        for b in (b_here, b_here, b_there):
            expect.update(**b) if isinstance(b, dict) else expect.update(*b)
        _close(m.compute(), expect.compute())


@pytest.mark.gpu
def test_cuda_group_pickles_onto_cuda():
    gen = torch.Generator().manual_seed(5)
    batches = [(_mc(gen), torch.randn(8, generator=gen)) for _ in range(2)]
    g = _group().to("cuda")
    cuda = lambda b: ((b[0][0].cuda(), b[0][1].cuda()), b[1].cuda())  # noqa: E731
    _feed(g, *cuda(batches[0]))
    g.sync()
    c = pickle.loads(pickle.dumps(g))
    assert c.device.type == "cuda" and all(m._storage is c._storage for m in c.values())
    _same(c.compute(), g.compute())
    _feed(c, *cuda(batches[1]))
    fresh = _group()
    for b in batches:
        _feed(fresh, *b)
    _close({k: v.cpu() for k, v in c.compute().items()}, fresh.compute())
