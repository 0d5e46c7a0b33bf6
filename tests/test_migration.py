"""Migration is a rename: torchmetrics' own docstring examples, run through both libraries.

For every metric class exported by ``d9d_kernels`` that torchmetrics 1.9 also
has (the task wrappers through their ``Binary*`` / ``Multiclass*`` /
``Multilabel*`` classes, whose docstrings hold the examples), the examples
are read from the installed torchmetrics source with ``doctest``'s parser and
replayed: setup lines (imports, seeded tensors) run as written; each
``metric = TmClass(...)`` line is mirrored by the d9d_kernels class with the
same arguments (``task=`` added for the task-specific classes); each
``metric(*inputs)`` line is compared on a fresh pair of metrics fed those
inputs (``compute()`` after ``update``), and its batch value through
``forward`` when d9d_kernels has one; ``metric.update`` / ``metric.compute()``
lines (aggregation examples) accumulate on one pair.

An example is skipped with its reason when it uses an argument d9d_kernels'
class does not take (e.g. ``multidim_average`` before it lands, multi-output
regression); the reasons and the remaining numeric differences are listed in
docs/metrics.md ("Migration from torchmetrics").
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import re
import warnings

import numpy as np
import pytest
import torch

import d9d_kernels as dk

tm = pytest.importorskip("torchmetrics")

TASK_PREFIXES = (("Binary", "binary"), ("Multiclass", "multiclass"), ("Multilabel", "multilabel"))
SUBMODULES = ("classification", "regression", "aggregation", "text", "segmentation", "wrappers")
#: fixed-bin AUROC / AveragePrecision vs torchmetrics' exact curves (1e-3 at 10 000 bins, docs/metrics.md)
BINNED = {"AUROC", "AveragePrecision"}
#: binned curves (tuples of tensors): compared with torchmetrics' binned mode only
CURVES = {"ROC", "PrecisionRecallCurve"}
#: scores read off the binned curves: thresholds=None (torchmetrics' exact curve) is the 10 000-bin histogram here,
#: whose threshold is the bin edge below the score (0.3499 for a float32 0.35): compared as BINNED (1e-3)
CURVE_SCORES = {"LogAUC", "PrecisionAtFixedRecall", "RecallAtFixedPrecision", "SensitivityAtSpecificity",
                "SpecificityAtSensitivity"}
BINNED |= CURVE_SCORES


def _dk_names() -> list[str]:
    import d9d_kernels

    return [n for n, mod in d9d_kernels._NAMES.items() if mod != "d9d_kernels.distributed"
            and n not in ("Metric", "MetricGroup")]


def _tm_classes(name: str) -> list[tuple[type, str | None]]:
    """torchmetrics classes for the d9d_kernels class ``name``: (class, task)."""
    out = []
    for prefix, task in TASK_PREFIXES:
        cls = getattr(importlib.import_module("torchmetrics.classification"), prefix + name, None)
        if cls is not None:
            out.append((cls, task))
    if out:
        return out
    for sub in SUBMODULES:
        cls = getattr(importlib.import_module(f"torchmetrics.{sub}"), name, None)
        if isinstance(cls, type):
            return [(cls, None)]
    return []


#: examples whose numbers differ by a documented rule (docs/metrics.md); strict: a fix shows up as XPASS
KNOWN_DIFFERENCES = {
    "MulticlassAUROC": "a class with no positives: torchmetrics scores it 0 and averages it in; d9d_kernels "
                       "leaves it undefined (NaN) and out of the macro average",
    "MulticlassAveragePrecision": "a class with no positives: torchmetrics NaN (left out of macro); d9d_kernels "
                                  "0.0 (scikit-learn's value) and averaged in",
}


def _cases():
    cases = []
    for name in _dk_names():
        for cls, task in _tm_classes(name):
            examples = doctest.DocTestParser().get_examples(cls.__doc__ or "")
            if examples:
                marks = ()
                if cls.__name__ in KNOWN_DIFFERENCES:
                    marks = pytest.mark.xfail(strict=True, raises=AssertionError, reason=KNOWN_DIFFERENCES[cls.__name__])
                cases.append(pytest.param(name, cls, task, examples, id=cls.__name__, marks=marks))
    return cases


CASES = _cases()


def test_every_shared_class_has_docstring_examples():
    shared = {c.values[0] for c in CASES}
    # the shared classes, by name: a class that silently lost its examples would vanish from CASES
    for name in ("Accuracy", "F1Score", "ConfusionMatrix", "AUROC", "MeanSquaredError", "R2Score", "Perplexity",
                 "SumMetric", "MaxMetric", "MinMetric", "CalibrationError", "GeneralizedDiceScore", "MeanIoU",
                 "KLDivergence", "CosineSimilarity", "MeanAbsolutePercentageError",
                 "SymmetricMeanAbsolutePercentageError", "RunningMean", "DiceScore"):
        assert name in shared, name


def test_issue_35_classes_have_docstring_examples():
    """The classes added for issue #35 (item 4) whose torchmetrics docstrings hold examples."""
    shared = {c.values[0] for c in CASES}
    for name in ("MeanSquaredLogError", "NormalizedRootMeanSquaredError", "WeightedMeanAbsolutePercentageError",
                 "LogCoshError", "MinkowskiDistance", "RelativeSquaredError", "ConcordanceCorrCoef",
                 "TweedieDevianceScore", "CriticalSuccessIndex", "StatScores", "HammingDistance", "ExactMatch",
                 "NegativePredictiveValue", "JensenShannonDivergence", "RunningSum"):
        assert name in shared, name


def test_curve_scores_have_docstring_examples():
    """The curve-derived scores (issue #35, item 4): each task class's torchmetrics examples are replayed."""
    shared = {(c.values[0], c.values[2]) for c in CASES}
    for name in sorted(CURVE_SCORES):
        for task in ("binary", "multiclass", "multilabel"):
            assert (name, task) in shared, (name, task)


class _Recorder:
    """Stands in for a torchmetrics class to capture the constructor arguments."""

    def __init__(self, cls):
        self.cls = cls

    def __call__(self, *args, **kwargs):
        return ("ctor", self.cls, args, kwargs)


def _dk_metric(name: str, task: str | None, tm_cls: type, args: tuple, kwargs: dict, inputs: tuple = ()):
    """The d9d_kernels mirror of ``TmClass(*args, **kwargs)``, or a skip reason.

    ``inputs``: the first update's; where d9d_kernels takes ``num_outputs``
    and torchmetrics reads the width from the data (R2Score,
    ExplainedVariance: per-output state is allocated at construction),
    a 2-D ``preds`` gives it.

    The task-specific classes' own defaults are passed explicitly where they
    differ from the task wrapper's (``MulticlassAccuracy`` averages "macro",
    ``Accuracy(task="multiclass")`` "micro"; d9d_kernels follows the wrapper).
    """
    cls = getattr(dk, name)
    if args:  # by the names torchmetrics gives them (MinkowskiDistance(3), CriticalSuccessIndex(0.5))
        try:
            bound = inspect.signature(tm_cls.__init__).bind(None, *args, **kwargs).arguments
        except TypeError:
            return None, f"{name}: positional constructor arguments"
        if any(isinstance(a, tm.Metric) for a in args):
            return None, f"{name}: a torchmetrics metric as constructor argument"
        kwargs = {k: v for k, v in list(bound.items())[1:] if k != "kwargs"}
        kwargs.update(bound.get("kwargs", {}))
        args = ()
    params = inspect.signature(cls.__init__).parameters
    kw = {}
    if task is not None:
        kw["task"] = task
        for k, p in inspect.signature(tm_cls.__init__).parameters.items():
            if k in params and p.default is not inspect.Parameter.empty and k not in ("validate_args",):
                kw[k] = p.default
    kw.update(kwargs)
    kw.pop("validate_args", None)
    if "num_outputs" in params and "num_outputs" not in kw and inputs and getattr(inputs[0], "ndim", 0) == 2:
        kw["num_outputs"] = inputs[0].shape[1]
    unknown = sorted(k for k in kw if k not in params)
    if unknown:
        return None, f"{name}: torchmetrics argument(s) {unknown} not taken by d9d_kernels (docs/metrics.md)"
    if name in CURVES and kw.get("thresholds") is None:
        return None, f"{name}: thresholds=None is torchmetrics' exact curve (its length grows with the data); " \
                     "d9d_kernels' curves are binned (docs/metrics.md)"
    try:
        return cls(**kw), None
    except ValueError as e:  # a documented difference (e.g. MeanIoU(per_class=True) needs num_classes here)
        return None, f"{name}: {e}"


def _value(t) -> np.ndarray:
    return np.asarray(t.detach().double().cpu().numpy()).reshape(-1)


def _samplewise(kwargs: dict) -> bool:
    return kwargs.get("multidim_average") == "samplewise"


def _compare(name, ours, theirs, what, samplewise=False):
    if isinstance(ours, tuple):  # a curve: (x, y, thresholds); torchmetrics may give per-class lists
        for i, (a, e) in enumerate(zip(ours, theirs)):
            _compare_one(name, a, torch.stack(e) if isinstance(e, (list, tuple)) else e, f"{what}[{i}]", samplewise)
        return
    _compare_one(name, ours, theirs, what, samplewise)


def _compare_one(name, ours, theirs, what, samplewise=False):
    """``samplewise``: torchmetrics returns one value per sample seen; a packed
    state cannot grow with the samples, so d9d_kernels returns their mean
    (a documented difference, docs/metrics.md)."""
    if samplewise:
        theirs = theirs.double().mean(0)
    a, e = _value(ours), _value(theirs)
    assert a.shape == e.shape, f"{what}: shape {a.shape} vs torchmetrics {e.shape}"
    atol = 1e-3 if name in BINNED else 1e-6
    np.testing.assert_allclose(a, e, rtol=1e-5, atol=atol, err_msg=what)


@pytest.mark.parametrize("name, tm_cls, task, examples", CASES)
def test_docstring_examples(name, tm_cls, task, examples):
    ns: dict = {"torch": torch, "tensor": torch.tensor}  # some examples use `tensor` unimported
    ns.update({tm_cls.__name__: tm_cls, "randn": torch.randn})  # and their class / randn (WMAPE's example)
    pairs: dict[str, tuple] = {}  # variable -> (tm class, args, kwargs, dk metric, tm metric)
    compared, skipped = 0, []
    ctor = re.compile(r"^(\w+)\s*=\s*(\w+)\((.*)\)\s*$", re.S)
    call = re.compile(r"^(\w+)\((.*)\)\s*$", re.S)
    method = re.compile(r"^(\w+)\.(update|compute)\((.*)\)\s*$", re.S)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for ex in examples:
            src = re.sub(r"\s*#\s*doctest:.*$", "", ex.source.strip())
            m = ctor.match(src)
            if m and isinstance(ns.get(m.group(2)), type) and issubclass(ns[m.group(2)], tm.Metric):
                var, cls_name = m.group(1), m.group(2)
                kind, cls, args, kwargs = eval(f"__rec({m.group(3)})", {**ns, "__rec": _Recorder(ns[cls_name])})
                ours, reason = _dk_metric(name, task, cls, args, kwargs)
                if ours is None:
                    skipped.append(reason)
                    pairs.pop(var, None)
                else:
                    pairs[var] = (cls, args, kwargs, ours, cls(*args, **kwargs))
                exec(src, ns)
                continue
            m = call.match(src)
            if m and m.group(1) in pairs:
                cls, args, kwargs, _, _ = pairs[m.group(1)]
                inputs = eval(f"({m.group(2)},)", ns)
                fresh = _dk_metric(name, task, cls, args, kwargs, inputs)[0]
                ref = cls(*args, **kwargs)
                fresh.update(*inputs)
                ref.update(*inputs)
                _compare(name, fresh.compute(), ref.compute(), f"{src} (compute)", _samplewise(kwargs))
                compared += 1
                if hasattr(fresh, "forward") or callable(fresh):
                    batch = _dk_metric(name, task, cls, args, kwargs, inputs)[0]
                    _compare(name, batch(*inputs), cls(*args, **kwargs)(*inputs), f"{src} (forward)",
                             _samplewise(kwargs))
                continue
            m = method.match(src)
            if m and m.group(1) in pairs:
                cls, args, kwargs, ours, theirs = pairs[m.group(1)]
                if m.group(2) == "update":
                    inputs = eval(f"({m.group(3)},)", ns)
                    if getattr(ours, "num_outputs", 1) != getattr(_dk_metric(name, task, cls, args, kwargs, inputs)[0],
                                                                  "num_outputs", 1):
                        ours = _dk_metric(name, task, cls, args, kwargs, inputs)[0]  # before its first update
                        pairs[m.group(1)] = (cls, args, kwargs, ours, theirs)
                    ours.update(*inputs)
                    theirs.update(*inputs)
                else:
                    _compare(name, ours.compute(), theirs.compute(), src, _samplewise(kwargs))
                    compared += 1
                continue
            if re.match(r"^(for|print|fig|_ = \w+\.plot|\w+\.plot)", src) or "plot(" in src:
                continue  # loops over forward values and plotting: covered by the batch-value test below
            if any(re.search(rf"\b{v}\b", src) for v in pairs):
                skipped.append(f"unparsed use of a metric: {src[:60]}")
                continue
            try:
                exec(src, ns)
            except NameError as e:  # a name an unparsed line above would have set (fpr, tpr, ... = metric(...))
                skipped.append(f"uses a value of an unparsed line ({e}): {src[:40]}")
    if compared == 0:
        pytest.skip("; ".join(sorted(set(skipped))) or "no comparable example")
    for reason in sorted(set(skipped)):  # shown in pytest's warnings summary: the examples not compared, and why
        warnings.warn(f"{tm_cls.__name__} example not compared: {reason}", UserWarning, stacklevel=1)


def test_running_mean_docstring_loop():
    """torchmetrics.aggregation.RunningMean's example (a loop of forward calls,
    then compute), transcribed: window 3 over updates 0..5."""
    ours, theirs = dk.RunningMean(window=3), tm.aggregation.RunningMean(window=3)
    for i in range(6):
        v = torch.tensor([float(i)])
        if callable(getattr(ours, "forward", None)):
            np.testing.assert_allclose(_value(ours(v)), _value(theirs(v)), rtol=1e-6)
        else:
            ours.update(v)
            theirs.update(v)
        np.testing.assert_allclose(_value(ours.compute()), _value(theirs.compute()), rtol=1e-6)


@pytest.mark.skipif(not hasattr(dk.Metric, "forward"), reason="batch values (forward) land in another branch")
def test_forward_is_the_batch_value():
    ours = dk.Accuracy(task="multiclass", num_classes=3)
    theirs = tm.classification.MulticlassAccuracy(num_classes=3, average="micro")
    for preds, target in ((torch.tensor([2, 1, 0, 1]), torch.tensor([2, 1, 0, 0])),
                          (torch.tensor([0, 0, 1]), torch.tensor([2, 1, 0]))):
        np.testing.assert_allclose(_value(ours(preds, target)), _value(theirs(preds, target)), rtol=1e-6)
    np.testing.assert_allclose(_value(ours.compute()), _value(theirs.compute()), rtol=1e-6)


def test_catalogue_exports_every_new_name():
    import importlib

    for n in ("CalibrationError", "Dice", "DiceScore", "GeneralizedDiceScore", "MeanIoU", "KLDivergence",
              "CosineSimilarity", "MeanAbsolutePercentageError", "SymmetricMeanAbsolutePercentageError", "RunningMean"):
        assert getattr(dk, n) is getattr(importlib.import_module(dk._NAMES[n]), n)
        assert issubclass(getattr(dk, n), dk.Metric) and n in dk.__all__


def test_documented_differences_hold():
    """The measured examples of docs/metrics.md's difference table: if either
    library changes, this fails and the table must be updated."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        scores, target = torch.tensor([[0.3, 0.3, 0.3, 0.1]]), torch.tensor([2])
        ours = dk.Accuracy(task="multiclass", num_classes=4, top_k=2)
        ours.update(scores, target)
        theirs = tm.classification.MulticlassAccuracy(num_classes=4, top_k=2, average="micro")
        assert ours.compute().item() == 0.0 and theirs(scores, target).item() == 1.0  # top-k tie rule
        ones = torch.tensor([1, 1, 1])
        mcc = dk.MatthewsCorrCoef(task="binary")
        mcc.update(ones, ones)
        assert mcc.compute().item() == 0.0 and tm.classification.BinaryMatthewsCorrCoef()(ones, ones).item() == 1.0
        assert dk.MeanSquaredError().compute().item() == 0.0 and torch.isnan(tm.MeanSquaredError().compute())
        with pytest.raises(ValueError, match=r"KLDivergence.*'reduction'"):
            dk.KLDivergence(reduction="none")
        with pytest.raises(ValueError, match=r"MeanIoU.*'num_classes'"):
            dk.MeanIoU(per_class=True)
