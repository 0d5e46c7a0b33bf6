"""Peer implementations compared by the benchmarks and the demo.

Every provider builds the SAME metric group from the same inputs, so that a
benchmark times only the library. Providers:

* ``d9d``               -- ``dk.MetricGroup`` (one packed buffer, fused kernels).
* ``torchmetrics``      -- ``MetricCollection`` with torchmetrics' defaults
                           (automatic compute groups, ``validate_args=True``,
                           ``nan_strategy="warn"``): what a user writes first.
* ``torchmetrics_fast`` -- torchmetrics' fastest documented settings: explicit
                           ``compute_groups``, ``validate_args=False``,
                           ``nan_strategy="ignore"`` on the loss mean
                           ("disable" drops MeanMetric's weights in 1.9.0).
* ``torcheval``         -- torcheval metrics in a dict (its
                           ``sync_and_compute_collection`` for sync).
* ``plain_torch``       -- a hand-written update a competent engineer would
                           write: one ``topk`` for top-1/top-5, one ``bincount``
                           confusion matrix (int64), everything else derived
                           from the confusion matrix at compute time.

The update group (``make_update_group``) is the one of bench_update.py:
loss weighted mean + accuracy + top-5 accuracy + macro F1 + macro precision +
macro recall + confusion matrix. ``make_sync_group`` builds K metrics for
bench_sync.py. Every group exposes ``update(logits, target, loss, n)``,
``compute() -> dict[str, Tensor]`` and ``reset()``; sync groups also
``sync_compute(ctx)``.
"""

from __future__ import annotations

import warnings

import torch

UPDATE_PROVIDERS = ("d9d", "torchmetrics", "torchmetrics_fast", "torcheval", "plain_torch")
SYNC_PROVIDERS = ("d9d", "torchmetrics", "torcheval", "raw_all_reduce")
UPDATE_KEYS = ("loss", "acc", "top5", "f1", "precision", "recall", "confmat")

warnings.filterwarnings("ignore", module="torchmetrics")
warnings.filterwarnings("ignore", module="torcheval")
warnings.filterwarnings("ignore", message=".*torch.jit.script.*")


def _topk(num_classes: int) -> int:
    return min(5, num_classes)


# --------------------------------------------------------------------------- d9d
class D9DUpdateGroup:
    def __init__(self, num_classes: int, device="cpu"):
        import d9d_kernels as dk

        C = num_classes
        kw = dict(task="multiclass", num_classes=C)
        self.g = dk.MetricGroup(
            {
                "loss": dk.WeightedMeanMetric(),
                "acc": dk.Accuracy(**kw, average="micro"),
                "top5": dk.Accuracy(**kw, average="micro", top_k=_topk(C)),
                "f1": dk.F1Score(**kw, average="macro"),
                "precision": dk.Precision(**kw, average="macro"),
                "recall": dk.Recall(**kw, average="macro"),
                "confmat": dk.ConfusionMatrix(**kw),
            },
            device=device,
        )
        self.loss = self.g["loss"]

    def update(self, logits, target, loss, n):
        self.loss.update(values=loss, weights=n)
        self.g.update(preds=logits, target=target)

    def compute(self):
        return dict(self.g.compute())

    def reset(self):
        self.g.reset()


# ------------------------------------------------------------------ torchmetrics
class TorchmetricsUpdateGroup:
    def __init__(self, num_classes: int, device="cpu", fast: bool = False, compute_groups=None):
        from torchmetrics import MeanMetric, MetricCollection
        from torchmetrics.classification import (
            MulticlassAccuracy,
            MulticlassConfusionMatrix,
            MulticlassF1Score,
            MulticlassPrecision,
            MulticlassRecall,
        )

        C = num_classes
        kw = dict(num_classes=C, validate_args=not fast)
        # nan_strategy="disable" would be fastest, but in torchmetrics 1.9.0 it
        # silently drops the weights of MeanMetric (weight = ones_like(value)),
        # so the fast setting uses "ignore", the fastest one that is correct.
        self.loss = MeanMetric(nan_strategy="ignore" if fast else "warn").to(device)
        metrics = {
            "acc": MulticlassAccuracy(**kw, average="micro"),
            "top5": MulticlassAccuracy(**kw, average="micro", top_k=_topk(C)),
            "f1": MulticlassF1Score(**kw, average="macro"),
            "precision": MulticlassPrecision(**kw, average="macro"),
            "recall": MulticlassRecall(**kw, average="macro"),
            "confmat": MulticlassConfusionMatrix(**kw),
        }
        groups = [["acc"], ["top5"], ["f1", "precision", "recall"], ["confmat"]] if fast else True
        if compute_groups is not None:  # tests: False gives the reference (no automatic merging)
            groups = compute_groups
        self.col = MetricCollection(metrics, compute_groups=groups).to(device)

    def update(self, logits, target, loss, n):
        self.loss.update(loss, n)
        self.col.update(logits, target)

    def compute(self):
        out = {"loss": self.loss.compute()}
        out.update(self.col.compute())
        return out

    def reset(self):
        self.loss.reset()
        self.col.reset()


# --------------------------------------------------------------------- torcheval
class TorchevalUpdateGroup:
    def __init__(self, num_classes: int, device="cpu"):
        import torcheval.metrics as te

        C = num_classes
        dev = torch.device(device)
        self.m = {
            "loss": te.Mean(device=dev),
            "acc": te.MulticlassAccuracy(num_classes=C, average="micro", device=dev),
            "top5": te.MulticlassAccuracy(num_classes=C, average="micro", k=_topk(C), device=dev),
            "f1": te.MulticlassF1Score(num_classes=C, average="macro", device=dev),
            "precision": te.MulticlassPrecision(num_classes=C, average="macro", device=dev),
            "recall": te.MulticlassRecall(num_classes=C, average="macro", device=dev),
            "confmat": te.MulticlassConfusionMatrix(num_classes=C, device=dev),
        }

    def update(self, logits, target, loss, n):
        m = self.m
        m["loss"].update(loss, weight=n)
        for k in UPDATE_KEYS[1:]:
            m[k].update(logits, target)

    def compute(self):
        return {k: v.compute() for k, v in self.m.items()}

    def reset(self):
        for v in self.m.values():
            v.reset()


# ------------------------------------------------------------------- plain torch
def _macro(score, tp, fp, fn):
    """torchmetrics' macro averaging: classes with tp+fp+fn == 0 are left out."""
    w = ((tp + fp + fn) > 0).to(score.dtype)
    return (score * w).sum() / w.sum().clamp_min(1)


def _div(a, b):
    return torch.where(b > 0, a / b.clamp_min(1e-300), torch.zeros_like(a))


class PlainTorchUpdateGroup:
    """Hand-written update: what you'd write without a metrics library."""

    def __init__(self, num_classes: int, device="cpu"):
        C = self.C = num_classes
        self.k = _topk(C)
        self.loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        self.loss_w = torch.zeros((), dtype=torch.float64, device=device)
        self.hits = torch.zeros(2, dtype=torch.int64, device=device)  # top-1, top-k hits
        self.cm = torch.zeros(C * C, dtype=torch.int64, device=device)

    def update(self, logits, target, loss, n):
        self.loss_sum += loss.detach().to(torch.float64) * n
        self.loss_w += n
        topk = logits.topk(self.k, dim=1).indices  # sorted: column 0 is the argmax
        hit = topk == target[:, None]
        self.hits[0] += hit[:, 0].sum()
        self.hits[1] += hit.any(dim=1).sum()
        self.cm += torch.bincount(target * self.C + topk[:, 0], minlength=self.C * self.C)

    def compute(self):
        cm = self.cm.view(self.C, self.C).to(torch.float64)
        tp = cm.diagonal()
        pred, tgt = cm.sum(0), cm.sum(1)
        fp, fn = pred - tp, tgt - tp
        n = cm.sum()
        prec, rec = _div(tp, pred), _div(tp, tgt)
        f1 = _div(2 * tp, 2 * tp + fp + fn)
        return {
            "loss": self.loss_sum / self.loss_w,
            "acc": self.hits[0] / n,
            "top5": self.hits[1] / n,
            "f1": _macro(f1, tp, fp, fn),
            "precision": _macro(prec, tp, fp, fn),
            "recall": _macro(rec, tp, fp, fn),
            "confmat": self.cm.view(self.C, self.C),
        }

    def reset(self):
        for t in (self.loss_sum, self.loss_w, self.hits, self.cm):
            t.zero_()


def make_update_group(provider: str, num_classes: int, device="cpu"):
    """The bench_update group for ``provider`` (see UPDATE_PROVIDERS)."""
    if provider == "d9d":
        return D9DUpdateGroup(num_classes, device)
    if provider == "torchmetrics":
        return TorchmetricsUpdateGroup(num_classes, device, fast=False)
    if provider == "torchmetrics_fast":
        return TorchmetricsUpdateGroup(num_classes, device, fast=True)
    if provider == "torcheval":
        return TorchevalUpdateGroup(num_classes, device)
    if provider == "plain_torch":
        return PlainTorchUpdateGroup(num_classes, device)
    raise ValueError(f"unknown provider {provider!r}; expected one of {UPDATE_PROVIDERS}")


def update_inputs(batch: int, num_classes: int, device="cpu", seed: int = 0):
    """(logits [N, C] float32, target [N] int64, loss 0-d float32, n int)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, num_classes, generator=g).to(device)
    target = torch.randint(0, num_classes, (batch,), generator=g).to(device)
    loss = torch.rand((), generator=g).to(device)
    return logits, target, loss, batch


# ---------------------------------------------------------------------- sync group
# K metrics cycle through this mix (what a training loop logs: several loss
# means, sums, extrema, and classification metrics on a small class count).
SYNC_MIX = ("mean", "sum", "max", "min", "acc", "f1")
SYNC_C = 10


def sync_members(K: int) -> list[tuple[str, str]]:
    return [(f"m{i}_{SYNC_MIX[i % len(SYNC_MIX)]}", SYNC_MIX[i % len(SYNC_MIX)]) for i in range(K)]


class D9DSyncGroup:
    def __init__(self, K: int, device="cpu"):
        import d9d_kernels as dk

        kw = dict(task="multiclass", num_classes=SYNC_C)
        make = {
            "mean": lambda: dk.WeightedMeanMetric(),
            "sum": lambda: dk.SumMetric(),
            "max": lambda: dk.MaxMetric(),
            "min": lambda: dk.MinMetric(),
            "acc": lambda: dk.Accuracy(**kw, average="micro"),
            "f1": lambda: dk.F1Score(**kw, average="macro"),
        }
        self.members = sync_members(K)
        self.g = dk.MetricGroup({name: make[kind]() for name, kind in self.members}, device=device)

    def update(self, logits, target, loss, n):
        for name, kind in self.members:
            if kind in ("acc", "f1"):
                continue
            if kind == "mean":
                self.g[name].update(values=loss, weights=n)
            else:
                self.g[name].update(values=loss)
        if any(k in ("acc", "f1") for _, k in self.members):
            self.g.update(preds=logits, target=target)

    def trigger(self, ctx=None):
        self.g.trigger_sync(ctx)

    def wait(self, ctx=None):
        self.g.wait_sync(ctx)

    def compute(self):
        return dict(self.g.compute())

    def sync_compute(self, ctx=None):
        self.g.trigger_sync(ctx)
        self.g.wait_sync(ctx)
        return self.compute()

    def state_bytes(self) -> int:
        """Bytes of state one sync has to move (all reduction kinds)."""
        return _state_bytes(self.g)


def _state_bytes(g) -> int:
    # Prefer what the group itself reports, else count its state_dict tensors
    # that are local state (synced copies excluded).
    for attr in ("state_nbytes", "nbytes"):
        v = getattr(g, attr, None)
        if v is not None:
            return int(v() if callable(v) else v)
    total = 0
    for k, t in g.state_dict().items():
        if isinstance(t, torch.Tensor) and "sync" not in k:
            total += t.numel() * t.element_size()
    return total


class TorchmetricsSyncGroup:
    def __init__(self, K: int, device="cpu"):
        from torchmetrics import MaxMetric, MeanMetric, MetricCollection, MinMetric, SumMetric
        from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

        make = {
            "mean": MeanMetric,
            "sum": SumMetric,
            "max": MaxMetric,
            "min": MinMetric,
            "acc": lambda: MulticlassAccuracy(num_classes=SYNC_C, average="micro"),
            "f1": lambda: MulticlassF1Score(num_classes=SYNC_C, average="macro"),
        }
        self.members = sync_members(K)
        self.m = {name: make[kind]().to(device) for name, kind in self.members}

    def update(self, logits, target, loss, n):
        for name, kind in self.members:
            m = self.m[name]
            if kind in ("acc", "f1"):
                m.update(logits, target)
            elif kind == "mean":
                m.update(loss, n)
            else:
                m.update(loss)

    def sync_compute(self, ctx=None):
        # Metric.compute() syncs (all_gather of every state), computes, unsyncs.
        return {k: m.compute() for k, m in self.m.items()}


class TorchevalSyncGroup:
    def __init__(self, K: int, device="cpu"):
        import torcheval.metrics as te

        dev = torch.device(device)
        make = {
            "mean": lambda: te.Mean(device=dev),
            "sum": lambda: te.Sum(device=dev),
            "max": lambda: te.Max(device=dev),
            "min": lambda: te.Min(device=dev),
            "acc": lambda: te.MulticlassAccuracy(num_classes=SYNC_C, average="micro", device=dev),
            "f1": lambda: te.MulticlassF1Score(num_classes=SYNC_C, average="macro", device=dev),
        }
        self.members = sync_members(K)
        self.m = {name: make[kind]() for name, kind in self.members}

    def update(self, logits, target, loss, n):
        for name, kind in self.members:
            m = self.m[name]
            if kind in ("acc", "f1"):
                m.update(logits, target)
            elif kind == "mean":
                m.update(loss, weight=n)
            else:
                m.update(loss)

    def sync_compute(self, ctx=None):
        from torcheval.metrics.toolkit import sync_and_compute_collection

        return sync_and_compute_collection(self.m)


def make_sync_group(provider: str, K: int, device="cpu"):
    if provider == "d9d":
        return D9DSyncGroup(K, device)
    if provider == "torchmetrics":
        return TorchmetricsSyncGroup(K, device)
    if provider == "torcheval":
        return TorchevalSyncGroup(K, device)
    raise ValueError(f"unknown sync provider {provider!r}")
