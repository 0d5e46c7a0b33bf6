"""Two runs compared op by op: ``python -m d9d_kernels.trace diff RUN_A RUN_B``.

For each run (a trace directory, a trace file or a list of files), under the same step
filter (``steps``), every complete event is grouped by side and name: ``gpu`` (kernels,
memcpy, memset on a stream) and ``cpu`` (everything else: operators, runtime calls,
annotations). Per name: the count and the summed duration, summed over the ranks present
in both runs, then divided by the number of ProfilerSteps in the filtered window (so runs
with different step counts compare; without steps the totals are used). Under the default
'hta' filter the GPU side covers one step fewer (the last step's GPU work is dropped), and
is divided accordingly; with 'hta'/'all' the CPU side also holds events outside the steps
(use ``steps="N:M"`` for exact per-step windows). Durations are
inclusive (a CPU op's time contains its children's), as in HolisticTraceAnalysis's
``TraceDiff.compare_traces``, whose per-name counts and total durations these are.

``ops`` lists every name, the largest time increase (regression) first; ``summary``
holds the step-level figures.
"""

from __future__ import annotations

import numpy as np

from d9d_kernels.trace._common import hta_times, open_steps, parse_steps
from d9d_kernels.trace._result import metric, result

TOOL = "diff"
SIDES = ("gpu", "cpu")


def op_table(rt, rounding: str = "hta") -> dict:
    """``{(side, name): [count, total_us]}`` of one rank."""
    start, end = hta_times(rt, rounding)
    dur = end - start
    gpu = rt.gpu_mask
    out: dict = {}
    for side, mask in (("gpu", gpu), ("cpu", ~gpu)):
        ids = rt.name_id[mask]
        if ids.size == 0:
            continue
        cnt = np.bincount(ids, minlength=len(rt.names))
        tot = np.bincount(ids, weights=dur[mask], minlength=len(rt.names))
        for i in np.flatnonzero(cnt):
            k = (side, rt.names[i])
            c = out.setdefault(k, [0, 0.0])
            c[0] += int(cnt[i])
            c[1] += float(tot[i])
    return out


def _num_steps(rt) -> int:
    return int(rt.steps[0].size)


def _run(path, steps, allow_mixed, rounding):
    wl, ranks, errors, note = open_steps(path, None, steps, allow_mixed)
    return ranks, errors, note


def compare(run_a, run_b, steps="hta", allow_mixed: bool = False, rounding: str = "hta") -> dict:
    """Per op/kernel count and time change from ``run_a`` to ``run_b`` (see module docstring)."""
    ranks_a, err_a, note = _run(run_a, steps, allow_mixed, rounding)
    ranks_b, err_b, _ = _run(run_b, steps, allow_mixed, rounding)
    common = sorted(set(ranks_a) & set(ranks_b))
    pairs = [(r, r) for r in common]
    if not pairs and len(ranks_a) == 1 and len(ranks_b) == 1:  # one trace each: compare them
        pairs = [(next(iter(ranks_a)), next(iter(ranks_b)))]
    used = ", ".join(f"{a}" if a == b else f"A{a}/B{b}" for a, b in pairs) or "none"
    notes = [note, "durations inclusive (a CPU op contains its children); per step = summed over "
                   f"the ranks compared ({used}) / ProfilerSteps"]
    if not pairs:
        res = result(TOOL, notes=notes + ["no rank present in both runs"], errors={**err_a, **err_b})
        res.update(inputs={"a": str(run_a), "b": str(run_b)}, ops={s: {} for s in SIDES})
        return res
    if set(ranks_a) != set(ranks_b) and common:
        notes.append(f"ranks only in A: {sorted(set(ranks_a) - set(ranks_b))}, only in B: "
                     f"{sorted(set(ranks_b) - set(ranks_a))} (left out)")
    tabs, nsteps, step_ms = [], [], []
    for side_i, ranks in enumerate((ranks_a, ranks_b)):
        use = [p[side_i] for p in pairs]
        tab: dict = {}
        for r in use:
            for k, (c, t) in op_table(ranks[r], rounding).items():
                x = tab.setdefault(k, [0, 0.0])
                x[0] += c
                x[1] += t
        tabs.append(tab)
        ns = [_num_steps(ranks[r]) for r in use]
        nsteps.append(min(ns))
        durs = [e - s for r in use for _, s, e in zip(*ranks[r].steps)]
        step_ms.append(float(np.median(durs)) / 1e3 if durs else None)
    per_step = all(n > 0 for n in nsteps)
    # the 'hta' filter keeps the GPU work of all but the last step: GPU figures cover n - 1 steps
    gpu_steps = [n - 1 if parse_steps(steps) == "hta" and n >= 2 else n for n in nsteps]
    div = {"cpu": nsteps if per_step else [1, 1], "gpu": gpu_steps if per_step else [1, 1]}
    unit_note = "per ProfilerStep" if per_step else "total (no ProfilerStep in a run)"
    if not per_step:
        notes.append("a run has no ProfilerStep: totals compared, not per-step figures")
    rows = []
    for k in set(tabs[0]) | set(tabs[1]):
        ca, ta = tabs[0].get(k, [0, 0.0])
        cb, tb = tabs[1].get(k, [0, 0.0])
        d = div[k[0]]
        rows.append((tb / d[1] - ta / d[0], k, ca / d[0], cb / d[1], ta / d[0], tb / d[1]))
    rows.sort(key=lambda x: (-x[0], x[1]))
    ops = {s: {} for s in SIDES}
    for dt, (side, name), ca, cb, ta, tb in rows:
        ops[side][name] = {
            "count_a": metric(ca, "count", f"occurrences in A, {unit_note}"),
            "count_b": metric(cb, "count", f"occurrences in B, {unit_note}"),
            "count_change": metric(cb - ca, "count", "count_b - count_a"),
            "time_a": metric(ta, "us", f"summed duration in A, {unit_note}"),
            "time_b": metric(tb, "us", f"summed duration in B, {unit_note}"),
            "time_change": metric(dt, "us", "time_b - time_a (positive: B slower)"),
            "time_change_pct": metric(100.0 * dt / ta if ta > 0 else None, "%", "time_change / time_a * 100"),
        }
    summary = {
        "num_steps_a": metric(nsteps[0], "count", "ProfilerSteps in A's filtered window (fewest over ranks)"),
        "num_steps_b": metric(nsteps[1], "count", "ProfilerSteps in B's filtered window (fewest over ranks)"),
        "step_time_median_a": metric(step_ms[0], "ms", "median ProfilerStep duration in A"),
        "step_time_median_b": metric(step_ms[1], "ms", "median ProfilerStep duration in B"),
        "step_time_median_change": metric(None if None in step_ms else step_ms[1] - step_ms[0], "ms",
                                          "step_time_median_b - step_time_median_a"),
    }
    for side in SIDES:
        ta = sum(v[1] for (s, _), v in tabs[0].items() if s == side) / div[side][0]
        tb = sum(v[1] for (s, _), v in tabs[1].items() if s == side) / div[side][1]
        what = "GPU event" if side == "gpu" else "CPU event (inclusive, nested ops counted each)"
        summary[f"{side}_time_a"] = metric(ta, "us", f"summed {what} duration in A, {unit_note}")
        summary[f"{side}_time_b"] = metric(tb, "us", f"summed {what} duration in B, {unit_note}")
        summary[f"{side}_time_change"] = metric(tb - ta, "us", f"{side}_time_b - {side}_time_a")
    res = result(TOOL, summary=summary, notes=notes, errors={**err_a, **err_b})
    res["inputs"] = {"a": str(run_a), "b": str(run_b)}
    res["ops"] = ops
    return res


def text(res: dict, top: int = 15) -> str:
    """Summary and the ``top`` regressions and improvements per side, as text tables."""
    from d9d_kernels.trace.report import _text_table, ellipsize, fmt, trailer_lines

    parts = [f"== diff: A = {res.get('inputs', {}).get('a')}  B = {res.get('inputs', {}).get('b')}"]
    parts.append(_text_table(["metric", "value"], [[k, fmt(v)] for k, v in res["summary"].items()]))
    for side in SIDES:
        items = list((res.get("ops") or {}).get(side, {}).items())
        if not items:
            continue
        for title, sel in (("regressions", [x for x in items if x[1]["time_change"]["value"] > 0][:top]),
                           ("improvements", [x for x in items[::-1] if x[1]["time_change"]["value"] < 0][:top])):
            if not sel:
                continue
            parts.append(f"{side} {title} (top {len(sel)} of {len(items)} names):")
            body = [[ellipsize(n), fmt(m["count_a"]), fmt(m["count_b"]), fmt(m["time_a"]), fmt(m["time_b"]),
                     fmt(m["time_change"])] for n, m in sel]
            parts.append(_text_table(["name", "count A", "count B", "time A", "time B", "change"], body))
    parts.extend(trailer_lines(res))
    return "\n".join(parts)


def top_table(res: dict, top: int = 15) -> dict:
    """``{side: {name: metrics}}`` of the ``top`` regressions per side (for the HTML report)."""
    return {side: dict(list(ops.items())[:top]) for side, ops in (res.get("ops") or {}).items()}
