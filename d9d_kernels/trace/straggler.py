"""Stragglers: per-rank step time, its spread, and who waits on whom at collectives.

Step time per rank = median ``ProfilerStep#N`` duration; spread = slowest - fastest
rank (ms and % of the median over ranks).

Collectives are matched across ranks by order: the k-th collective of process group
``pg`` on every rank is the same operation (collectives of one group are issued in
the same order on all its members). Per rank the collective events are NCCL/RCCL
kernels (GPU traces) or ``record_param_comms`` ops (CPU traces), see
``communication.collective_events``. A collective ends at (almost) the same moment on
every rank, so a rank that arrives early spends the difference waiting inside it:
the rank with the *shortest* duration arrived last and is the straggler of that
collective; every other rank waited ``its duration - shortest duration`` on it.
This needs no clock alignment between hosts. Volume/latency differences between
ranks are assumed small next to arrival skew.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from d9d_kernels.trace._common import open_steps, rank_key, resolve_mode
from d9d_kernels.trace._result import metric, result
from d9d_kernels.trace.communication import collective_events


def match_collectives(per_rank: dict) -> tuple[dict, dict, dict, int, list]:
    """``per_rank``: rank -> list of collective dicts (time order).

    Returns (wait_us[waiter][straggler], last_count[rank], wait_total[rank], matched, notes).
    """
    by_pg: dict = defaultdict(dict)
    for r, evs in per_rank.items():
        for pg in {e["pg"] for e in evs}:
            by_pg[pg][r] = [e for e in evs if e["pg"] == pg]
    waits: dict = defaultdict(lambda: defaultdict(float))
    last: dict = defaultdict(int)
    total: dict = defaultdict(float)
    matched = 0
    notes = []
    for pg, lists in sorted(by_pg.items()):
        if len(lists) < 2:
            continue
        counts = {r: len(v) for r, v in lists.items()}
        n = min(counts.values())
        if len(set(counts.values())) > 1:
            notes.append(f"process group {pg}: ranks have different collective counts {counts}; "
                         f"the first {n} are matched")
        ranks = sorted(lists)
        dur = np.array([[lists[r][k]["dur"] for k in range(n)] for r in ranks])  # ranks x n
        kinds = [[lists[r][k]["kind"] for r in ranks] for k in range(n)]
        bad = sum(len(set(k)) > 1 for k in kinds)
        if bad:
            notes.append(f"process group {pg}: {bad} matched collectives differ in type across ranks")
        if n == 0:
            continue
        matched += n
        slow = np.argmin(dur, axis=0)  # rank index arriving last, per collective
        wait = dur - dur[slow, np.arange(n)]
        for k in range(n):
            s = ranks[slow[k]]
            last[s] += 1
            for i, r in enumerate(ranks):
                if i != slow[k]:
                    waits[r][s] += float(wait[i, k])
                    total[r] += float(wait[i, k])
    return waits, last, total, matched, notes


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False) -> dict:
    """Per-rank step time, spread and collective wait attribution."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed)
    notes = list(wl.notes) + [steps_note]
    out = {}
    med = {}
    per_rank = {}
    for r, rt in ranks.items():
        nums, s, e = rt.steps
        if nums.size:
            med[r] = float(np.median(e - s)) / 1e3
        per_rank[r] = collective_events(rt, resolve_mode(rt, profile_mode))
    waits, last, total, matched, mnotes = match_collectives(per_rank)
    notes += mnotes
    if len(ranks) < 2:
        notes.append("one rank only: no cross-rank comparison possible")
    for r in ranks:
        out[rank_key(r)] = {
            "step_time_median": metric(med.get(r), "ms", "median ProfilerStep duration"),
            "collectives": metric(len(per_rank[r]), "count", "collectives on this rank"),
            "last_to_arrive": metric(last.get(r, 0), "count",
                                     "matched collectives where this rank arrived last (shortest duration)"),
            "wait_time": metric(total.get(r, 0.0), "us",
                                "time spent in collectives waiting for the last-arriving rank"),
            "waited_on": {rank_key(s): metric(v, "us", f"time rank {r} waited for rank {s}")
                          for s, v in sorted(waits.get(r, {}).items())},
        }
    summary = {"matched_collectives": metric(matched, "count",
                                             "collectives matched across ranks (by order per process group)")}
    if med:
        vals = np.array(list(med.values()))
        spread = float(vals.max() - vals.min())
        summary["step_time_spread"] = metric(spread, "ms", "slowest - fastest rank median step time")
        summary["step_time_spread_pct"] = metric(100.0 * spread / float(np.median(vals)), "%",
                                                 "step_time_spread / median over ranks")
        summary["slowest_rank"] = metric(int(max(med, key=med.get)), "rank", "rank with the largest median step time")
    if last:
        who = max(last, key=lambda r: (last[r], -total.get(r, 0.0)))
        summary["straggler_rank"] = metric(int(who), "rank", "rank that arrived last at the most collectives")
        caused = defaultdict(float)
        for w, d in waits.items():
            for s, v in d.items():
                caused[s] += v
        summary["wait_caused"] = {rank_key(s): metric(v, "us", f"total time other ranks waited for rank {s}")
                                  for s, v in sorted(caused.items())}
    return result("straggler", out, summary, notes, errors)
