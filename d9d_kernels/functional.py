"""Functional collectives over dicts of tensors.

Every call packs the whole dict and communicates with ONE collective per
reduction kind, whatever the number of keys:

* ``reduce_sum`` / ``reduce_mean``: one SUM all-reduce (mean = sum / world size);
* ``reduce_max`` / ``reduce_min``: one MAX all-reduce (min = -max(-x));
* ``reduce_custom``: at most one SUM and one MAX all-reduce for any mix;
* ``all_gather``: one small gather of the per-rank sizes, then one gather of
  all the data (2 collectives), because first dims may differ per rank.

Values are packed as float64 for reductions (exact for integers below 2**53),
so float16/bfloat16 inputs are reduced at float64 precision. The result dtype
is what torch gives for the same reduction of the stacked per-rank tensors:
``torch.stack(per_rank).sum(0)`` / ``.amax(0)`` / ``.amin(0)`` (so bool and
integer sums are int64, floats keep their dtype) and the default float dtype
for the mean of integers/bools. Results live on each input's device.

Python numbers are accepted as values (they become 0-d tensors). Every rank
must pass the same keys (in any order) with the same shapes (and the same
``reduce_fn``); a
cheap fingerprint travels in the packed buffer, so ranks that passed
different keys/shapes/reductions get a ``ValueError`` instead of mixed numbers
(buffers of different lengths fail in the backend or time out with a
``RuntimeError``).

Example:
    >>> import torch
    >>> import d9d_kernels as dk
    >>> out = dk.functional.reduce_custom(
    ...     {"loss": torch.tensor(2.0), "tokens": torch.tensor(7), "gnorm": torch.tensor(0.5)},
    ...     {"loss": "mean", "tokens": "sum", "gnorm": "max"},
    ...     ctx=dk.DistributedContext.local(),
    ... )
    >>> {k: v.item() for k, v in out.items()}
    {'loss': 2.0, 'tokens': 7, 'gnorm': 0.5}
"""

from __future__ import annotations

import zlib
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from d9d_kernels.distributed import DistributedContext, as_context, fmt_ranks

__all__ = [
    "reduce_mean",
    "reduce_sum",
    "reduce_max",
    "reduce_min",
    "reduce_custom",
    "all_gather",
    "collect_from_devices",
]

_REDUCTIONS = ("mean", "sum", "max", "min")
_KIND = {"mean": "sum", "sum": "sum", "max": "max", "min": "max"}
_ALIGN = 16  # byte alignment of each key's segment in all_gather's packed buffer


def _context(ctx) -> DistributedContext:
    return as_context(ctx)


def _tensors(fn: str, metrics: Mapping) -> dict[str, torch.Tensor]:
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{fn}: metrics must be a dict of tensors, got {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        if isinstance(v, torch.Tensor):
            t = v.detach()
        elif isinstance(v, (bool, int, float)):
            t = torch.as_tensor(v)
        else:
            raise TypeError(f"{fn}: metrics[{k!r}] must be a tensor or a Python number, got {type(v).__name__}")
        if t.is_complex():
            raise TypeError(f"{fn}: metrics[{k!r}] is complex ({t.dtype}); complex values are not supported")
        out[k] = t
    return out


def _comm_device(tensors) -> torch.device:
    """Where the packed buffer lives: the first non-CPU input's device, else CPU."""
    for t in tensors:
        if t.device.type != "cpu":
            return t.device
    return torch.device("cpu")


def _fingerprint(items) -> float:
    """16-bit hash (as float, in [1, 65536]) of the per-rank layout; exact in float64 sums."""
    return float((zlib.crc32(repr(items).encode()) & 0xFFFF) + 1)


def _result_dtype(dtype: torch.dtype, how: str) -> torch.dtype:
    if dtype.is_floating_point:
        return dtype
    if how == "mean":
        return torch.get_default_dtype()
    if how == "sum":
        return torch.int64
    return dtype


def reduce_custom(
    metrics: Mapping[str, torch.Tensor],
    reduce_fn: Mapping[str, Optional[str]],
    ctx: Optional[DistributedContext] = None,
) -> dict[str, torch.Tensor]:
    """Reduce each value across the ranks of ``ctx`` with its own reduction.

    Args:
        metrics: name -> tensor (any shape and real dtype) or Python number.
        reduce_fn: name -> "mean" | "sum" | "max" | "min" | None (None keeps
            this rank's value, unreduced). Must cover exactly the keys of
            ``metrics``.
        ctx: a DistributedContext, a ProcessGroup, a DeviceMesh (all its ranks)
            or None (the default world group, or local).

    Returns:
        A new dict with the same keys (and order), each value reduced
        elementwise across ranks. At most two collectives: one SUM (mean, sum)
        and one MAX (max, min) all-reduce, both launched before either is
        waited on.
    """
    if not isinstance(reduce_fn, Mapping):
        raise TypeError(f"reduce_custom: reduce_fn must be a dict, got {type(reduce_fn).__name__}")
    tensors = _tensors("reduce_custom", metrics)
    extra = [k for k in reduce_fn if k not in tensors]
    missing = [k for k in tensors if k not in reduce_fn]
    if extra or missing:
        raise ValueError(
            f"reduce_custom: reduce_fn must name every key of metrics (None keeps a value local); "
            f"missing {missing}, unknown {extra}"
        )
    bad = {k: v for k, v in reduce_fn.items() if v is not None and v not in _REDUCTIONS}
    if bad:
        raise ValueError(f"reduce_custom: reductions must be one of {_REDUCTIONS} or None, got {bad}")
    return _reduce(tensors, dict(reduce_fn), _context(ctx))


def _reduce(tensors: dict[str, torch.Tensor], how: dict[str, Optional[str]], ctx: DistributedContext):
    # packed in sorted key order: ranks may build their dicts in different orders
    todo = sorted((k for k in tensors if how[k] is not None), key=str)
    out = {k: t for k, t in tensors.items() if how[k] is None}
    if not todo:
        return {k: out[k] for k in tensors}
    device = _comm_device(tensors[k] for k in todo)
    fp = _fingerprint([(k, tuple(tensors[k].shape), how[k]) for k in todo])
    parts: dict[str, list[torch.Tensor]] = {"sum": [], "max": []}
    for k in todo:
        x = tensors[k].to(device=device, dtype=torch.float64).reshape(-1)
        parts[_KIND[how[k]]].append(-x if how[k] == "min" else x)
    # header: [fp, fp^2, 1] in a SUM buffer (all equal <=> sum = c*fp and sum of squares = c*fp^2
    # with c the summed ones: the number of contributions, whatever the backend does),
    # [fp, -fp] in a MAX buffer (all equal <=> max = fp and max(-fp) = -fp); one header per call.
    head_kind = "sum" if parts["sum"] else "max"
    head_vals = [fp, fp * fp, 1.0] if head_kind == "sum" else [fp, -fp]
    head = torch.tensor(head_vals, dtype=torch.float64, device=device)
    bufs = {kind: torch.cat(([head] if kind == head_kind else []) + p) for kind, p in parts.items() if p}
    handles = [ctx.all_reduce(buf, kind) for kind, buf in bufs.items()]
    for h in handles:
        h.wait()
    n = ctx.world_size
    got = bufs[head_kind][: len(head_vals)].tolist()
    ok = (got[0] == got[2] * fp and got[1] == got[2] * fp * fp) if head_kind == "sum" else got == head_vals
    if not ok:
        raise ValueError(
            f"d9d_kernels.functional: ranks {fmt_ranks(ctx.ranks)} passed different keys, shapes or reductions "
            f"(this rank: {[(k, tuple(tensors[k].shape), how[k]) for k in todo][:20]})"
        )
    offsets = {"sum": 0, "max": 0}
    offsets[head_kind] = len(head_vals)
    for k in todo:
        t = tensors[k]
        kind = _KIND[how[k]]
        o = offsets[kind]
        v = bufs[kind][o : o + t.numel()].view(t.shape)
        offsets[kind] = o + t.numel()
        if how[k] == "min":
            v = -v
        elif how[k] == "mean":
            v = v / n
        out[k] = v.to(device=t.device, dtype=_result_dtype(t.dtype, how[k]))
    return {k: out[k] for k in tensors}


def _reduce_all(fn: str, name: str, metrics, ctx):
    tensors = _tensors(fn, metrics)
    return _reduce(tensors, {k: name for k in tensors}, _context(ctx))


def reduce_mean(metrics: Mapping[str, torch.Tensor], ctx: Optional[DistributedContext] = None) -> dict:
    """Elementwise mean across ranks of every value (one SUM all-reduce, divided by the world size).

    The unweighted mean of the per-rank values; weight by sample count yourself
    (``reduce_sum`` of value*count and count) when ranks saw different counts.
    """
    return _reduce_all("reduce_mean", "mean", metrics, ctx)


def reduce_sum(metrics: Mapping[str, torch.Tensor], ctx: Optional[DistributedContext] = None) -> dict:
    """Elementwise sum across ranks of every value (one SUM all-reduce)."""
    return _reduce_all("reduce_sum", "sum", metrics, ctx)


def reduce_max(metrics: Mapping[str, torch.Tensor], ctx: Optional[DistributedContext] = None) -> dict:
    """Elementwise maximum across ranks of every value (one MAX all-reduce)."""
    return _reduce_all("reduce_max", "max", metrics, ctx)


def reduce_min(metrics: Mapping[str, torch.Tensor], ctx: Optional[DistributedContext] = None) -> dict:
    """Elementwise minimum across ranks of every value (one MAX all-reduce of the negation)."""
    return _reduce_all("reduce_min", "min", metrics, ctx)


def all_gather(metrics: Mapping[str, torch.Tensor], ctx: Optional[DistributedContext] = None) -> dict:
    """Gather every value from every rank of ``ctx``.

    Returns, per key, the concatenation along dim 0 of the ranks' tensors in
    group-rank order: shape ``[sum_r n_r, *trailing]`` where rank r passed
    ``[n_r, *trailing]``. First dims may differ per rank (0 allowed);
    trailing shapes and dtypes must match (ValueError on every rank naming the
    key and ranks otherwise). 0-d values are gathered into shape
    ``[world_size]``. Values are moved as raw bytes: exact for every dtype.

    Two collectives whatever the number of keys: one gather of the per-rank
    first dims (and a layout fingerprint), one gather of all the data packed
    into a single byte buffer padded to the largest rank's size.
    """
    tensors = _tensors("all_gather", metrics)
    ctx = _context(ctx)
    keys = sorted(tensors, key=str)  # packing order: independent of each rank's dict order
    if not keys:
        return {}
    device = _comm_device(tensors.values())
    flat = {k: (t.reshape(1) if t.dim() == 0 else t) for k, t in tensors.items()}
    n = ctx.world_size
    # 1) metadata: [key-set fingerprint] + per key [first dim, fingerprint of (dtype, trailing shape)]
    meta_local = [zlib.crc32(repr(keys).encode())]
    for k in keys:
        t = tensors[k]
        meta_local += [flat[k].shape[0], zlib.crc32(repr((str(t.dtype), t.dim(), tuple(t.shape[1:]))).encode())]
    meta_in = torch.tensor(meta_local, dtype=torch.int64, device=device)
    meta = torch.empty(n * meta_in.numel(), dtype=torch.int64, device=device)
    ctx.all_gather_into_tensor(meta, meta_in).wait()
    meta = meta.view(n, -1).tolist()
    ranks = ctx.ranks
    if any(m[0] != meta_local[0] for m in meta):
        raise ValueError(f"all_gather: ranks {ranks} passed different keys (this rank: {keys[:20]})")
    for i, k in enumerate(keys):
        bad = [ranks[r] for r in range(n) if meta[r][2 + 2 * i] != meta_local[2 + 2 * i]]
        if bad:
            raise ValueError(
                f"all_gather: metrics[{k!r}] has a different dtype or trailing shape on ranks {bad} "
                f"than on rank {ranks[ctx.rank]} ({tensors[k].dtype}, {tuple(tensors[k].shape[1:])})"
            )
    # 2) data: every key's bytes, each segment aligned to _ALIGN bytes
    row_bytes = {k: _row_numel(t) * t.element_size() for k, t in tensors.items()}

    def seg_bytes(k, rows):
        return -(-rows * row_bytes[k] // _ALIGN) * _ALIGN

    sizes = [sum(seg_bytes(k, meta[r][1 + 2 * i]) for i, k in enumerate(keys)) for r in range(n)]
    width = max(max(sizes), _ALIGN)
    packed = torch.zeros(width, dtype=torch.uint8, device=device)
    off = 0
    for k in keys:
        b = flat[k].contiguous().reshape(-1).view(torch.uint8)
        packed[off : off + b.numel()] = b.to(device)
        off += seg_bytes(k, flat[k].shape[0])
    gathered = torch.empty(n * width, dtype=torch.uint8, device=device)
    ctx.all_gather_into_tensor(gathered, packed).wait()
    gathered = gathered.view(n, width)
    out = {k: [] for k in keys}
    for r in range(n):
        off = 0
        for i, k in enumerate(keys):
            t = flat[k]
            rows = meta[r][1 + 2 * i]
            seg = gathered[r, off : off + rows * row_bytes[k]]
            out[k].append(seg.view(t.dtype).view(rows, *t.shape[1:]))
            off += seg_bytes(k, rows)
    return {k: torch.cat(out[k]).to(tensors[k].device) for k in tensors}


def _row_numel(t: torch.Tensor) -> int:
    """Elements per row along dim 0 (1 for a 0-d tensor)."""
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def collect_from_devices(metrics: Mapping[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Split a leading device axis into per-device lists.

    ``{"loss": t}`` with ``t`` of shape ``[D, ...]`` (one entry per local
    device, e.g. stacked per-device results) becomes ``{"loss": [t[0], ...,
    t[D-1]]}``. A list/tuple of per-device tensors is returned as a list.
    No communication.
    """
    if not isinstance(metrics, Mapping):
        raise TypeError(f"collect_from_devices: metrics must be a dict, got {type(metrics).__name__}")
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (list, tuple)):
            out[k] = list(v)
        elif isinstance(v, torch.Tensor):
            if v.dim() == 0:
                raise ValueError(f"collect_from_devices: metrics[{k!r}] is 0-d; it needs a leading device axis")
            out[k] = list(v.unbind(0))
        else:
            raise TypeError(
                f"collect_from_devices: metrics[{k!r}] must be a tensor with a leading device axis, "
                f"got {type(v).__name__}"
            )
    return out
