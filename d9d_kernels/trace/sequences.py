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

from collections import defaultdict

import numpy as np

from d9d_kernels.trace._common import launch_rows, open_steps, rank_key, resolve_mode
from d9d_kernels.trace._load import KIND_CPU_OP
from d9d_kernels.trace._result import metric, result

TOOL = "sequences"


def call_tree(rt) -> tuple[np.ndarray, np.ndarray]:
    """``(parent, depth)`` per row for non-GPU events (-1 / -1 for GPU rows and roots' parent)."""
    n = len(rt)
    parent = np.full(n, -1, dtype=np.int64)
    depth = np.full(n, -1, dtype=np.int64)
    rows = np.flatnonzero(~rt.gpu_mask & (rt.stream < 0))
    order = rows[np.lexsort((-rt.dur[rows], rt.ts[rows], rt.tid[rows], rt.pid[rows]))]
    ts, end, pid, tid = rt.ts, rt.ts + rt.dur, rt.pid, rt.tid
    stack: list = []
    key = None
    for i in order.tolist():
        k = (pid[i], tid[i])
        if k != key:
            stack, key = [], k
        while stack and ts[i] >= end[stack[-1]]:  # the open event ended before this one starts
            stack.pop()
        parent[i] = stack[-1] if stack else -1
        depth[i] = len(stack)
        stack.append(i)
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
        cand = cpu_op.copy()
        for i in np.flatnonzero(cpu_op):
            p = parent[i]
            while p >= 0:
                if cpu_op[p]:
                    cand[i] = False
                    break
                p = parent[p]
    roots = set(np.flatnonzero(cand).tolist())
    # each launched GPU event belongs to the candidate root among its launch call's ancestors
    g, c = launch_rows(rt)
    kernels = defaultdict(list)
    for gi, ci in zip(g.tolist(), c.tolist()):
        p = ci
        while p >= 0 and p not in roots:
            p = parent[p]
        if p >= 0:
            kernels[p].append(gi)
    out: dict = {}
    for root, ks in kernels.items():
        if len(ks) < min_pattern_len:
            continue
        ks.sort(key=lambda k: rt.ts[k])
        pat = (rt.names[rt.name_id[root]],) + tuple(rt.names[rt.name_id[k]] for k in ks)
        x = out.setdefault(pat, [0, 0.0, 0.0])
        x[0] += 1
        x[1] += float(rt.dur[ks].sum())
        x[2] += float(rt.dur[root])
    return out


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False, operator_name=None, min_pattern_len: int = 3, top_k: int = 5) -> dict:
    """Most frequent kernel sequences per rank (see module docstring)."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed)
    roots = f"CPU ops whose name contains {operator_name!r}" if operator_name else "outermost cpu_op events"
    notes = list(wl.notes) + [steps_note, f"roots: {roots}; min_pattern_len = {min_pattern_len}; "
                              f"top_k = {top_k}; patterns are 'root|kernel|kernel|...' (full names in JSON)"]
    out = {}
    for r, rt in ranks.items():
        if resolve_mode(rt, profile_mode) != "gpu":
            out[rank_key(r)] = {"mode": "cpu", "note": "no GPU events in this trace"}
            continue
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
        out[rank_key(r)] = entry
    return result(TOOL, out, {}, notes, errors)
