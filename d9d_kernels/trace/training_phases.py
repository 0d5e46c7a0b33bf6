"""Training phases: forward / backward / optimizer time from annotations, per rank and step.

A phase's CPU time is the length of the *union* of the CPU-side events that
mark it, clipped to the ProfilerStep#N span (so nested or repeated
annotations — ``## forward ##`` around ``DistributedDataParallel.forward`` —
are counted once):

* forward: ``record_function`` annotations named ``forward`` / ``fwd`` /
  ``forward_pass`` (any case, surrounding ``#`` and spaces ignored, e.g.
  ``## forward ##``) or ending in ``.forward`` (``DistributedDataParallel.forward``,
  ``FullyShardedDataParallel.forward``). ``FSDP::pre_forward`` and the like are
  not markers themselves; but when a rank has *no* forward annotation (torchtitan
  does not annotate its forward), forward is inferred per step from the FSDP
  hooks: first ``FSDP::root_pre_forward``/``pre_forward`` start to the last
  ``FSDP::post_forward`` end, cut at the first backward event — flagged as
  inferred in the output.
* backward: annotations ``backward`` / ``bwd`` / ``backward_pass`` / ``*.backward``,
  and every ``autograd::engine::evaluate_function: ...`` op (the autograd engine,
  on whatever thread it ran).
* optimizer: annotations ``optimizer`` / ``optimizer_step`` / ``optim`` /
  ``optimizer.step``, and ``Optimizer.step#...`` / ``Optimizer.zero_grad#...``
  (the spans torch.optim records itself).

Phases are made exclusive by precedence optimizer > backward > forward (a
forward annotation that encloses backward work counts that work as backward),
so forward + backward + optimizer + other = step time, where other = step time
minus the union of the three phases (data loading, logging, idle CPU...).

GPU time of a phase (traces with GPU events): union of the GPU kernels,
memcpys and memsets whose launching runtime call (same correlation id) starts
inside the phase's CPU intervals of that step.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from d9d_kernels.trace import _intervals as iv
from d9d_kernels.trace._common import open_steps, rank_key
from d9d_kernels.trace._load import (
    KIND_CPU_OP,
    KIND_GPU_USER_ANNOTATION,
    KIND_OTHER,
    KIND_PROFILER_STEP,
    KIND_RUNTIME,
    KIND_USER_ANNOTATION,
    RankTrace,
    TraceError,
)
from d9d_kernels.trace._result import metric, result

TOOL = "training_phases"
PHASES = ("forward", "backward", "optimizer")

_FWD = re.compile(r"^(forward|fwd|forward[_ ]pass|model[_ ]forward)$|\.forward$")
_BWD = re.compile(r"^(backward|bwd|backward[_ ]pass|loss[_.]backward)$|\.backward$")
_OPT = re.compile(r"^(optimizer|optim|optimizer[_ .]step|opt[_ ]step|optimizer[_ ]step[s]?)$")
_CPU_KINDS = (KIND_USER_ANNOTATION, KIND_CPU_OP, KIND_OTHER)


def _norm(name: str) -> str:
    return name.strip().strip("#").strip().lower()


def phase_of_name(name: str) -> str | None:
    """Which phase an event name marks (``None``: not a phase marker)."""
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
        return "optimizer"
    n = _norm(name)
    if "::" in n:  # FSDP::pre_forward, aten::..., c10d:: — never phase markers
        return None
    if _FWD.search(n):
        return "forward"
    if _BWD.search(n):
        return "backward"
    if _OPT.search(n):
        return "optimizer"
    return None


DEFINITIONS = {
    "forward": "union of forward annotations (## forward ##, *.forward), minus backward/optimizer time",
    "backward": ("union of backward annotations and autograd::engine::evaluate_function ops, "
                 "minus optimizer time"),
    "optimizer": "union of Optimizer.step#*/Optimizer.zero_grad#* and optimizer annotations",
    "other": "step time minus the union of the three phases",
    "step": "ProfilerStep#N span (CPU), or first-to-last CPU event when the trace has no steps",
}


def _inside(starts: np.ndarray, ends: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Mask of points ``t`` inside the sorted disjoint intervals."""
    if starts.size == 0:
        return np.zeros(t.shape, dtype=bool)
    i = np.searchsorted(starts, t, side="right") - 1
    ok = i >= 0
    out = np.zeros(t.shape, dtype=bool)
    out[ok] = t[ok] < ends[i[ok]]
    return out


def _launch_times(rt: RankTrace) -> tuple[np.ndarray, np.ndarray]:
    """``(gpu_rows, launch_ts)`` for GPU work whose launching runtime call is in the trace."""
    gpu = np.flatnonzero(rt.gpu_mask & (rt.correlation >= 0))
    rt_rows = np.flatnonzero((rt.kind == KIND_RUNTIME) & (rt.correlation >= 0))
    if gpu.size == 0 or rt_rows.size == 0:
        return np.empty(0, dtype=np.int64), np.empty(0)
    c = rt.correlation[rt_rows]
    order = np.argsort(c, kind="stable")
    c, rt_rows = c[order], rt_rows[order]
    j = np.searchsorted(c, rt.correlation[gpu])
    j = np.minimum(j, c.size - 1)
    ok = c[j] == rt.correlation[gpu]
    return gpu[ok], rt.ts[rt_rows[j[ok]]]


_PRE_FWD = ("FSDP::root_pre_forward", "FSDP::pre_forward", "FullyShardedDataParallel._root_pre_forward",
            "FullyShardedDataParallel._pre_forward")
_POST_FWD = ("FSDP::post_forward", "FullyShardedDataParallel._post_forward")
INFERRED_FORWARD = ("(inferred: first FSDP pre_forward hook to last FSDP post_forward hook of the "
                    "step, cut at the first backward event)")


def _forward_from_fsdp_hooks(rt: RankTrace, cpu: np.ndarray, st, en, bwd: tuple) -> tuple:
    """Forward spans of models with no forward annotation but FSDP hooks (torchtitan).

    Per step: from the first FSDP pre-forward hook to the end of the last post-forward
    hook, cut at the first backward event after it. Empty when there are no hooks.
    """
    def base(n):
        return n.split(" (", 1)[0].split(" [", 1)[0]

    pre = cpu & rt.name_mask(lambda n: base(n) in _PRE_FWD)
    post = cpu & rt.name_mask(lambda n: base(n) in _POST_FWD)
    if not pre.any():
        return np.empty(0), np.empty(0)
    s_all, e_all = rt.ts, rt.ts + rt.dur
    ps, pe = s_all[pre], e_all[pre]
    qs, qe = s_all[post], e_all[post]
    b_s = np.asarray(bwd[0])
    out_s, out_e = [], []
    for a, b in zip(st, en):
        m = (ps >= a) & (ps < b)
        if not m.any():
            continue
        start = float(ps[m].min())
        mq = (qs >= start) & (qs < b)
        end = float(qe[mq].max()) if mq.any() else float(pe[m].max())
        nb = b_s[(b_s > start) & (b_s < b)]
        if nb.size:
            end = min(end, float(nb.min()))
        if end > start:
            out_s.append(start)
            out_e.append(end)
    return np.asarray(out_s, dtype=np.float64), np.asarray(out_e, dtype=np.float64)


def rank_phases(rt: RankTrace) -> dict:
    """Raw per-step phase times (µs) of one rank: ``{"steps": {...}, "found": {...}}``."""
    cpu = np.isin(rt.kind, _CPU_KINDS)
    labels = np.asarray([phase_of_name(n) for n in rt.names], dtype=object)
    ev_phase = labels[rt.name_id] if len(rt.names) else np.empty(0, dtype=object)
    s_all, e_all = rt.ts, rt.ts + rt.dur
    found: dict[str, list] = {}
    phase_iv: dict[str, tuple] = {}
    for ph in PHASES:
        rows = np.flatnonzero(cpu & (ev_phase == ph))
        found[ph] = sorted({rt.names[i] for i in np.unique(rt.name_id[rows])})
        phase_iv[ph] = iv.union(s_all[rows], e_all[rows])
    nums, st, en = rt.steps
    if nums.size == 0:
        rows = np.flatnonzero(cpu | (rt.kind == KIND_PROFILER_STEP))
        if rows.size == 0:
            rows = np.flatnonzero(rt.kind != KIND_GPU_USER_ANNOTATION)
        nums = np.asarray(["all"], dtype=object)
        st = np.asarray([s_all[rows].min()])
        en = np.asarray([e_all[rows].max()])
    inferred = False
    if not found["forward"]:
        fwd = _forward_from_fsdp_hooks(rt, cpu, st, en, phase_iv["backward"])
        if fwd[0].size:
            phase_iv["forward"] = fwd
            found["forward"] = [INFERRED_FORWARD]
            inferred = True
    # exclusive phases by precedence optimizer > backward > forward
    excl: dict[str, tuple] = {}
    higher: tuple = (np.empty(0), np.empty(0))
    for ph in ("optimizer", "backward", "forward"):
        excl[ph] = _subtract(phase_iv[ph], higher)
        higher = iv.union(np.concatenate([higher[0], phase_iv[ph][0]]),
                          np.concatenate([higher[1], phase_iv[ph][1]]))
    all_phases = higher


    gpu_rows, launch = _launch_times(rt)
    gs, ge = s_all[gpu_rows], e_all[gpu_rows]
    steps: dict[str, dict] = {}
    for num, a, b in zip(nums, st, en):
        d: dict[str, Any] = {"step": float(b - a)}
        in_step = (launch >= a) & (launch < b)
        for ph in PHASES:
            cs, ce = iv.clip(*excl[ph], a, b)
            d[ph] = float((ce - cs).sum())
            if gpu_rows.size:
                m = in_step & _inside(cs, ce, launch)
                d[f"{ph}_gpu"] = iv.total(gs[m], ge[m])
        cs, ce = iv.clip(*all_phases, a, b)
        d["other"] = d["step"] - float((ce - cs).sum())
        if gpu_rows.size:
            d["step_gpu"] = iv.total(gs[in_step], ge[in_step])
        steps[str(num)] = d
    return {"steps": steps, "found": found, "has_gpu": bool(gpu_rows.size), "inferred_forward": inferred}


def _subtract(a: tuple, b: tuple) -> tuple:
    """``a \\ b`` for sorted disjoint interval sets (as unions)."""
    a_s, a_e = iv.union(*a)
    if a_s.size == 0 or np.asarray(b[0]).size == 0:
        return a_s, a_e
    # complement of b within [min(a), max(a)], then intersect with a
    b_s, b_e = iv.union(*b)
    lo, hi = float(a_s.min()), float(a_e.max())
    cs = np.concatenate(([lo], b_e))
    ce = np.concatenate((b_s, [hi]))
    keep = ce > cs
    return iv.intersect((a_s, a_e), (cs[keep], ce[keep]))


def _rank_metrics(raw: dict) -> dict:
    steps = raw["steps"]
    n = len(steps)
    tot = {k: sum(d[k] for d in steps.values()) for k in ("step", *PHASES, "other")}
    out: dict[str, Any] = {
        "num_steps": metric(n, "count", "ProfilerStep#N spans analysed (1 pseudo-step 'all' "
                                        "when the trace has none)"),
        "step_time_total": metric(tot["step"], "us", "sum over steps of " + DEFINITIONS["step"]),
        "step_time_mean": metric(tot["step"] / n if n else None, "us", "step_time_total / num_steps"),
    }
    for ph in (*PHASES, "other"):
        missing = ph != "other" and not raw["found"][ph]
        why = f" (no {ph} annotation found in the trace)" if missing else ""
        if ph == "forward" and raw.get("inferred_forward"):
            why = " " + INFERRED_FORWARD
        out[f"{ph}_time"] = metric(None if missing else tot[ph], "us",
                                   f"CPU time, summed over steps: {DEFINITIONS[ph]}{why}")
        out[f"{ph}_time_per_step"] = metric(None if missing or not n else tot[ph] / n, "us",
                                            f"mean per step of {ph}_time")
        out[f"{ph}_pct"] = metric(None if missing or tot["step"] <= 0 else 100 * tot[ph] / tot["step"],
                                  "%", f"{ph}_time / step_time_total * 100")
    if raw["has_gpu"]:
        for ph in (*PHASES, "step"):
            v = sum(d.get(f"{ph}_gpu", 0.0) for d in steps.values())
            missing = ph != "step" and not raw["found"][ph]
            out[f"{ph}_gpu_time"] = metric(
                None if missing else v, "us",
                ("union of GPU work launched inside the step" if ph == "step" else
                 f"union of GPU work (kernels/memcpy/memset) whose launch is inside the {ph} phase")
                + ", summed over steps")
    out["annotations"] = {ph: raw["found"][ph][:20] for ph in PHASES}
    out["steps"] = {
        num: {k: metric(v, "us", DEFINITIONS.get(k.replace("_gpu", ""), k) +
                        (" — GPU time of work launched in it" if k.endswith("_gpu") else ""))
              for k, v in d.items()}
        for num, d in steps.items()
    }
    return out


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False) -> dict:
    """Forward / backward / optimizer time per rank and per step (see module docstring).

    ``profile_mode``: ``"cpu"`` skips the GPU-time attribution; ``"auto"``/``"gpu"``
    add it when the trace has GPU events.

    Example:
        >>> r = metric_cal("/work/shared/data/traces/nccl_rank0_of2")   # doctest: +SKIP
        >>> r["ranks"]["rank0"]["backward_pct"]["value"]                # doctest: +SKIP
    """
    if profile_mode not in ("auto", "gpu", "cpu"):
        raise ValueError(f"{TOOL}: profile_mode must be 'auto', 'gpu' or 'cpu', got {profile_mode!r}")
    try:
        wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed)
    except TraceError as exc:
        return result(TOOL, errors={exc.file: exc.reason})
    out: dict[str, dict] = {}
    notes = list(wl.notes) + [steps_note]
    for r, rt in ranks.items():
        raw = rank_phases(rt)
        if profile_mode == "cpu":
            raw["has_gpu"] = False
        out[rank_key(r)] = _rank_metrics(raw)
        if raw["inferred_forward"]:
            notes.append(f"{rank_key(r)}: no forward annotation; forward {INFERRED_FORWARD}")
        missing = [ph for ph in PHASES if not raw["found"][ph]]
        if missing:
            notes.append(f"{rank_key(r)}: no annotation for {', '.join(missing)} — those phases are "
                         "reported as None and their time falls into 'other'")
    summary: dict[str, Any] = {}
    for ph in (*PHASES, "other"):
        vals = [m[f"{ph}_time_per_step"]["value"] for m in out.values()
                if m[f"{ph}_time_per_step"]["value"] is not None]
        if vals:
            summary[f"{ph}_time_per_step"] = metric(float(np.mean(vals)), "us",
                                                    f"mean over ranks of {ph}_time_per_step")
            summary[f"{ph}_time_per_step_max"] = metric(float(np.max(vals)), "us",
                                                        f"max over ranks of {ph}_time_per_step")
    notes.append("phases are exclusive (optimizer > backward > forward); "
                 "forward + backward + optimizer + other = step time")
    return result(TOOL, ranks=out, summary=summary, notes=notes, errors=errors)
