"""Frequent CUDA kernel sequences (HolisticTraceAnalysis's ``get_frequent_cuda_kernel_sequences``).

Per rank: the CPU call tree is rebuilt per thread (an event is a child of the
innermost event on the same pid/tid that contains it). Root operators are the CPU ops
whose name contains ``operator_name`` at the shallowest depth among them (so nested
matches are not counted twice), as HTA does; with ``operator_name=None`` (the CLI
default) they are the outermost ``cpu_op`` events (no ``cpu_op`` ancestor). A root's
kernel sequence is the GPU work (kernels, memcpy, memset) launched by runtime calls in
its subtree, in GPU start order; roots with fewer than ``min_pattern_len`` kernels are
skipped. A pattern is ``root name|kernel 1|kernel 2|...``; per pattern: count, summed GPU
duration of its kernels and summed CPU duration of its roots. Patterns are ranked by
count, then name (HTA's order); ``top_k`` are reported.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from d9d_kernels.trace._common import launch_rows, map_ranks, open_steps, rank_key, resolve_mode
from d9d_kernels.trace._load import KIND_CPU_OP
from d9d_kernels.trace._result import metric, result

TOOL = "sequences"


def _jump(parent: np.ndarray, stop: np.ndarray) -> np.ndarray:
    """Per row, the nearest row on its ancestor-or-self chain where ``stop`` holds (-1: none),
    by pointer doubling: O(n log depth) numpy work instead of a Python walk per row."""
    n = parent.size
    target = np.where(stop, np.arange(n), parent)
    while True:
        live = target >= 0
        up = live & ~stop[np.where(live, target, 0)]
        if not up.any():
            return target
        target = np.where(up, target[np.where(up, target, 0)], target)


def call_tree(rt) -> tuple[np.ndarray, np.ndarray]:
    """``(parent, depth)`` per row for non-GPU events (-1 / -1 for GPU rows and roots' parent).

    Per thread, in (start, longest first) order, an event's parent is the nearest earlier
    event that has not ended when it starts (what a stack of open events gives), found
    for every event at once by a binary descent over a sparse table of range-max ends."""
    n = len(rt)
    parent = np.full(n, -1, dtype=np.int64)
    depth = np.full(n, -1, dtype=np.int64)
    rows = np.flatnonzero(~rt.gpu_mask & (rt.stream < 0))
    m = rows.size
    if m == 0:
        return parent, depth
    order = rows[np.lexsort((-rt.dur[rows], rt.ts[rows], rt.tid[rows], rt.pid[rows]))]
    s = rt.ts[order]
    e = s + rt.dur[order]
    pid, tid = rt.pid[order], rt.tid[order]
    first = np.r_[True, (pid[1:] != pid[:-1]) | (tid[1:] != tid[:-1])]
    seg = np.maximum.accumulate(np.where(first, np.arange(m), 0))  # first position of the thread
    table = [e]
    w = 1
    while 2 * w <= m:
        table.append(np.maximum(table[-1][:-w], table[-1][w:]))  # max end over [i, i + 2w)
        w *= 2
    pos = np.arange(m)
    for lvl in range(len(table) - 1, -1, -1):  # skip blocks of the thread that ended by the start
        w = 1 << lvl
        cand = pos - w
        ok = cand >= seg
        ok &= table[lvl][np.where(ok, cand, 0)] <= s
        pos = np.where(ok, cand, pos)
    par = np.where(pos - 1 >= seg, pos - 1, -1)  # positions in ``order``
    # depth = number of ancestors, by pointer doubling
    d = (par >= 0).astype(np.int64)
    up = par.copy()
    while (up >= 0).any():
        live = up >= 0
        at = np.where(live, up, 0)
        d = d + np.where(live, d[at], 0)
        up = np.where(live, up[at], -1)
    parent[order] = np.where(par >= 0, order[np.where(par >= 0, par, 0)], -1)
    depth[order] = d
    return parent, depth


def rank_sequences(rt, operator_name=None, min_pattern_len: int = 3) -> dict:
    """``{pattern tuple: [count, gpu_us, cpu_us]}`` of one rank."""
    parent, depth = call_tree(rt)
    cpu_op = rt.kind == KIND_CPU_OP
    if operator_name:
        cand = rt.name_mask(lambda nm: operator_name in nm) & (depth >= 0)
        if cand.any():
            cand &= depth == depth[cand].min()
    else:
        # outermost cpu_op: no cpu_op ancestor
        cand = cpu_op & (_jump(parent, cpu_op[np.maximum(parent, 0)] & (parent >= 0)) < 0)
    # each launched GPU event belongs to the candidate root among its launch call's ancestors
    root_of = _jump(parent, cand)
    g, c = launch_rows(rt)
    root = root_of[c]
    keep = root >= 0
    g, root = g[keep], root[keep]
    order = np.lexsort((rt.ts[g], root))  # per root, in GPU start order (launch order on ties)
    g, root = g[order], root[order]
    cuts = np.flatnonzero(root[1:] != root[:-1]) + 1
    out: dict = {}
    if not g.size:
        return out
    starts = np.r_[0, cuts]
    groups = np.split(g, cuts)
    # roots in the order their first launched event appears (the sums then add in the same order)
    for k in np.argsort(np.minimum.reduceat(g, starts), kind="stable").tolist():
        ks = groups[k]
        if ks.size < min_pattern_len:
            continue
        r = int(root[starts[k]])
        pat = (rt.names[rt.name_id[r]],) + tuple(rt.names[i] for i in rt.name_id[ks].tolist())
        x = out.setdefault(pat, [0, 0.0, 0.0])
        x[0] += 1
        x[1] += float(rt.dur[ks].sum())
        x[2] += float(rt.dur[r])
    return out


def rank_entry(rt, profile_mode="auto", operator_name=None, min_pattern_len: int = 3, top_k: int = 5) -> dict:
    """One rank's entry: root count, distinct patterns and the ``top_k`` most frequent."""
    if resolve_mode(rt, profile_mode) != "gpu":
        return {"mode": "cpu", "note": "no GPU events in this trace"}
    pats = rank_sequences(rt, operator_name, min_pattern_len)
    ranked = sorted(pats.items(), key=lambda kv: (-kv[1][0], "|".join(kv[0])))
    total = sum(v[0] for v in pats.values())
    entry = {
        "roots_with_kernels": metric(total, "count", f"root ops launching >= {min_pattern_len} GPU events"),
        "distinct_patterns": metric(len(pats), "count", "distinct root|kernel sequences"),
        "patterns": {},
    }
    for i, (pat, (cnt, gpu_us, cpu_us)) in enumerate(ranked[:top_k], 1):
        entry["patterns"][f"top{i}"] = {
            "pattern": "|".join(pat),
            "count": metric(cnt, "count", "occurrences of this sequence"),
            "share_pct": metric(100.0 * cnt / total, "%", "count / roots_with_kernels * 100"),
            "kernels": metric(len(pat) - 1, "count", "GPU events in the sequence"),
            "gpu_time": metric(gpu_us, "us", "summed duration of the sequence's GPU events, all occurrences"),
            "cpu_time": metric(cpu_us, "us", "summed duration of the root op, all occurrences"),
        }
    return entry


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False, operator_name=None, min_pattern_len: int = 3, top_k: int = 5) -> dict:
    """Most frequent kernel sequences per rank (see module docstring)."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed)
    roots = f"CPU ops whose name contains {operator_name!r}" if operator_name else "outermost cpu_op events"
    notes = list(wl.notes) + [steps_note, f"roots: {roots}; min_pattern_len = {min_pattern_len}; "
                              f"top_k = {top_k}; patterns are 'root|kernel|kernel|...' (full names in JSON)"]
    fn = partial(rank_entry, profile_mode=profile_mode, operator_name=operator_name,
                 min_pattern_len=min_pattern_len, top_k=top_k)
    out = {rank_key(r): e for r, e in map_ranks(fn, ranks).items()}
    return result(TOOL, out, {}, notes, errors)
