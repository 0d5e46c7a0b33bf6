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
REPLICA slots such as moment pivots (``handshake``: one fixed-shape
collective, no store operation, nothing that grows with the world size);
``ctx`` may be a DistributedContext, a ProcessGroup, a DeviceMesh or None
(``resolve_ctx``). See docs/metrics_core.md and docs/distributed.md.
"""

from __future__ import annotations

import json

import torch

from d9d_kernels.core.statistic import MAX, REPLICA, SUM
from d9d_kernels.core.storage import Storage, numel

__all__ = ["trigger", "wait", "handshake", "resolve_ctx", "rank_world", "FOLD_MAX_ELEMS", "HANDSHAKE_PAYLOAD"]

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
    key = ctx.cache_key
    if st.handshakes.get(key) == "done":
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
        detail=lambda: member_detail(layout),
        explain=explain_members,
    )
    if not rep_idx:
        st.handshakes[key] = "done"
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
    st.handshakes[key] = "done" if settled else "schema"


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


def member_detail(layout) -> str:
    """JSON ``[[label, {field: text}], ...]`` of a storage's members: the
    class, the public configuration attributes and each statistic's schema.
    Sent by one rank per schema variant when ranks disagree."""
    out = []
    for i, (label, ref) in enumerate(getattr(layout, "owners", ())):
        m = ref()
        fields: dict[str, str] = {"class": type(m).__name__ if m is not None else "?"}
        if m is not None:
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


def explain_members(variants: list) -> str:
    """Per member, in words: "MetricGroup['acc']: num_classes 5 on ranks [0]
    vs 6 on ranks [1]" (configuration first; the state only when the
    configuration does not differ)."""
    from d9d_kernels.distributed import fmt_ranks

    parsed = []
    for ranks, text in variants:
        try:
            parsed.append((ranks, dict(json.loads(text)), [label for label, _ in json.loads(text)]))
        except ValueError:  # truncated detail: show the raw text
            return " vs ".join(f"ranks {fmt_ranks(r)}: {t[:300]!r}" for r, t in variants)
    lines = []
    labels = list(dict.fromkeys(label for _, _, order in parsed for label in order))
    for label in labels:
        having = [(ranks, members[label]) for ranks, members, _ in parsed if label in members]
        missing = [ranks for ranks, members, _ in parsed if label not in members]
        if missing:
            cls = having[0][1].get("class", "?")
            lines.append(
                f"{label} ({cls}) on ranks {fmt_ranks(_cat(r for r, _ in having))}, "
                f"missing on ranks {fmt_ranks(_cat(missing))}"
            )
            continue
        diffs = _field_diffs(having, lambda k: not k.startswith("state "))
        diffs = diffs or _field_diffs(having, lambda k: k.startswith("state "))
        lines.extend(f"{label}: {d}" for d in diffs)
    orders = [order for _, _, order in parsed]
    if not lines and len({tuple(o) for o in orders}) > 1:
        lines.append("member order " + " vs ".join(f"{o} on ranks {fmt_ranks(r)}" for o, (r, _, _) in zip(orders, parsed)))
    if not lines:
        lines.append("members agree but their merged statistics differ: " + " vs ".join(
            f"ranks {fmt_ranks(r)}: {t[:200]!r}" for r, t in variants))
    more = f"; ... ({len(lines) - 12} more)" if len(lines) > 12 else ""
    return "; ".join(lines[:12]) + more


def _cat(lists) -> list[int]:
    return sorted(r for rs in lists for r in rs)


def _field_diffs(having: list, pick) -> list[str]:
    """"field a on ranks [..] vs b on ranks [..]" for every field that differs."""
    from d9d_kernels.distributed import fmt_ranks

    keys = list(dict.fromkeys(k for _, f in having for k in f if pick(k)))
    out = []
    for k in keys:
        by_value: dict[str, list[int]] = {}
        for ranks, f in having:
            by_value.setdefault(f.get(k, "(unset)"), []).extend(ranks)
        if len(by_value) > 1:
            out.append(f"{k} " + " vs ".join(f"{v} on ranks {fmt_ranks(sorted(r))}" for v, r in by_value.items()))
    return out


def resolve_ctx(ctx):
    """The context to sync on, or None when no communication is needed.

    ``ctx``: None (the world group when torch.distributed is initialised,
    else local), a DistributedContext, a ProcessGroup or a DeviceMesh (all
    its ranks); see ``d9d_kernels.distributed.as_context``."""
    from d9d_kernels.distributed import as_context

    ctx = as_context(ctx)
    if ctx.is_local:
        return None
    return ctx


def rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
