"""The sync protocol: one coalesced async all_reduce per storage.

``trigger`` copies the local buffers into a snapshot buffer (two, used in
turn, allocated once) and launches ONE async ``all_reduce`` ("sum") of the
SUM buffer; a small MAX buffer (x world size <= ``FOLD_MAX_ELEMS``) rides in
it, one row per rank, and is maxed locally after the wait; a larger one gets
its own "max" all_reduce (at most one collective per kind; REPLICA is never
reduced). Local state keeps accumulating (cumulative: a sync is the sum over
ranks of each rank's state since ``reset``, so nothing is counted twice).
``wait`` waits; ``compute`` then uses the synced snapshot until the next
update (a host-side flag, no device sync). The first sync on a (storage,
context) pair checks that every rank holds the same schema and aligns
REPLICA slots such as moment pivots (``handshake``); see docs/metrics_core.md.
"""

from __future__ import annotations

import json

import torch

from d9d_kernels.core.statistic import MAX, REPLICA, SUM
from d9d_kernels.core.storage import Storage

__all__ = ["trigger", "wait", "handshake", "resolve_ctx", "rank_world", "FOLD_MAX_ELEMS"]

#: MAX state x world size (elements) up to which a sync folds the MAX buffer
#: into the one "sum" all_reduce (one row per rank) instead of a second
#: collective: 8192 doubles = 64 KiB extra.
FOLD_MAX_ELEMS = 8192


class Pending:
    __slots__ = ("handles", "snapshot", "folded", "discard")

    def __init__(self, handles, snapshot, folded=None):
        self.handles = handles
        self.snapshot = snapshot
        self.folded = folded  # folded() views when MAX rode in the sum
        self.discard = False


def trigger(st: Storage, ctx) -> None:
    """Snapshots ``st``'s local state and launches the async collective(s)."""
    if st.pending is not None:
        raise RuntimeError(f"{st.label}: trigger_sync() called twice without wait_sync()")
    ctx = resolve_ctx(ctx)
    if ctx is not None:
        handshake(st, ctx)
    i = st.next_snap
    st.next_snap = 1 - i
    snapshot = st.snaps[i]
    # Launch first, copy the rest after: every op between the ranks'
    # arrival and the launch delays all of them (bench_sync, world 2: the
    # ops before the launch took 40-60 us right after a barrier).
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
    st.pending = Pending(handles, i, fold)


def _world_rank(st: Storage, ctx) -> tuple[int, int]:
    """(world size, rank) of ``ctx``'s group, asked once per group."""
    key = ctx.cache_key
    wr = st.world_ranks.get(key)
    if wr is None:
        wr = st.world_ranks[key] = (ctx.world_size, ctx.rank)
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
    views = st.fold_bufs.get(key)
    if views is None:
        n_sum, n_max = st.layout.sizes[SUM], st.layout.sizes[MAX]
        buf = torch.zeros(n_sum + world * n_max, dtype=torch.float64, device=st.device)
        rows = buf[n_sum:].view(world, n_max)
        views = st.fold_bufs[key] = [buf, buf[:n_sum], rows, rows[rank], True]
    return views


def wait(st: Storage) -> None:
    """Waits for the collectives of the last ``trigger`` and publishes the snapshot."""
    p = st.pending
    if p is None:
        raise RuntimeError(f"{st.label}: wait_sync() without a pending trigger_sync()")
    st.pending = None
    for h in p.handles:
        h.wait()
    f = p.folded
    if p.discard:  # reset() between trigger and wait: the result is stale
        if f is not None:
            f[2].zero_()
            f[4] = True
        return
    snapshot = st.snaps[p.snapshot]
    if f is not None:
        snapshot[SUM].copy_(f[1])
        torch.amax(f[2], dim=0, out=snapshot[MAX])
        f[2].zero_()
        f[4] = True
    st.synced = snapshot
    st.synced_views = st.snap_views[p.snapshot]
    st.dirty = False


def handshake(st: Storage, ctx) -> None:
    """First sync of ``st`` on ``ctx``: same schema on every rank, REPLICA slots aligned."""
    key = ctx.cache_key
    state = st.handshakes.get(key)
    if state == "done":
        return
    if state is None:
        # the full schema text (not a hash) so the error shows the first difference
        ctx.check_same(
            "d9d_kernels.metric.schema",
            st.layout.schema,
            f"metric schema of {st.label} (members, order, statistics, slot shapes)",
        )
    settled = True
    rep_idx = [j for j in range(len(st.layout.stats)) if st.layout.has_replica(j)]
    if rep_idx:
        # host read of the (small) REPLICA buffer: handshake only, not per step
        mine = json.dumps(st.local[REPLICA].tolist())
        reps = [json.loads(r) for r in ctx.exchange("d9d_kernels.metric.replica", mine)]
        bufs = [{REPLICA: torch.tensor(r, dtype=torch.float64, device=st.device)} for r in reps]
        for j in rep_idx:
            stat = st.layout.stats[j]
            chosen = stat.choose_replica([st.layout.views(b, j, (REPLICA,)) for b in bufs])
            stat.adopt_replica(st.local_views[j], chosen)
            settled = settled and stat.replica_settled(chosen)
    st.handshakes[key] = "done" if settled else "schema"


_world_ctx: list = [None, None]  # (world ProcessGroup, its DistributedContext)


def resolve_ctx(ctx):
    """None = the world group when torch.distributed is initialised, else local."""
    if ctx is None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.group.WORLD
        if _world_ctx[0] is not world:  # one context per world group (re-initialised: a new one)
            from d9d_kernels.distributed import DistributedContext

            _world_ctx[:] = world, DistributedContext()
        ctx = _world_ctx[1]
    if ctx.is_local:
        return None
    return ctx


def rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
