"""Checkpointing metrics with ``torch.distributed.checkpoint`` (DCP).

``Metric.state_dict()`` holds this rank's LOCAL state under a rank-specific
key, because DCP de-duplicates plain tensors saved under the same key on
every rank::

    {"world_size": W, "schema": "<fingerprint>",
     "rank_<r>": {"sum": f64[...], "max": f64[...], "replica": f64[...]}}

Same world size: ``dcp.save({"metrics": g}, ...)`` / ``dcp.load({"metrics": g},
...)`` restores every rank's local state exactly (pivots included).

Different world size: states are additive, so the rank at position ``r`` of
the ``W'`` ranks the resumed metric syncs over loads the saved ranks ``s``
with ``s % W' == r`` (``ranks_for``) and sums them (MAX slots: max; moment
sums re-centred to one pivot first). With fewer new ranks some load several;
with more, some load none (they start empty). The global ``compute()``
after the next sync is the same as before saving. DCP builds its read plan
from ``state_dict()``, so wrap the metric::

    n = dk.checkpoint.saved_world_size(path, key="metrics")       # from DCP metadata
    dcp.load({"metrics": dk.checkpoint.for_resume(g, n, ctx=ctx)}, checkpoint_id=path)

Replicas (tensor parallelism): ranks that differ only along dims a metric
does not reduce over hold copies of the same data. An entry saved by a
rank whose last sync's context marks it a copy (``DistributedContext.
duplicate``: a context from ``from_mesh`` or a d9d context) is skipped, so
no datum counts twice. ``ctx`` is the context the resumed metric will sync
over (default: the world): its position and size pick the entries, so the
replicas of the new layout load the same ones.

``for_resume`` returns a Stateful whose ``state_dict()`` is the template
(``metric_state_template``) and whose ``load_state_dict`` merges into ``g``.
A checkpoint from a different group schema raises ``ValueError``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from d9d_kernels.core.metric import Metric
from d9d_kernels.core.statistic import KINDS
from d9d_kernels.core.storage import Layout, StateEntry
from d9d_kernels.core.sync import record_duplicate
from d9d_kernels.distributed import as_context

__all__ = ["ranks_for", "metric_state_template", "for_resume", "saved_world_size", "ResumeState", "checked_entries",
           "check_entry"]


def ranks_for(rank: int, world_size: int, saved_world_size: int) -> list[int]:
    """Saved ranks that new rank ``rank`` of ``world_size`` loads: ``s % world_size == rank``
    (stepped, not filtered: O(saved / new) per rank at any world size)."""
    return list(range(rank, saved_world_size, world_size))


def metric_state_template(
    metric: Metric, saved_world_size: int, rank: int | None = None, world_size: int | None = None, *, ctx=None
) -> dict[str, Any]:
    """The DCP load template of ``metric`` for a checkpoint saved on
    ``saved_world_size`` ranks: the entries of ``ranks_for(rank, world_size,
    saved_world_size)``; ``rank`` / ``world_size`` default to this rank's
    position in ``ctx`` (any ctx the library takes; None: the world) and its size."""
    c = as_context(ctx)
    rank = c.rank if rank is None else rank
    world_size = c.world_size if world_size is None else world_size
    st = metric._storage
    out: dict[str, Any] = {"world_size": int(saved_world_size), "schema": st.layout.fingerprint}
    for s in ranks_for(rank, world_size, saved_world_size):
        out[f"rank_{s}"] = st.template_entry()
    return out


class ResumeState:
    """Stateful adapter: loads a checkpoint saved on another world size into a metric."""

    def __init__(self, metric: Metric, saved_world_size: int, rank: int | None = None, world_size: int | None = None,
                 *, ctx=None):
        self.metric = metric
        self.saved_world_size = saved_world_size
        self.rank = rank
        self.world_size = world_size
        self.ctx = ctx

    def state_dict(self) -> dict[str, Any]:
        return metric_state_template(self.metric, self.saved_world_size, self.rank, self.world_size, ctx=self.ctx)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.metric.load_state_dict(state_dict, resharding=True)
        record_duplicate(self.metric._storage, as_context(self.ctx))  # as a sync over ctx would


def for_resume(
    metric: Metric, saved_world_size: int, rank: int | None = None, world_size: int | None = None, *, ctx=None
) -> ResumeState:
    """``dcp.load({"metrics": for_resume(g, n, ctx=ctx)}, ...)`` for a checkpoint
    saved on ``n`` ranks; ``ctx``: the context ``metric`` will sync over."""
    return ResumeState(metric, saved_world_size, rank, world_size, ctx=ctx)


def saved_world_size(checkpoint_id, key: str) -> int:
    """World size a metric saved under ``key`` was checkpointed with, read
    from the DCP metadata (``checkpoint_id``: a path or a ``StorageReader``)."""
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(checkpoint_id) if not hasattr(checkpoint_id, "read_metadata") else checkpoint_id
    meta = reader.read_metadata()
    pat = re.compile(re.escape(key) + r"\.rank_(\d+)(\.|$)")  # a rank entry is one object (StateEntry)
    ranks = [int(m.group(1)) for k in meta.state_dict_metadata for m in [pat.match(k)] if m]
    if not ranks:
        raise ValueError(f"no metric state saved under {key!r} in {checkpoint_id}")
    return max(ranks) + 1


def checked_entries(metric: Metric, state_dict, op: str) -> list:
    """The ``rank_<s>`` entries of ``state_dict`` in rank order, every key
    and entry checked (``ValueError`` naming the metric and the key)."""
    label = f"{metric._label}.{op}"
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"{label}: expected a state_dict (a mapping with 'world_size', 'schema' and "
                         f"'rank_<r>' entries), got {type(state_dict).__name__}")
    st = metric._storage
    ranks = {}
    for k, v in state_dict.items():
        if k == "world_size":
            if isinstance(v, bool) or not isinstance(v, (int, torch.Tensor)) or int(v) < 1:
                raise ValueError(f"{label}: state_dict['world_size'] must be a positive int, got {v!r}")
        elif k == "schema":
            if v != st.layout.fingerprint:
                raise ValueError(
                    f"{label}: checkpoint schema {v!r} does not match this metric's "
                    f"{st.layout.fingerprint} (different members, order or configuration)"
                )
        elif isinstance(k, str) and k.startswith("rank_") and k[5:].isdigit():
            check_entry(label, k, v, st.layout)
            ranks[int(k[5:])] = v
        else:
            raise ValueError(f"{label}: unexpected state_dict key {k!r} (expected 'world_size', 'schema' "
                             "and 'rank_<r>' with r a rank number)")
    return [ranks[r] for r in sorted(ranks)]


def check_entry(label: str, key: str, entry, layout: Layout) -> None:
    """Raises ``ValueError`` naming ``label`` and ``key`` unless ``entry`` is a
    state entry of ``layout``: a ``StateEntry`` (or mapping) holding exactly
    the non-empty kinds as real 1-d tensors of the layout's sizes."""
    want = {k: layout.sizes[k] for k in KINDS if layout.sizes[k]}
    expected = "a StateEntry of " + ", ".join(f"{k!r}: float64[{n}]" for k, n in want.items())
    if not isinstance(entry, StateEntry) and not isinstance(entry, Mapping):
        raise ValueError(f"{label}: state_dict[{key!r}] must be {expected}, got {type(entry).__name__}")
    keys = set(entry.keys())
    if keys != set(want):
        missing, extra = sorted(set(want) - keys), sorted(keys - set(want))
        raise ValueError(f"{label}: state_dict[{key!r}] must be {expected}; "
                         + "; ".join(x for x in (f"missing {missing}" if missing else "",
                                                 f"unexpected {extra}" if extra else "") if x))
    for k, n in want.items():
        v = entry[k]
        if not isinstance(v, torch.Tensor) or v.is_complex() or not (v.is_floating_point() or v.dtype == torch.int64) \
                or tuple(v.shape) != (n,):
            got = f"{v.dtype} {list(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"{label}: state_dict[{key!r}][{k!r}] must be a float64 tensor of shape [{n}], got {got}")
