"""torchmetrics compatibility: our classes and torchmetrics 1.9's, built with the
SAME constructor arguments, fed the same batches (issue #35, item 5).

The cases are a product over the input families torchmetrics' own tests use
(``tests/unittests/classification/_inputs.py``: binary probs / logits / 0-1
ints, multiclass probs / logits / labels, multilabel probs / logits / ints,
each also multidim channel-first ``[N, C, d1]`` with targets ``[N, d1]``;
regression single / multi-output; aggregation with NaN) and the arguments:
``ignore_index`` (none, outside the class range, inside it), every
``average``, ``top_k`` 1 and 2, ``zero_division`` 0 / 1 / NaN where
torchmetrics takes it, ``threshold`` 0.5 / 0.6, ``thresholds=<int>`` for the
binned AUROC / AveragePrecision, ``normalize``, ``weights``, ``multioutput``,
``nan_strategy`` ... A combination torchmetrics itself rejects (its
constructor or its first ``update`` raises) is left out when the list is
built; the count of those is printed by ``test_case_counts``.

Every case runs ``NB`` batches: ``update`` on all but the last, ``forward``
(``metric(preds, target)``) on the last, and compares the batch value and
``compute()`` (accumulation over all batches). Tolerances: counts
(ConfusionMatrix, StatScores micro / none) exactly; everything else
``rtol=1e-5, atol=1e-6`` (torchmetrics computes in float32, we in float64).

Documented deliberate differences (docs/metrics.md, "Migration from
torchmetrics" and "Conventions") are asserted as the documented value, built
from torchmetrics' own functions where possible:

- Precision / F1Score / FBetaScore with ``top_k > 1``: a row predicts every
  class of its top-k (torchmetrics' reduce functions on those counts);
- binned AUROC / AveragePrecision: a score of exactly 1.0 lies in the last
  bin (torchmetrics on the scores with 1.0 moved just below it), and a label
  / class without positives (AUROC, AP) or negatives (AUROC) is left out of
  the AUROC average / scores 0.0 in AP;
- multilabel JaccardIndex with ``ignore_index`` equal to a label index:
  ``ignore_index`` is only a target value;
- MatthewsCorrCoef with a zero denominator: 0.0 (scikit-learn);
- ``multidim_average="samplewise"``: the mean of torchmetrics' per-sample
  vector; StatScores ``"weighted"`` normalised per sample;
- NegativePredictiveValue ``zero_division``: torchmetrics' functional NPV
  (its modular class ignores it);
- R2Score / ExplainedVariance need ``num_outputs=M`` (torchmetrics reads it
  from the data); NRMSE refuses
  ``[N, M]`` with ``num_outputs=1`` (torchmetrics pools; flattened inputs do);
- aggregation ``nan_strategy="error"``: torchmetrics raises in ``update``,
  here the ``ValueError`` comes where the host reads the value.

Disagreements that are library bugs are ``xfail(strict=True)`` with the
reason (``KNOWN_BUGS``). Per-class counts are in docs/metrics.md and the
README's catalogue table ("parity" column).
"""

from __future__ import annotations

import functools
import itertools
import math
import warnings
import zlib
from collections import Counter

import pytest
import torch

import d9d_kernels as dk
from tests.metrics._catalogue_utils import _one_thread  # noqa: F401

tm = pytest.importorskip("torchmetrics")
import torchmetrics.functional as tmf  # noqa: E402
from torchmetrics.functional.classification.f_beta import _fbeta_reduce  # noqa: E402
from torchmetrics.functional.classification.jaccard import _jaccard_index_reduce  # noqa: E402
from torchmetrics.functional.classification.precision_recall import _precision_recall_reduce  # noqa: E402
from torchmetrics.utilities.compute import _adjust_weights_safe_divide  # noqa: E402

#: torchmetrics' test sizes (NUM_CLASSES=5, EXTRA_DIM=3); NB batches per case
NB, BS, C, L, D1, M = 3, 32, 5, 4, 3, 5
NAN = float("nan")
RTOL, ATOL = 1e-5, 1e-6


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **k)


# ------------------------------------------------------------------------------------------------------------------
# input families
# ------------------------------------------------------------------------------------------------------------------

FAMILIES = {
    "binary": ["probs", "logits", "ints", "md-probs", "md-logits", "md-ints", "sparse-probs"],
    "multiclass": ["probs", "logits", "labels", "md-probs", "md-logits", "md-labels", "sparse-labels",
                   "sparse-logits"],
    "multilabel": ["probs", "logits", "ints", "md-probs", "md-logits", "md-ints", "sparse-probs"],
}
IGNORE_INDEX = [None, -1, 0]  # none, outside the class range, inside it


@functools.cache
def classification_batches(task: str, family: str, ignore_index):
    """``NB`` (preds, target) batches; ``ignore_index`` written into 15 % of the targets."""
    g = _gen(task, family)
    md = family.startswith("md-")
    kind = family.split("-")[-1]
    if task == "multiclass":
        t_shape = (NB, BS, D1) if md else (NB, BS)
        s_shape = (NB, BS, C, D1) if md else (NB, BS, C)
        if kind == "labels":
            # sparse: class C-1 nowhere, class C-2 never predicted
            hi_p, hi_t = (C - 2, C - 1) if family.startswith("sparse") else (C, C)
            preds, target = torch.randint(0, hi_p, t_shape, generator=g), torch.randint(0, hi_t, t_shape, generator=g)
        else:
            target = torch.randint(0, C - 1 if family.startswith("sparse") else C, t_shape, generator=g)
            preds = torch.randn(s_shape, generator=g) * 2
            if family.startswith("sparse"):
                preds[:, :, C - 1] = -20.0  # never in a top-2: class C-1 has no tp, fp, fn
            if kind == "probs":
                preds = preds.softmax(2)
    else:
        shape = {"binary": (NB, BS), "multilabel": (NB, BS, L)}[task] + ((D1,) if md else ())
        target = torch.randint(0, 2, shape, generator=g)
        if kind == "ints":
            preds = torch.randint(0, 2, shape, generator=g)
        elif kind == "logits":
            preds = torch.randn(shape, generator=g) * 3
        else:
            preds = torch.rand(shape, generator=g)
        if family.startswith("sparse"):
            if task == "binary":
                preds = preds * 0.4  # nothing predicted positive: precision 0/0
            else:
                preds[:, :, 0], target[:, :, 0] = 0.1, 0  # label 0: nothing predicted, nothing true
                preds[:, :, 1] = 0.2  # label 1: nothing predicted
    if ignore_index is not None:
        target = target.clone()
        target[torch.rand(target.shape, generator=_gen(task, family, ignore_index)) < 0.15] = ignore_index
    return tuple(zip(preds.unbind(0), target.unbind(0)))


# ------------------------------------------------------------------------------------------------------------------
# classification cases
# ------------------------------------------------------------------------------------------------------------------

AVERAGES = ["micro", "macro", "weighted", "none"]
ZD_USED = (0, 1, NAN)  # torchmetrics divides by zero with it
ZD_IGNORED = (0, 1)  # torchmetrics takes it and does not use it

#: the stat-scores family: name -> the zero_division values crossed with the other axes
STAT_SCORES_LIKE = {
    "Accuracy": ZD_IGNORED, "Precision": ZD_USED, "Recall": ZD_USED, "F1Score": ZD_USED, "FBetaScore": ZD_USED,
    "Specificity": ZD_IGNORED, "JaccardIndex": ZD_USED, "StatScores": ZD_IGNORED, "HammingDistance": ZD_IGNORED,
    "NegativePredictiveValue": ZD_USED,
}
NO_TOP_K = {"JaccardIndex"}
OTHER_CLASSIFICATION = {
    "MatthewsCorrCoef": [{}],
    "CohenKappa": [{"weights": w} for w in (None, "linear", "quadratic")],
    "ConfusionMatrix": [{"normalize": n} for n in (None, "true", "pred", "all")],
    "ExactMatch": [{}],
}
RANKING = ["AUROC", "AveragePrecision"]
RANKING_THRESHOLDS = [11, 100]


def _arg_sets(name: str, task: str, family: str):
    """Keyword dicts (besides task / sizes / ignore_index) for one class, task and family."""
    scores = family.split("-")[-1] in ("probs", "logits")
    if name in STAT_SCORES_LIKE:
        averages = [None] if task == "binary" else AVERAGES
        top_ks = [1, 2] if task == "multiclass" and scores and name not in NO_TOP_K else [None]
        thresholds = [None] if task == "multiclass" else [None, 0.6]
        betas = [0.5, 2.0] if name == "FBetaScore" else [None]
        for avg, k, thr, beta, zd in itertools.product(averages, top_ks, thresholds, betas, STAT_SCORES_LIKE[name]):
            kw = {"average": avg, "top_k": k, "threshold": thr, "beta": beta, "zero_division": zd}
            yield {a: v for a, v in kw.items() if v is not None}
        if family.startswith("md-"):  # one score per sample n over its d1 positions
            for avg, beta in itertools.product(averages, betas[-1:]):
                kw = {"average": avg, "beta": beta, "multidim_average": "samplewise"}
                yield {a: v for a, v in kw.items() if v is not None}
    elif name in OTHER_CLASSIFICATION:
        for kw, thr in itertools.product(OTHER_CLASSIFICATION[name], [None] if task == "multiclass" else [None, 0.6]):
            yield {**kw, **({} if thr is None else {"threshold": thr})}
    else:  # ranking
        averages = [None] if task == "binary" else ["micro", "macro", "weighted", "none"]
        for avg, thr in itertools.product(averages, RANKING_THRESHOLDS):
            yield {"thresholds": thr, **({} if avg is None else {"average": avg})}


def _sizes(task: str) -> dict:
    return {"binary": {}, "multiclass": {"num_classes": C}, "multilabel": {"num_labels": L}}[task]


def _fmt(v) -> str:
    return "nan" if isinstance(v, float) and math.isnan(v) else str(v)


def _case_id(name, task, family, ii, kw) -> str:
    args = ",".join(f"{k}={_fmt(v)}" for k, v in kw.items())
    return f"{name}-{task}-{family}-ii={ii}" + (f"-{args}" if args else "")


def _tm_metric(name: str, task: str, ii, kw: dict, validate: bool = True):
    return getattr(tm, name)(task=task, ignore_index=ii, validate_args=validate, **_sizes(task), **kw)


def _is_nan(v) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _torchmetrics_rejects(name: str, task: str, family: str, ii, kw: dict) -> bool:
    """torchmetrics' own verdict on the combination: its constructor and first update, with its argument
    checks on (NaN zero_division is checked as 1: its check admits 0 / 1 only, its arithmetic takes NaN)."""
    checked = {k: (1 if k == "zero_division" and _is_nan(v) else v) for k, v in kw.items()}
    try:
        m = _quiet(_tm_metric, name, task, ii, checked)
        _quiet(m.update, *classification_batches(task, family, ii)[0])
    except (ValueError, RuntimeError, TypeError):
        return True
    return False


REJECTED: Counter = Counter()


def _classification_cases():
    for name in [*STAT_SCORES_LIKE, *OTHER_CLASSIFICATION, *RANKING]:
        for task, families in FAMILIES.items():
            for family, ii in itertools.product(families, IGNORE_INDEX):
                for kw in _arg_sets(name, task, family):
                    if _torchmetrics_rejects(name, task, family, ii, kw):
                        REJECTED[name] += 1
                        continue
                    yield _case_id(name, task, family, ii, kw), (name, task, family, ii, kw)


CLASSIFICATION_CASES = dict(_classification_cases())

#: case id -> reason: disagreements that are library bugs (reported, not fixed here)
KNOWN_BUGS: dict[str, str] = {}


def _params(cases: dict):
    return [pytest.param(*v, id=k, marks=[pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[k])]
                         if k in KNOWN_BUGS else []) for k, v in cases.items()]


# -- what torchmetrics gives, and the documented values where we differ by design -----------------------------------


def _run_tm(make, batches):
    """compute() over all batches and forward's value on the last, torchmetrics."""
    m = make()
    for p, t in batches[:-1]:
        _quiet(m.update, p, t)
    batch = _quiet(m, *batches[-1])
    return _quiet(m.compute), batch


def _run_ours(make, batches):
    m = make()
    for p, t in batches[:-1]:
        m.update(p, t)
    batch = m(*batches[-1])
    return m.compute(), batch


def _topk_every_class_counts(batches, k: int, ii):
    """tp, fp, tn, fn per class when a row predicts every class of its top-k (docs/metrics.md, Conventions)."""
    tp = fp = tn = fn = torch.zeros(C, dtype=torch.float64)
    for p, t in batches:
        s, y = p.movedim(1, -1).reshape(-1, C), t.reshape(-1)
        if ii is not None:
            s, y = s[y != ii], y[y != ii]
        pred = torch.zeros_like(s, dtype=torch.bool).scatter_(1, s.topk(k, dim=1).indices, True)
        hot = torch.nn.functional.one_hot(y, C).bool()
        tp = tp + (pred & hot).sum(0)
        fp = fp + (pred & ~hot).sum(0)
        fn = fn + (~pred & hot).sum(0)
        tn = tn + (~pred & ~hot).sum(0)
    return tp, fp, tn, fn


def _documented_topk_value(name, kw, ii, batches):
    tp, fp, tn, fn = _topk_every_class_counts(batches, kw["top_k"], ii)
    avg, zd = kw.get("average", "micro"), kw.get("zero_division", 0)
    if name == "Precision":
        return _precision_recall_reduce("precision", tp, fp, tn, fn, average=avg, top_k=kw["top_k"], zero_division=zd)
    per_class = _fbeta_reduce(tp, fp, tn, fn, kw.get("beta", 1.0), average="none", zero_division=zd)
    if avg == "micro":
        return _fbeta_reduce(tp, fp, tn, fn, kw.get("beta", 1.0), average="micro", zero_division=zd)
    # macro over the classes present in the target, as Precision's top-k rule (docs/metrics.md, Averages)
    return _adjust_weights_safe_divide(per_class, avg, False, tp, fp, fn, top_k=kw["top_k"])


def _positives_negatives(task, ii, batches):
    """Per label / class: positive and negative targets kept (ranking metrics)."""
    pos = neg = 0
    for _, t in batches:
        if task == "multiclass":
            y = t.reshape(-1)
            y = y[y != ii] if ii is not None else y
            hot = torch.nn.functional.one_hot(y, C)
            pos, neg = pos + hot.sum(0), neg + (1 - hot).sum(0)
        else:
            y = t.movedim(1, -1).reshape(-1, L) if task == "multilabel" else t.reshape(-1, 1)
            keep = (y != ii) if ii is not None else torch.ones_like(y, dtype=torch.bool)
            pos, neg = pos + ((y == 1) & keep).sum(0), neg + ((y == 0) & keep).sum(0)
    return pos, neg


def _documented_ranking_value(name, task, ii, kw, batches):
    """AUROC / AP as docs/metrics.md defines them where torchmetrics' binned mode differs, else None."""
    reasons = []
    if any((p == 1.0).any() for p, _ in batches):  # a score of exactly 1.0: the threshold 1.0 counts it not
        reasons.append("score 1.0 in the last bin")
        below = torch.nextafter(torch.tensor(1.0), torch.tensor(0.0))
        batches = tuple((torch.where(p.float() == 1.0, below, p.float()), t) for p, t in batches)
    pos, neg = _positives_negatives(task, ii, batches)
    avg = kw.get("average", "macro")
    if avg == "micro" and task == "multilabel":
        pos, neg = pos.sum(0, keepdim=True), neg.sum(0, keepdim=True)
    undefined = (pos == 0) | (neg == 0) if name == "AUROC" else pos == 0
    if not bool(undefined.any()) and not reasons:
        return None
    if not bool(undefined.any()):
        return _run_tm(lambda: _tm_metric(name, task, ii, kw), batches)[0]
    reasons.append("label without positives" + (" or negatives" if name == "AUROC" else ""))
    if task == "binary" or avg == "micro":
        return torch.tensor(0.0)  # undefined AUROC: 0.0; AP without positives: 0.0
    per = _run_tm(lambda: _tm_metric(name, task, ii, {**kw, "average": "none"}), batches)[0].double()
    per = torch.where(undefined, NAN if name == "AUROC" else 0.0, per)
    if avg == "none":
        return per
    w = torch.ones_like(per) if avg == "macro" else pos.double()
    w = torch.where(torch.isnan(per), 0.0, w)
    return (torch.nan_to_num(per) * w).sum() / w.sum() if w.sum() > 0 else torch.tensor(0.0)


def classification_expected(name, task, family, ii, kw, batches):
    """(value, how): torchmetrics' value, or the documented one where we differ by design."""
    if name in ("Precision", "F1Score", "FBetaScore") and kw.get("top_k", 1) > 1:
        return _documented_topk_value(name, kw, ii, batches), "documented: top-k counts every top-k class"
    if name in RANKING:
        v = _documented_ranking_value(name, task, ii, kw, batches)
        if v is not None:
            return v, "documented: binned AUROC / AP conventions"
    if name == "JaccardIndex" and task == "multilabel" and ii is not None and 0 <= ii < L:
        cm = _run_tm(lambda: _tm_metric("ConfusionMatrix", task, ii, {k: v for k, v in kw.items()
                                                                      if k == "threshold"}), batches)[0]
        zd = kw.get("zero_division", 0)
        return (_jaccard_index_reduce(cm, kw.get("average", "macro"), ignore_index=None, zero_division=zd),
                "documented: multilabel ignore_index is a target value only")
    if name == "MatthewsCorrCoef":
        cm = _run_tm(lambda: _tm_metric("ConfusionMatrix", task, ii, kw), batches)[0].double()
        cm = cm.sum(0) if cm.ndim == 3 else cm  # multilabel: the labels' 2x2 matrices summed
        tk, pk, s = cm.sum(-1), cm.sum(-2), cm.sum()
        if (s * s - (pk * pk).sum()) * (s * s - (tk * tk).sum()) == 0:
            return torch.tensor(0.0), "documented: undefined MCC (a zero denominator) is 0.0, as scikit-learn"
    if name == "NegativePredictiveValue" and kw.get("zero_division", 0) != 0:
        # documented: applied as torchmetrics' functional NPV (its modular class takes it and ignores it)
        preds, target = (torch.cat(x) for x in zip(*batches))
        value = _quiet(tmf.negative_predictive_value, preds, target, task=task, ignore_index=ii, validate_args=False,
                       **_sizes(task), **kw)
        if kw.get("multidim_average") == "samplewise":
            value = value.double().mean(0)
        return value, "documented: zero_division as torchmetrics' functional NPV"
    if name == "StatScores" and kw.get("multidim_average") == "samplewise" and kw.get("average") == "weighted":
        # per sample: the classes' rows weighted by their support over that sample's support (torchmetrics'
        # multiclass rule; its multilabel code divides by the support of all samples), 0 without support
        per = _run_tm(lambda: _tm_metric(name, task, ii, {**kw, "average": "none"}), batches)[0].double()
        w = per[..., 4:]
        return (torch.nan_to_num(w / w.sum(1, keepdim=True)) * per).sum(1).mean(0), \
            "documented: samplewise weighted StatScores normalised per sample"
    validate = not _is_nan(kw.get("zero_division", 0))
    value = _run_tm(lambda: _tm_metric(name, task, ii, kw, validate), batches)[0]
    if kw.get("multidim_average") == "samplewise":
        return value.double().mean(0), "documented: samplewise is the mean of torchmetrics' per-sample values"
    return value, "torchmetrics"


def _assert_close(ours, want, exact: bool, msg: str):
    want = torch.as_tensor(want).double()
    ours = ours.detach().double().reshape(want.shape)
    tol = {"rtol": 0, "atol": 0} if exact else {"rtol": RTOL, "atol": ATOL}
    torch.testing.assert_close(ours, want, equal_nan=True, msg=lambda m: f"{msg}\n{m}", **tol)


@pytest.mark.parametrize("name,task,family,ii,kw", _params(CLASSIFICATION_CASES))
def test_classification_matches_torchmetrics(name, task, family, ii, kw):
    batches = classification_batches(task, family, ii)
    value, batch = _run_ours(lambda: getattr(dk, name)(task=task, ignore_index=ii, **_sizes(task), **kw), batches)
    exact = (name == "ConfusionMatrix" and kw.get("normalize") is None) or (
        name == "StatScores" and kw.get("average", "micro") in ("micro", "none"))
    want, how = classification_expected(name, task, family, ii, kw, batches)
    _assert_close(value, want, exact, f"compute() vs {how}")
    want_batch, how = classification_expected(name, task, family, ii, kw, batches[-1:])
    _assert_close(batch, want_batch, exact, f"forward vs {how}")


# ------------------------------------------------------------------------------------------------------------------
# regression
# ------------------------------------------------------------------------------------------------------------------


@functools.cache
def regression_batches(family: str):
    g = _gen("regression", family)
    shape = (NB, BS, M) if family.startswith("multi") else (NB, BS)
    if family.endswith("randn"):
        preds, target = torch.randn(shape, generator=g) * 3 + 1, torch.randn(shape, generator=g) * 2 - 0.5
    elif family == "rows":  # probability rows [N, D] (KLDivergence, CosineSimilarity)
        preds = torch.rand((NB, BS, M), generator=g) + 0.05
        target = torch.rand((NB, BS, M), generator=g) + 0.05
        preds, target = preds / preds.sum(-1, keepdim=True), target / target.sum(-1, keepdim=True)
    else:  # torchmetrics' regression inputs: rand
        preds, target = torch.rand(shape, generator=g) + 0.01, torch.rand(shape, generator=g) + 0.01
    return tuple(zip(preds.unbind(0), target.unbind(0)))


REG_ALL = ["single", "multi", "single-randn", "multi-randn"]
REG_POSITIVE = ["single", "multi"]

#: name -> (families, argument sets); num_outputs=M is added on multi-output families (_regression_arg_sets)
REGRESSION = {
    "MeanSquaredError": (REG_ALL, [{"squared": s} for s in (True, False)]),
    "MeanAbsoluteError": (REG_ALL, [{}]),
    "PearsonCorrCoef": (REG_ALL, [{}]),
    "R2Score": (REG_ALL, [{"multioutput": mo, "adjusted": a} for mo in ("raw_values", "uniform_average",
                                                                         "variance_weighted") for a in (0, 3)]),
    "ExplainedVariance": (REG_ALL, [{"multioutput": mo} for mo in ("raw_values", "uniform_average",
                                                                   "variance_weighted")]),
    "MeanSquaredLogError": (REG_POSITIVE, [{}]),
    "MeanAbsolutePercentageError": (REG_ALL, [{}]),
    "SymmetricMeanAbsolutePercentageError": (REG_ALL, [{}]),
    "WeightedMeanAbsolutePercentageError": (REG_ALL, [{}]),
    "NormalizedRootMeanSquaredError": (REG_ALL, [{"normalization": n} for n in ("mean", "range", "std", "l2")]),
    "LogCoshError": (REG_ALL, [{}]),
    "MinkowskiDistance": (REG_ALL, [{"p": p} for p in (1.0, 2.0, 3.0)]),
    "RelativeSquaredError": (REG_ALL, [{"squared": s} for s in (True, False)]),
    "ConcordanceCorrCoef": (REG_ALL, [{}]),
    "TweedieDevianceScore": (REG_POSITIVE, [{"power": p} for p in (0.0, 1.0, 1.5, 2.0, 3.0)]),
    "CriticalSuccessIndex": (REG_POSITIVE, [{"threshold": 0.5}]),
    "CosineSimilarity": (["rows"], [{"reduction": r} for r in ("sum", "mean")]),
    "KLDivergence": (["rows"], [{"reduction": r} for r in ("sum", "mean")]),
}
#: torchmetrics reads the output width from the data / has num_outputs; ours per the docs' migration table
TAKES_NUM_OUTPUTS = {"NormalizedRootMeanSquaredError", "LogCoshError", "RelativeSquaredError", "ConcordanceCorrCoef"}
NEEDS_NUM_OUTPUTS = {"R2Score", "ExplainedVariance"}  # ours only: torchmetrics infers it
POOL_BY_FLATTEN = {"NormalizedRootMeanSquaredError"}  # [N, M] without num_outputs: refused, flattened inputs pool
PER_COLUMN = {"MeanSquaredError", "MeanAbsoluteError", "PearsonCorrCoef"}  # num_outputs, as torchmetrics


def _regression_arg_sets(name, family):
    for kw in REGRESSION[name][1]:
        yield dict(kw)  # multi-output inputs without num_outputs: pooled where torchmetrics pools
        if family.startswith("multi") and name in TAKES_NUM_OUTPUTS | PER_COLUMN:
            yield {**kw, "num_outputs": M}


def _regression_cases():
    for name, (families, _) in REGRESSION.items():
        for family in families:
            for kw in _regression_arg_sets(name, family):
                try:
                    m = _quiet(getattr(tm, name), **kw)
                    _quiet(m.update, *regression_batches(family)[0])
                except (ValueError, RuntimeError, TypeError):
                    REJECTED[name] += 1
                    continue
                args = ",".join(f"{k}={v}" for k, v in kw.items())
                yield f"{name}-{family}" + (f"-{args}" if args else ""), (name, family, kw)


REGRESSION_CASES = dict(_regression_cases())


@pytest.mark.parametrize("name,family,kw", _params(REGRESSION_CASES))
def test_regression_matches_torchmetrics(name, family, kw):
    batches = regression_batches(family)
    want, want_batch = _run_tm(lambda: getattr(tm, name)(**kw), batches)
    if name in POOL_BY_FLATTEN and family.startswith("multi") and "num_outputs" not in kw:
        # documented: torchmetrics pools [N, M] with num_outputs=1; here that raises, flattened inputs pool
        with pytest.raises(ValueError, match="flatten them to pool"):
            getattr(dk, name)(**kw).update(*batches[0])
        value, batch = _run_ours(lambda: getattr(dk, name)(**kw), tuple((p.reshape(-1), t.reshape(-1))
                                                                         for p, t in batches))
    else:
        extra = {"num_outputs": M} if name in NEEDS_NUM_OUTPUTS and family.startswith("multi") else {}
        value, batch = _run_ours(lambda: getattr(dk, name)(**kw, **extra), batches)
    _assert_close(value, want, False, "compute()")
    _assert_close(batch, want_batch, False, "forward")


# ------------------------------------------------------------------------------------------------------------------
# aggregation
# ------------------------------------------------------------------------------------------------------------------


@functools.cache
def aggregation_updates(family: str):
    """A list of update argument tuples: (value,) or (value, weight)."""
    g = _gen("aggregation", family)
    vals = [torch.randn(7, generator=g), torch.randn(3, 2, generator=g), torch.randn((), generator=g)]
    if family == "clean":
        return tuple((v,) for v in vals)
    if family == "floats":
        return ((1.5,), (NAN,), (-2.0,), (0.25,))
    for v in vals:
        v[torch.rand(v.shape, generator=g) < 0.3] = NAN
    vals[0][1] = NAN
    if family == "nan":
        return tuple((v,) for v in vals)
    if family == "all-nan-update":
        return tuple((v,) for v in vals) + ((torch.full((2,), NAN),),)
    # weighted (MeanMetric): weights per element, one of them NaN in the last update
    w = [torch.rand(v.shape, generator=g) + 0.1 for v in vals]
    w[1][0, 0] = NAN
    return tuple(zip(vals, w))


AGGREGATION = ["SumMetric", "MeanMetric", "MaxMetric", "MinMetric", "RunningMean", "RunningSum"]
AGG_FAMILIES = ["clean", "floats", "nan", "all-nan-update", "weighted"]
NAN_STRATEGIES = ["warn", "ignore", "disable", "error", 0.0, 2.5]


def _aggregation_cases():
    for name, family, strategy in itertools.product(AGGREGATION, AGG_FAMILIES, NAN_STRATEGIES):
        if family == "weighted" and name != "MeanMetric":
            continue
        kw = {"nan_strategy": strategy, **({"window": 2} if name.startswith("Running") else {})}
        yield f"{name}-{family}-nan_strategy={strategy}", (name, family, kw)


AGGREGATION_CASES = dict(_aggregation_cases())


@pytest.mark.parametrize("name,family,kw", _params(AGGREGATION_CASES))
def test_aggregation_matches_torchmetrics(name, family, kw):
    updates = aggregation_updates(family)
    theirs = getattr(tm, name)(**kw)
    try:
        for u in updates:
            _quiet(theirs.update, *[x.clone() if isinstance(x, torch.Tensor) else x for x in u])
        want = _quiet(theirs.compute)
    except (RuntimeError, ValueError):  # torchmetrics: nan_strategy="error" raises in update on NaN
        assert kw["nan_strategy"] == "error", "torchmetrics raised for another nan_strategy"
        want = None
    ours = getattr(dk, name)(**kw)
    for u in updates:
        ours.update(*u)
    if want is None:  # documented: counted on the device, raised where the host reads the value
        with pytest.raises(ValueError, match=name):
            ours.compute_to_host().result()
        return
    _assert_close(_quiet(ours.compute), want, False, "compute()")


# ------------------------------------------------------------------------------------------------------------------
# the counts (docs/metrics.md and README's parity column quote them)
# ------------------------------------------------------------------------------------------------------------------


def case_counts() -> Counter:
    return Counter(v[0] for cases in (CLASSIFICATION_CASES, REGRESSION_CASES, AGGREGATION_CASES)
                   for v in cases.values())


def test_case_counts(capsys):
    counts = case_counts()
    with capsys.disabled():
        print("\ntorchmetrics compat cases per class:", dict(sorted(counts.items())))
        print("combinations torchmetrics rejects (left out):", dict(sorted(REJECTED.items())))
    assert set(counts) >= set(STAT_SCORES_LIKE) | set(OTHER_CLASSIFICATION) | set(RANKING) | set(REGRESSION)
