"""Vector results through d9d's logging path: ``d9d_kernels.d9d.Scalars`` splits them into
one scalar per element, which d9d's ``JobLogger`` flattens to ``train/f1/3`` and its
tracker accepts; unwrapped, d9d's ``Scalar`` refuses them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("d9d.metric")

import d9d_kernels as dk  # noqa: E402
from d9d_kernels.d9d import Scalars  # noqa: E402

C = 4


def _group():
    kw = dict(task="multiclass", num_classes=C)
    return dk.MetricGroup({"f1": dk.F1Score(**kw, average="none"), "cm": dk.ConfusionMatrix(**kw),
                           "acc": dk.Accuracy(**kw)})


def _log(metrics) -> dict:
    """What d9d's JobLogger.log writes to the tracker for ``{"train": metrics}``."""
    from d9d.loop.component.job_logger import _flatten_pytree_for_metrics
    from d9d.metric.impl.container import ComposeMetric
    from d9d.tracker import Scalar

    tree = ComposeMetric({"train": metrics}).compute()
    return {name: Scalar(value=value).value.item() for name, value in _flatten_pytree_for_metrics(tree).items()}


def test_vector_results_logged_as_per_class_scalars():
    import d9d.metric
    from sklearn.metrics import confusion_matrix, f1_score

    g = torch.Generator().manual_seed(0)
    preds, target = torch.randint(0, C, (50,), generator=g), torch.randint(0, C, (50,), generator=g)
    with pytest.raises(ValueError, match="A scalar must have one element"):
        plain = _group()
        plain.update(preds=preds, target=target)
        _log(plain)
    m = Scalars(_group())
    assert isinstance(m, d9d.metric.Metric)
    m.update(preds=preds, target=target)
    logged = _log(m)
    f1 = f1_score(target.numpy(), preds.numpy(), average=None, labels=list(range(C)))
    cm = confusion_matrix(target.numpy(), preds.numpy(), labels=list(range(C)))
    want = {f"train/f1/{c}": float(f1[c]) for c in range(C)}
    want |= {f"train/cm/{i}/{j}": float(cm[i, j]) for i in range(C) for j in range(C)}
    want["train/acc"] = float((preds == target).double().mean())
    assert logged.keys() == want.keys()
    for k, v in want.items():
        assert logged[k] == pytest.approx(v, abs=1e-12), k
    # the wrapper is the group for everything else: members, reset, checkpoints
    assert m["f1"] is m.metric["f1"] and m.state_dict().keys() == m.metric.state_dict().keys()
    m.reset()
    assert _log(m)["train/cm/0/0"] == 0.0
