"""Argument checks shared by the metric catalogue (metadata only, no host sync)."""

from __future__ import annotations

import math

import torch

from d9d_kernels.core.metric import NAN_STRATEGIES  # noqa: F401  (defined by the core, which checks it first)

TASKS = ("binary", "multiclass", "multilabel")
MULTIDIM_AVERAGES = ("global", "samplewise")
# None: torchmetrics' channel-first reading where the shapes allow it, else
# channel-last; 1 / -1: only that reading.
CLASS_DIMS = (None, 1, -1)


def fail(metric: str, arg: str, msg: str, exc: type = ValueError):
    raise exc(f"{metric}: argument '{arg}' {msg}")


def check(cond: bool, metric: str, arg: str, msg: str, exc: type = ValueError) -> None:
    if not cond:
        fail(metric, arg, msg, exc)


def check_int(metric: str, arg: str, v, lo: int = 1, optional: bool = False) -> None:
    if v is None and optional:
        return
    check(isinstance(v, int) and not isinstance(v, bool), metric, arg, f"must be an int, got {v!r}", TypeError)
    check(v >= lo, metric, arg, f"must be >= {lo}, got {v}")


def check_choice(metric: str, arg: str, v, choices) -> None:
    check(v in choices, metric, arg, f"must be one of {tuple(choices)}, got {v!r}")


def check_ignore_index(metric: str, v) -> None:
    check(v is None or (isinstance(v, int) and not isinstance(v, bool)), metric, "ignore_index",
          f"must be an int or None, got {v!r}", TypeError)


def check_threshold(metric: str, v) -> None:
    check(isinstance(v, (int, float)) and not isinstance(v, bool), metric, "threshold", f"must be a float, got {v!r}", TypeError)
    check(0.0 <= float(v) <= 1.0 and math.isfinite(float(v)), metric, "threshold", f"must lie in [0, 1], got {v}")


def check_class_dim(metric: str, v) -> None:
    check(v is None or (isinstance(v, int) and not isinstance(v, bool)), metric, "class_dim",
          f"must be None, 1 or -1, got {v!r}", TypeError)
    check_choice(metric, "class_dim", v, CLASS_DIMS)


def score_class_dim(metric: str, ps: tuple, ts: tuple, n: int, class_dim, what: str = "num_classes") -> int:
    """Where the ``n`` classes of scores ``ps`` (one dim more than target ``ts``) are:
    1 (torchmetrics' ``[N, C, d1, ...]``) or -1 (``[..., C]``).

    ``class_dim=None`` takes torchmetrics' reading whenever the shapes fit it,
    so an ambiguous ``[B, C, T]`` with ``T == C`` is read channel-first as
    torchmetrics reads it; channel-last only when channel-first does not fit.
    """
    first = len(ps) >= 2 and ps[1] == n and ps[:1] + ps[2:] == ts
    last = ps[-1] == n and ps[:-1] == ts
    if class_dim != -1 and first:
        return 1
    if class_dim != 1 and last:
        return -1
    want = {None: f"[N, {what}, d1, ...] (channel-first, target [N, d1, ...]) or target.shape + ({what},)",
            1: f"[N, {what}, d1, ...] with target [N, d1, ...] (class_dim=1)",
            -1: f"target.shape + ({what},) = {ts + (n,)} (class_dim=-1)"}[class_dim]
    fail(metric, "preds", f"scores must have shape {want}; got preds {ps} and target {ts} with {what}={n}")


def label_dim(metric: str, ps: tuple, n: int, class_dim) -> int:
    """Where the ``n`` labels of multilabel ``preds`` (target's shape) are: 1
    (torchmetrics' ``[N, L, d1, ...]``, preferred when both fit) or -1."""
    first = len(ps) >= 2 and ps[1] == n
    last = len(ps) >= 2 and ps[-1] == n
    if class_dim != -1 and first:
        return 1
    if class_dim != 1 and last:
        return -1
    where = {None: "[N, num_labels, d1, ...] or [..., num_labels]", 1: "[N, num_labels, d1, ...] (class_dim=1)",
             -1: "[..., num_labels] (class_dim=-1)"}[class_dim]
    fail(metric, "preds", f"must have shape {where} with num_labels={n}, got {ps}")


def channel_last(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with its class dim last: a view (``movedim``), never a copy."""
    return t.movedim(1, -1) if dim == 1 and t.dim() > 2 else t


def check_index_dtype(metric: str, arg: str, t: torch.Tensor) -> None:
    """Class indices must have an integer dtype: a floating target (1.5, or
    even 1.0) is a dtype mistake visible from metadata, caught at update."""
    if t.is_floating_point():
        fail(metric, arg, f"must hold integer class indices, got {t.dtype} (convert with .long())", TypeError)


def broadcasts_to(shape, target_shape) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target_shape`` (pure Python:
    torch.broadcast_shapes goes through torch._refs, ~5 us a call)."""
    ms, ts = tuple(shape), tuple(target_shape)
    return len(ms) <= len(ts) and all(m in (1, t) for m, t in zip(ms[::-1], ts[::-1]))


def check_tensor(metric: str, arg: str, t) -> None:
    # messages are built only on failure: eager f-strings cost ~1 us per check
    # and an update runs ~10 checks per member (bench/profile_layers.py).
    if not isinstance(t, torch.Tensor):
        if type(t).__name__ == "LinearLogits":
            from d9d_kernels.metrics.linear_logits import TAKEN_BY

            fail(metric, arg, f"is a dk.LinearLogits (logits never materialised), which {metric} cannot take: it "
                 f"needs every logit; LinearLogits is taken by: {TAKEN_BY}")
        fail(metric, arg, f"must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.is_complex():
        fail(metric, arg, f"must be real, got {t.dtype}", TypeError)


def check_preds_target(metric: str, preds, target) -> None:
    """``preds`` and ``target`` are real tensors on the same device."""
    check_tensor(metric, "preds", preds)
    check_tensor(metric, "target", target)
    if preds.device != target.device:
        fail(metric, "target", f"must be on preds' device {preds.device}, got {target.device}")


def check_pairs(metric: str, preds, target, weights=None, mask=None) -> None:
    """The shared checks of an elementwise ``update(preds, target, weights, mask)``:
    real tensors on one device, ``target`` of ``preds``' shape, ``weights`` a
    real tensor on that device broadcastable to it, ``mask`` a bool one."""
    check_preds_target(metric, preds, target)
    ps = tuple(preds.shape)
    check(tuple(target.shape) == ps, metric, "target", f"must have preds' shape {ps}, got {tuple(target.shape)}")
    check_weights(metric, weights, preds)
    check_mask(metric, mask, ps)


def check_weights(metric: str, weights, like) -> None:
    """``weights``: None, or a real tensor on ``like``'s device broadcastable to its shape."""
    if weights is None:
        return
    check_tensor(metric, "weights", weights)
    check(weights.device == like.device, metric, "weights", f"must be on preds' device {like.device}, got {weights.device}")
    check(broadcasts_to(weights.shape, like.shape), metric, "weights",
          f"of shape {tuple(weights.shape)} does not broadcast to preds' {tuple(like.shape)}")


def check_mask(metric: str, mask, shape) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        fail(metric, "mask", f"must be a bool tensor or None, got {type(mask).__name__}", TypeError)
    if mask.dtype != torch.bool:
        fail(metric, "mask", f"must be bool, got {mask.dtype}", TypeError)
    if not broadcasts_to(mask.shape, shape):
        fail(metric, "mask", f"of shape {tuple(mask.shape)} does not broadcast to target's {tuple(shape)}")


def bad_message(label: str, count, nan_strategy: str) -> str:
    if nan_strategy == "error":
        what = "target/class index out of range or a NaN/Inf prediction"
    else:
        what = "target/class index out of range"
    return (f"{label}: {count} invalid input element(s)/row(s) ({what}) were counted and left out since the last "
            f"reset (nan_strategy={nan_strategy!r})")
