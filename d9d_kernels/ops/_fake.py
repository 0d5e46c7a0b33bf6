"""Fake (meta) implementations of the compiled ops, for torch.compile / FakeTensor.

Each op is in place and returns nothing, so its fake only repeats the
metadata checks of the C++ entry points (``csrc/kernels/*_checks.h``) with
``torch._check`` and returns None. Registered only when ``_C`` defines the ops.
"""

from __future__ import annotations

import torch

from d9d_kernels import _extension
from d9d_kernels.ops._common import FLOATS


def _ok(cond: bool, op: str, arg: str, msg: str) -> None:
    torch._check(cond, lambda: f"d9d_kernels.{op}: argument '{arg}' {msg}")


def _device(op: str, arg: str, t: torch.Tensor, dev: torch.device) -> None:
    _ok(t.device == dev, op, arg, f"must be on {dev} (the device of the first input), got {t.device}")


def _state(op: str, arg: str, t: torch.Tensor, shape: tuple, dev: torch.device) -> None:
    _ok(t.dtype == torch.float64, op, arg, f"must be float64 {list(shape)}, got {t.dtype}")
    _ok(tuple(t.shape) == tuple(shape), op, arg, f"must be float64 {list(shape)}, got shape {list(t.shape)}")
    _device(op, arg, t, dev)
    _ok(t.is_contiguous(), op, arg, "must be contiguous (it is written in place)")


def _mask(op: str, mask, shape, dev) -> None:
    if mask is None:
        return
    _ok(mask.dtype == torch.bool, op, "mask", f"must be bool, got {mask.dtype}")
    _ok(tuple(mask.shape) == tuple(shape), op, "mask", f"must have shape {list(shape)}, got {list(mask.shape)}")
    _device(op, "mask", mask, dev)


def _index(op: str, arg: str, t: torch.Tensor, dev: torch.device) -> None:
    _ok(t.dtype == torch.int64, op, arg, f"must be int64, got {t.dtype}")
    _device(op, arg, t, dev)


def weighted_moments(x, y, weights, mask, skip_bad, state, bad, pivot):
    op, dev = "weighted_moments", x.device
    _ok(not x.dtype.is_complex, op, "x", f"must be a floating, integer or bool tensor, got {x.dtype}")
    _ok(x.dim() == 1, op, "x", f"must be 1-D [N] (the dk.ops wrapper flattens), got shape {list(x.shape)}")
    for name, t in (("y", y), ("weights", weights)):
        if t is not None:
            _ok(not t.dtype.is_complex, op, name, f"must be a floating, integer or bool tensor, got {t.dtype}")
            _ok(t.shape == x.shape, op, name, f"must have the shape of x {list(x.shape)}, got {list(t.shape)}")
            _device(op, name, t, dev)
    _mask(op, mask, x.shape, dev)
    _state(op, "state", state, (9,), dev)
    _state(op, "bad", bad, (1,), dev)
    if pivot is not None:
        _state(op, "pivot", pivot, (2,), dev)


def class_stats(preds, target, mask, num_classes, ignore_index, top_ks, nll, stats, confmat, extras, bad):
    op, dev, C = "class_stats", preds.device, num_classes
    _ok(C >= 1, op, "num_classes", f"must be >= 1, got {C}")
    _index(op, "target", target, dev)
    _ok(target.dim() == 1, op, "target", f"must be 1-D [N], got shape {list(target.shape)}")
    n = target.shape[0]
    scores = preds.dtype in FLOATS
    if scores:
        _ok(tuple(preds.shape) == (n, C), op, "preds", f"scores must have shape [N, num_classes] = [{n}, {C}], got {list(preds.shape)}")
    else:
        _ok(preds.dtype == torch.int64, op, "preds", f"must be int64 class indices or floating scores, got {preds.dtype}")
        _ok(preds.shape == target.shape, op, "preds", f"indices must have the shape of target, got {list(preds.shape)}")
    ks = list(top_ks)
    _ok(len(ks) >= 1 or (nll and scores), op, "top_ks", "must be non-empty unless nll with scores")
    _ok(all(1 <= k <= C for k in ks), op, "top_ks", f"must lie in [1, num_classes={C}], got {ks}")
    _ok(len(set(ks)) == len(ks), op, "top_ks", f"must be distinct, got {ks}")
    _ok(scores or ks == [1], op, "top_ks", f"must be [1] when preds are class indices, got {ks}")
    _ok(scores or not nll, op, "nll", "needs scores/logits preds, got class indices")
    _mask(op, mask, target.shape, dev)
    _state(op, "stats", stats, (len(ks), 3, C), dev)
    if confmat is not None:
        _state(op, "confmat", confmat, (C, C), dev)
    _state(op, "extras", extras, (2,), dev)
    _state(op, "bad", bad, (2,), dev)


def binary_stats(preds, target, mask, threshold, ignore_index, input_kind, state, bad):
    op, dev = "binary_stats", preds.device
    _ok(not preds.is_complex(), op, "preds", f"must be real, got {preds.dtype}")
    _ok(preds.dim() == 2, op, "preds", f"must be 2-D [N, L], got shape {list(preds.shape)}")
    _index(op, "target", target, dev)
    _ok(target.shape == preds.shape, op, "target", f"must have the shape of preds {list(preds.shape)}, got {list(target.shape)}")
    _ok(input_kind in (0, 1, 2), op, "input_kind", f"must be 0 (probs), 1 (logits) or 2 (auto), got {input_kind}")
    _mask(op, mask, preds.shape, dev)
    _state(op, "state", state, (preds.shape[1], 4), dev)
    _state(op, "bad", bad, (2,), dev)


def score_histogram(preds, target, mask, ignore_index, input_kind, multiclass, hist, bad):
    op, dev = "score_histogram", preds.device
    _ok(preds.dtype in FLOATS, op, "preds", f"must be float16/bfloat16/float32/float64, got {preds.dtype}")
    _ok(preds.dim() == 2, op, "preds", f"must be 2-D [N, L], got shape {list(preds.shape)}")
    _index(op, "target", target, dev)
    if multiclass:
        _ok(tuple(target.shape) == (preds.shape[0],), op, "target", f"must be [N] class indices when multiclass, got {list(target.shape)}")
    else:
        _ok(target.shape == preds.shape, op, "target", f"must have the shape of preds {list(preds.shape)}, got {list(target.shape)}")
    _ok(input_kind in (0, 1, 2), op, "input_kind", f"must be 0 (probs), 1 (logits) or 2 (auto), got {input_kind}")
    _mask(op, mask, target.shape, dev)
    _ok(hist.dim() == 3 and hist.shape[0] == 2 and hist.shape[1] == preds.shape[1] and hist.shape[2] >= 1, op, "hist",
        f"must be float64 [2, L, B] with L = {preds.shape[1]} and B >= 1, got shape {list(hist.shape)}")
    _state(op, "hist", hist, tuple(hist.shape), dev)
    _state(op, "bad", bad, (2,), dev)


def running_extrema(x, mask, skip_bad, state, bad):
    op, dev = "running_extrema", x.device
    _ok(x.dtype in FLOATS, op, "x", f"must be float16/bfloat16/float32/float64, got {x.dtype}")
    _ok(x.dim() == 1, op, "x", f"must be 1-D [N], got shape {list(x.shape)}")
    _mask(op, mask, x.shape, dev)
    _state(op, "state", state, (2,), dev)
    _state(op, "bad", bad, (1,), dev)


def register() -> None:
    """Registers the fakes once, if the compiled ops exist."""
    if _extension.CPP_ERROR is not None:
        return
    for name in _extension.OPS:
        qual = f"d9d_kernels::{name}"
        try:
            torch._C._dispatch_find_schema_or_throw(qual, "")
        except RuntimeError:
            continue
        torch.library.register_fake(qual)(globals()[name])
    # the internal ops (vocab-parallel partials): shape-only
    for qual, fake in (("d9d_kernels::vocab_partials", lambda x, target, start, kmax, sumexp, out: None),
                       ("d9d_kernels::vocab_class_stats", lambda g, target, mask, ignore_index, lse, num_classes, top_ks,
                        nll, rows_by_lse, stats, extras, bad, confmat: None)):
        try:
            torch._C._dispatch_find_schema_or_throw(qual, "")
        except RuntimeError:
            continue
        torch.library.register_fake(qual)(fake)


register()
