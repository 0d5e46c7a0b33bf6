"""Argument checks shared by the metric catalogue (metadata only, no host sync)."""

from __future__ import annotations

import math

import torch

from d9d_kernels.core.metric import NAN_STRATEGIES  # noqa: F401  (defined by the core, which checks it first)

TASKS = ("binary", "multiclass", "multilabel")


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


def broadcasts_to(shape, target_shape) -> bool:
    """Whether ``shape`` broadcasts to exactly ``target_shape`` (pure Python:
    torch.broadcast_shapes goes through torch._refs, ~5 us a call)."""
    ms, ts = tuple(shape), tuple(target_shape)
    return len(ms) <= len(ts) and all(m in (1, t) for m, t in zip(ms[::-1], ts[::-1]))


def check_tensor(metric: str, arg: str, t) -> None:
    # messages are built only on failure: eager f-strings cost ~1 us per check
    # and an update runs ~10 checks per member (bench/profile_layers.py).
    if not isinstance(t, torch.Tensor):
        fail(metric, arg, f"must be a torch.Tensor, got {type(t).__name__}", TypeError)
    if t.is_complex():
        fail(metric, arg, f"must be real, got {t.dtype}", TypeError)


def check_preds_target(metric: str, preds, target) -> None:
    """``preds`` and ``target`` are real tensors on the same device."""
    check_tensor(metric, "preds", preds)
    check_tensor(metric, "target", target)
    if preds.device != target.device:
        fail(metric, "target", f"must be on preds' device {preds.device}, got {target.device}")


def check_mask(metric: str, mask, shape) -> None:
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        fail(metric, "mask", f"must be a bool tensor or None, got {type(mask).__name__}", TypeError)
    if mask.dtype != torch.bool:
        fail(metric, "mask", f"must be bool, got {mask.dtype}", TypeError)
    if not broadcasts_to(mask.shape, shape):
        fail(metric, "mask", f"of shape {tuple(mask.shape)} does not broadcast to target's {tuple(shape)}")


def bad_count(state: dict, nan_strategy: str) -> torch.Tensor:
    """The device count that makes compute() raise: every bad element under
    ``"error"``; otherwise only the non-NaN errors (index/target out of range)."""
    bad = state["bad"].reshape(-1).sum()
    if nan_strategy != "error" and "nonfinite" in state:
        bad = bad - state["nonfinite"].reshape(-1).sum()
    return bad


def bad_message(label: str, count, nan_strategy: str) -> str:
    if nan_strategy == "error":
        what = "target/class index out of range or a NaN/Inf prediction"
    else:
        what = "target/class index out of range"
    return (f"{label}: {count} invalid input element(s)/row(s) ({what}) were counted and left out since the last "
            f"reset (nan_strategy={nan_strategy!r})")
