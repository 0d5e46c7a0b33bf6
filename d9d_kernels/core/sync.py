"""The sync protocol: one coalesced async all_reduce per storage.

``trigger`` copies the local buffers into a snapshot (two, used in turn)
and launches ONE async "sum" ``all_reduce`` of the SUM buffer, a small MAX
buffer riding in it (one row per rank, maxed after the wait; a large one
gets its own "max" collective; REPLICA is never reduced). ``wait`` waits
and publishes the snapshot, which ``compute`` reads until the next update.
The first sync on a (storage, context) pair checks that every rank holds
the same schema and aligns REPLICA slots such as moment pivots
(``handshake``: one fixed-shape collective). docs/metrics_core.md §3 and
docs/distributed.md have the details.
"""

from __future__ import annotations

import json

import torch

from math import prod as numel
from typing import TYPE_CHECKING

from d9d_kernels.core.statistic import MAX, REPLICA, SUM

if TYPE_CHECKING:
    from d9d_kernels.core.storage import Storage

__all__ = ["SyncState", "trigger", "wait", "handshake", "resolve_ctx", "record_duplicate", "rank_world", "FOLD_MAX_ELEMS", "HANDSHAKE_PAYLOAD"]

#: MAX state x world size (elements) up to which a sync folds the MAX buffer
#: into the one "sum" all_reduce (one row per rank) instead of a second
#: collective: 8192 doubles = 64 KiB extra.
FOLD_MAX_ELEMS = 8192


class SyncState:
    """A storage's sync bookkeeping: the snapshot the next trigger fills (two,
    used in turn: a sync fills one while compute() may still read the
    other), the folded buffers per (snapshot, world, rank), (world size,
    rank) per context, the sync in flight and each context's handshake
    ("schema": checked, pivots not settled yet; "done")."""

    def __init__(self, handshakes: dict | None = None):
        self.next_snap = 0
        self.fold_bufs: dict[tuple[int, int, int], list] = {}
        self.world_ranks: dict[tuple, tuple[int, int]] = {}
        self.pending: Pending | None = None
        self.handshakes: dict[tuple, str] = {} if handshakes is None else handshakes


class Pending:
    __slots__ = ("handles", "snapshot", "folded", "discard")

    def __init__(self, handles, snapshot, folded=None):
        self.handles = handles
        self.snapshot = snapshot
        self.folded = folded  # folded() views when MAX rode in the sum
        self.discard = False


def trigger(st: Storage, ctx) -> None:
    """Snapshots ``st``'s local state and launches the async collective(s)."""
    if st.sync.pending is not None:
        raise RuntimeError(f"{st.label}: trigger_sync() called twice without wait_sync()")
    ctx = resolve_ctx(st, ctx)
    if ctx is not None:
        handshake(st, ctx)
    i = st.sync.next_snap
    st.sync.next_snap = 1 - i
    snapshot = st.snapshots[i][0]
    # Launch first, copy the rest after: every op between the ranks'
    # arrival and the launch delays all of them (bench_sync, world 2: ops
    # right after a barrier run several times slower than in a hot loop).
    handles, fold, done = [], None, ()
    if ctx is not None:
        n_max = st.layout.sizes[MAX]
        world, rank = _world_rank(st, ctx) if n_max else (1, 0)
        if n_max and n_max * world <= FOLD_MAX_ELEMS:
            fold = folded(st, i, world, rank)
            buf, sums, rows, mine, clean = fold
            if not clean:  # normally zeroed by the last wait, after its collective
                rows.zero_()
            fold[4] = False
            sums.copy_(st.local[SUM])
            mine.copy_(st.local[MAX])
            handles.append(ctx.all_reduce(buf, "sum"))  # SUM, MAX filled from it at wait
        else:
            for kind, op in ((SUM, "sum"), (MAX, "max")):
                if snapshot[kind].numel():
                    snapshot[kind].copy_(st.local[kind])
                    handles.append(ctx.all_reduce(snapshot[kind], op))
        done = (SUM, MAX)
    for k, v in st.local.items():
        if k not in done:
            snapshot[k].copy_(v)
    st.sync.pending = Pending(handles, i, fold)


def _world_rank(st: Storage, ctx) -> tuple[int, int]:
    """(world size, rank) of ``ctx``'s group, asked once per group."""
    key = ctx.cache_key
    wr = st.sync.world_ranks.get(key)
    if wr is None:
        wr = st.sync.world_ranks[key] = (ctx.world_size, ctx.rank)
    return wr


def folded(st: Storage, i: int, world: int, rank: int) -> list:
    """``[buf, its SUM part, its [world, MAX] rows, this rank's row, rows are zero]``.

    ``buf = [SUM | world x MAX]`` goes through ONE "sum" all_reduce with
    this rank's MAX values in its own row and zeros in the others (x + 0
    is exact, NaN and +-inf included), so the reduced rows hold every
    rank's MAX values. A second gloo collective cost ~0.2 ms at world 2
    and ~4 ms at world 4 here (bench/analysis.md), far more than these
    extra bytes. Allocated once per (snapshot, world, rank); the rows are
    zeroed after each wait (one op less before the launch)."""
    key = (i, world, rank)
    views = st.sync.fold_bufs.get(key)
    if views is None:
        n_sum, n_max = st.layout.sizes[SUM], st.layout.sizes[MAX]
        buf = torch.zeros(n_sum + world * n_max, dtype=torch.float64, device=st.device)
        rows = buf[n_sum:].view(world, n_max)
        views = st.sync.fold_bufs[key] = [buf, buf[:n_sum], rows, rows[rank], True]
    return views


def wait(st: Storage) -> None:
    """Waits for the collectives of the last ``trigger`` and publishes the snapshot."""
    p = st.sync.pending
    if p is None:
        raise RuntimeError(f"{st.label}: wait_sync() without a pending trigger_sync()")
    st.sync.pending = None
    for h in p.handles:
        h.wait()
    f = p.folded
    if p.discard:  # reset() between trigger and wait: the result is stale
        if f is not None:
            f[2].zero_()
            f[4] = True
        return
    snapshot = st.snapshots[p.snapshot][0]
    if f is not None:
        snapshot[SUM].copy_(f[1])
        torch.amax(f[2], dim=0, out=snapshot[MAX])
        f[2].zero_()
        f[4] = True
    st.synced = snapshot
    st.synced_views = st.snapshots[p.snapshot][1]
    st.dirty = False


def handshake(st: Storage, ctx) -> None:
    """First sync of ``st`` on ``ctx``: same schema on every rank, REPLICA slots aligned.

    ONE fixed-shape MAX all_reduce (``ctx.handshake``) checks the schema's
    64-bit fingerprint and carries rank 0's REPLICA values (``-inf`` from
    the other ranks, NaN sent as ``-inf``: REPLICA values are finite or NaN
    = unset; the first ``HANDSHAKE_PAYLOAD`` doubles, the rest in one more
    MAX). A statistic whose rank-0 replica is not settled (rank 0 saw no data
    yet) takes the lowest settled rank's instead: one MAX of ``-rank`` per
    such statistic, then one SUM carrying the chosen ranks' values. Nothing
    here touches the store or grows with the world size. Until every
    statistic is settled (no rank has data yet) the handshake repeats at the
    next sync.
    """
    from d9d_kernels.distributed import explain_members

    key = ctx.cache_key
    if st.sync.handshakes.get(key) == "done":
        return
    layout = st.layout
    rep_idx = [j for j in range(len(layout.stats)) if layout.has_replica(j)]
    n_rep = layout.sizes[REPLICA] if rep_idx else 0
    rank = ctx.rank
    head = min(n_rep, HANDSHAKE_PAYLOAD)
    # the same length on every rank whatever its schema: ranks that built
    # different groups must still issue the same collective
    payload = torch.full((HANDSHAKE_PAYLOAD,), _NONE, dtype=torch.float64, device=st.device)
    if rank == 0 and head:
        payload[:head].copy_(_send(st.local[REPLICA][:head]))
    got = ctx.handshake(
        layout.schema,
        f"metric schema of {st.label} (members, order, statistics, slot shapes)",
        payload=payload,
        detail=lambda: layout.detail,
        explain=explain_members,  # d9d_kernels.distributed: the details below, per member in words
    )
    if not rep_idx:
        st.sync.handshakes[key] = "done"
        return
    chosen = torch.empty(n_rep, dtype=torch.float64, device=st.device)
    chosen[:head].copy_(_received(got[:head]))
    if n_rep > head:  # the rest of rank 0's values
        rest = torch.full((n_rep - head,), _NONE, dtype=torch.float64, device=st.device)
        if rank == 0:
            rest.copy_(_send(st.local[REPLICA][head:]))
        ctx.all_reduce(rest, "max").wait()
        chosen[head:].copy_(_received(rest))
    buf = {REPLICA: chosen}
    # host reads of the (small) REPLICA buffers: handshake only, not per step
    open_idx = [j for j in rep_idx if not layout.stats[j].replica_settled(layout.views(buf, j, (REPLICA,)))]
    if open_idx:
        _lowest_settled(st, ctx, open_idx, chosen)
    settled = True
    for j in rep_idx:
        stat = layout.stats[j]
        mine = layout.views(buf, j, (REPLICA,))
        stat.adopt_replica(st.local_views[j], mine)
        settled = settled and stat.replica_settled(mine)
    st.sync.handshakes[key] = "done" if settled else "schema"


#: REPLICA doubles that ride in the handshake collective (2 KiB with its
#: 4-double header: latency-bound, as cheap as 8 bytes on any network).
HANDSHAKE_PAYLOAD = 252
_NONE = float("-inf")  # "no value" in a MAX: what ranks other than the sender contribute


def _send(v: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isnan(v), _NONE, v)


def _received(v: torch.Tensor) -> torch.Tensor:
    return torch.where(v == _NONE, float("nan"), v)


def _lowest_settled(st: Storage, ctx, open_idx: list[int], chosen: torch.Tensor) -> None:
    """Writes into ``chosen`` the REPLICA values of statistics ``open_idx``
    from the lowest rank whose own values are settled (untouched if none)."""
    layout, rank = st.layout, ctx.rank
    own = {REPLICA: st.local[REPLICA]}
    mine = [layout.stats[j].replica_settled(layout.views(own, j, (REPLICA,))) for j in open_idx]
    prio = torch.tensor([-float(rank) if s else float("-inf") for s in mine], dtype=torch.float64, device=st.device)
    ctx.all_reduce(prio, "max").wait()
    lowest = prio.tolist()
    if all(p == float("-inf") for p in lowest):
        return
    vals = torch.zeros_like(chosen)
    for j, p in zip(open_idx, lowest):
        if p == -float(rank):
            for s, o in layout.placed[j]:
                if s.kind == REPLICA:
                    n = numel(s.shape)
                    vals[o : o + n].copy_(st.local[REPLICA][o : o + n])
    ctx.all_reduce(vals, "sum").wait()
    for j, p in zip(open_idx, lowest):
        if p != float("-inf"):
            for s, o in layout.placed[j]:
                if s.kind == REPLICA:
                    n = numel(s.shape)
                    chosen[o : o + n].copy_(vals[o : o + n])


def member_detail(owners: list, layout) -> str:
    """JSON ``[[label, {field: text}], ...]`` of a layout's ``owners``
    (``(label, metric)``): the class, the public configuration attributes and
    each statistic's schema. Sent by one rank per schema variant when ranks disagree."""
    out = []
    for i, (label, m) in enumerate(owners):
        fields: dict[str, str] = {"class": type(m).__name__}
        for k, v in sorted(vars(m).items()):
            if not k.startswith("_") and _plain(v):
                fields[k] = repr(v)
        for name, j in sorted(layout.maps[i].items()):
            stat = layout.stats[j]
            slots = ", ".join(f"{s.name} {s.kind} {tuple(s.shape)}" for s, _ in layout.placed[j])
            fields[f"state {name}"] = f"{stat.schema()} [{slots}]"
        out.append([label, fields])
    return json.dumps(out)


def _plain(v) -> bool:
    if isinstance(v, (tuple, list)):
        return len(v) <= 16 and all(_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


def resolve_ctx(st: Storage, ctx):
    """The context ``st`` syncs on, or None when no communication is needed.

    ``ctx``: None (the world group when torch.distributed is initialised,
    else local), a DistributedContext, a ProcessGroup or a DeviceMesh (all
    its ranks); see ``d9d_kernels.distributed.as_context``. Records ``duplicate`` on ``st`` (checkpoints save it)."""
    from d9d_kernels.distributed import as_context

    ctx = as_context(ctx)
    record_duplicate(st, ctx)
    return None if ctx.is_local else ctx


def record_duplicate(st: Storage, ctx) -> None:
    """``st.duplicate = ctx.duplicate`` where the context knows it; None (no mesh) leaves the record."""
    if ctx.duplicate is not None:
        st.duplicate = ctx.duplicate


def rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
