"""The sync protocol: one coalesced async all_reduce per storage.

``trigger`` snapshots the local buffers and launches ONE async "sum"
``all_reduce`` (a small MAX buffer rides in it, one row per rank); ``wait``
publishes the snapshot. The first sync per context checks every rank's
schema and configuration (``handshake``). Pivoted sums are re-expressed
about the context's reference (the centre of the last synced values, which
every rank holds alike) before the sum; when the synced values show it was
off-centre, every rank runs one corrective all_reduce. So a sync's
collectives depend only on the layout and values every rank shares, and
its result not on the world size or what came before a reset
(docs/metrics_core.md §3).
"""

from __future__ import annotations

import torch

from math import prod as numel
from typing import TYPE_CHECKING

from d9d_kernels.core.statistic import KINDS, MAX, REPLICA, SUM
from d9d_kernels.ops.moments_pivot import moments_center, moments_recenter
from d9d_kernels.reference import MOMENTS_SIZE

if TYPE_CHECKING:
    from d9d_kernels.core.storage import Storage

__all__ = ["SyncState", "trigger", "wait", "handshake", "resolve_ctx", "record_duplicate", "rank_world", "FOLD_MAX_ELEMS"]

#: MAX state x world size (elements) up to which a sync folds the MAX buffer
#: into the one "sum" all_reduce (one row per rank) instead of a second
#: collective: 8192 doubles = 64 KiB extra.
FOLD_MAX_ELEMS = 8192

#: ulps lost to an off-centre pivot above which a sync re-sums pivoted moments about their mean
OFF_CENTER = 1e3


class SyncState:
    """A storage's sync bookkeeping: the snapshot the next trigger fills (two,
    used in turn: a sync fills one while compute() may still read the
    other), the folded buffers per (snapshot, world, rank), (world size,
    rank) per context, the sync in flight, the contexts whose schema was
    checked (``handshakes``) and each context's ``references`` (a
    REPLICA-sized buffer: what pivoted sums are re-expressed about before
    they are summed; NaN = none yet). Handshakes and references derive only
    from what every rank of the context shares."""

    def __init__(self, handshakes: set | None = None, references: dict | None = None):
        self.next_snap = 0
        self.fold_bufs: dict[tuple[int, int, int], list] = {}
        self.world_ranks: dict[tuple, tuple[int, int]] = {}
        self.pending: Pending | None = None
        self.handshakes: set = set() if handshakes is None else handshakes
        self.references: dict[tuple, torch.Tensor] = {} if references is None else references
        self.table: tuple | None = None  # sync.table: every pivot pair, addressed in the flat buffers
        self.off: torch.Tensor | None = None  # _settle's off-centre flag, False between syncs

    def copied(self, device: torch.device) -> "SyncState":  # what outlives a move or a clone
        return SyncState(set(self.handshakes), {k: v.to(device, copy=True) for k, v in self.references.items()})


class Pending:
    __slots__ = ("handles", "snapshot", "folded", "discard", "ctx", "local", "cleared")

    def __init__(self, handles, snapshot, folded=None, ctx=None, local=None):
        self.handles = handles
        self.snapshot = snapshot
        self.folded = folded  # folded() views when MAX rode in the sum
        self.discard = False  # the whole storage was reset or replaced: publish nothing
        self.ctx = ctx
        self.local = local  # (the table's local moment sums, the local pivots), for a corrective round
        self.cleared: set[int] = set()  # statistics reset (a member's reset) while in flight


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
    handles, fold, done, local = [], None, (), None
    if ctx is not None:
        n_max = st.layout.sizes[MAX]
        world, rank = _world_rank(st, ctx) if n_max else (1, 0)
        fold = folded(st, i, world, rank) if n_max and n_max * world <= FOLD_MAX_ELEMS else None
        sums = snapshot[SUM] if fold is None else fold[1]
        sums.copy_(st.local[SUM])
        moved = _to_reference(st, ctx, sums, snapshot[REPLICA])
        if fold is not None:
            buf, _, rows, mine, clean = fold
            if not clean:  # normally zeroed by the last wait, after its collective
                rows.zero_()
            fold[4] = False
            mine.copy_(st.local[MAX])
            handles.append(ctx.all_reduce(buf, "sum"))  # SUM, MAX filled from it at wait
        else:
            if sums.numel():
                handles.append(ctx.all_reduce(sums, "sum"))
            if n_max:
                snapshot[MAX].copy_(st.local[MAX])
                handles.append(ctx.all_reduce(snapshot[MAX], "max"))
        done = KINDS if moved else (SUM, MAX)
        # the pivoted statistics' local values for a corrective round (unchanged until the next update)
        local = (st.local[SUM][table(st)[1]], st.local[REPLICA].clone()) if moved else None
    for k, v in st.local.items():
        if k not in done:
            snapshot[k].copy_(v)
    st.sync.pending = Pending(handles, i, fold, ctx, local)


def table(st: Storage) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table, index)`` on ``st.device``, made once per storage and device:
    every pivot pair of ``st``'s statistics (``Statistic.pivots``), one int64
    row per moment vector (its offset in the SUM buffer, its pivot's in the
    REPLICA buffer, whether y is data), and the flat SUM indices of those
    vectors in that order."""
    if st.sync.table is None:
        rows = []
        for j in st.layout.pivoted:
            at = {s.name: (o, s) for s, o in st.layout.placed[j]}
            for m, p, paired in st.layout.stats[j].pivots():
                (mo, _), (po, ps) = at[m], at[p]
                rows += [(mo + MOMENTS_SIZE * e, po + 2 * e, int(paired)) for e in range(numel(ps.shape) // 2)]
        tab = torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
        index = (tab[:, :1] + torch.arange(MOMENTS_SIZE)).reshape(-1)
        st.sync.table = (tab.to(st.device), index.to(st.device))
    return st.sync.table


def _to_reference(st: Storage, ctx, sums: torch.Tensor, rep: torch.Tensor) -> bool:
    """Re-expresses the pivoted sums in ``sums`` (about to be summed) about ``ctx``'s reference, which
    ``rep`` then holds; False when ``st`` has no pivoted statistic."""
    if not st.layout.pivoted:
        return False
    rep.copy_(st.local[REPLICA])
    moments_recenter(sums, rep, reference(st, ctx), table(st)[0])
    return True


def reference(st: Storage, ctx) -> torch.Tensor:
    """``ctx``'s reference buffer of ``st`` (REPLICA-sized; NaN until a sync set it)."""
    ref = st.sync.references.get(ctx.cache_key)
    if ref is None:
        ref = st.sync.references[ctx.cache_key] = torch.full_like(st.init[REPLICA], float("nan"))
    return ref


def _settle(st: Storage, p: Pending, snapshot: dict) -> None:
    """After the sum: the reference moves to the synced values' centre (it
    stays where an interval had no data); when any pivoted statistic's synced
    sums are off-centre, the corrective round: the local sums about the new
    reference, summed again. Every rank reads the same synced values, so
    every rank decides alike."""
    ref, (tab, index) = reference(st, p.ctx), table(st)
    off = st.sync.off = torch.zeros(1, dtype=torch.bool, device=st.device) if st.sync.off is None else st.sync.off
    moments_center(snapshot[SUM], snapshot[REPLICA], tab, OFF_CENTER, ref, off)
    if bool(off):  # a host read of values every rank holds: every rank decides alike
        off.zero_()  # (kept False between syncs: no zeroing in a steady one)
        sums, pivots = p.local
        packed = tab.clone()  # the local sums sit one after another
        packed[:, 0] = MOMENTS_SIZE * torch.arange(len(tab), device=st.device)
        moments_recenter(sums, pivots, ref, packed)
        p.ctx.all_reduce(sums, "sum").wait()
        snapshot[SUM][index] = sums
        snapshot[REPLICA].copy_(pivots)


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
    rank's MAX values. A second gloo collective costs far more than these
    extra bytes (bench/analysis.md). Allocated once per (snapshot, world,
    rank); the rows are zeroed after each wait (one op less before the launch)."""
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
    snapshot, views = st.snapshots[p.snapshot]
    if f is not None:
        snapshot[SUM].copy_(f[1])
        torch.amax(f[2], dim=0, out=snapshot[MAX])
        f[2].zero_()
        f[4] = True
    if p.local is not None:  # every rank takes part, whatever this rank did in between
        _settle(st, p, snapshot)
    if p.discard:  # reset() or a load between trigger and wait: the result is stale
        return
    for j in p.cleared:  # a member's reset between trigger and wait: its part is stale
        st.fill(views[j], j)
    st.synced = snapshot
    st.synced_views = views
    st.dirty = False


def handshake(st: Storage, ctx) -> None:
    """First sync of ``st`` on ``ctx``: the same schema and configuration on every rank.

    ONE fixed-shape MAX all_reduce (``ctx.handshake``) compares a hash of
    ``layout.sync_schema`` (the state schema and every member's
    configuration, formula-only settings included); on a mismatch every
    rank raises ``ValueError`` naming the differing members. Nothing here
    touches the store or grows with the world size.
    """
    from d9d_kernels.distributed import explain_members

    key = ctx.cache_key
    if key in st.sync.handshakes:
        return
    layout = st.layout
    ctx.handshake(
        layout.sync_schema,
        f"metric schema of {st.label} (members, order, configuration, statistics, slot shapes)",
        device=st.device,
        detail=lambda: layout.detail,
        explain=explain_members,  # d9d_kernels.distributed: the details below, per member in words
    )
    st.sync.handshakes.add(key)


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
