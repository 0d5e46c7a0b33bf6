"""Iteration time, tokens/s and MFU per rank.

Iteration time = duration of each CPU-side ``ProfilerStep#N`` span (the profiler's
step boundaries: one ``prof.step()`` to the next). The summary statistic is the
median over the profiled steps (robust to a warm-up step); all steps are listed.

From the workload card (``_load.load_card``): tokens per step per rank =
``tokens_per_step``, else ``batch_size x seq_len`` (``global_batch_size / dp_size``
when only the global batch is given; ``dp_size`` defaults to the world size);
tokens/s = tokens per step / median step time. MFU = model FLOPs per step /
median step time / device peak, with FLOPs per step = ``flops_per_step``, else
``flops_per_token x tokens per step``; the peak is the card's ``peak_flops``, else
the dense BF16 peak of the trace's ``deviceProperties`` name (``_common.PEAK_FLOPS``).
"""

from __future__ import annotations

import numpy as np

from d9d_kernels.trace._common import card_of, device_peak_flops, open_steps, rank_key
from d9d_kernels.trace._load import unknown_card_keys
from d9d_kernels.trace._result import metric, result


def _get(card: dict, *keys):
    for k in keys:
        if card.get(k) is not None:
            return float(card[k])
    return None


def tokens_per_step(card: dict, world_size: int | None) -> float | None:
    t = _get(card, "tokens_per_step")
    if t is not None:
        return t
    seq = _get(card, "seq_len", "sequence_length", "seq_length")
    bs = _get(card, "batch_size", "local_batch_size")
    if bs is None:
        gbs = _get(card, "global_batch_size")
        dp = _get(card, "dp_size", "data_parallel_size") or world_size
        if gbs is not None and dp:
            bs = gbs / dp
    return bs * seq if (bs is not None and seq is not None) else None


def metric_cal(trace_dir, workload_card_path=None, profile_mode="auto", steps="hta",
               allow_mixed=False) -> dict:
    """Per-rank step times, tokens/s and MFU."""
    wl, ranks, errors, steps_note = open_steps(trace_dir, workload_card_path, steps, allow_mixed)
    card = card_of(wl, workload_card_path)
    notes = list(wl.notes) + [steps_note]
    out = {}
    med_all = []
    tps_all = []
    for r, rt in ranks.items():
        nums, start, end = rt.steps
        if nums.size == 0:
            out[rank_key(r)] = {"note": "no ProfilerStep#N spans: iteration time unknown"}
            continue
        dur_ms = (end - start) / 1e3
        med = float(np.median(dur_ms))
        med_all.append(med)
        entry = {
            "steps": {f"step{int(n)}": metric(float(d), "ms", f"duration of ProfilerStep#{int(n)}")
                      for n, d in zip(nums, dur_ms)},
            "step_time_median": metric(med, "ms", "median ProfilerStep duration"),
            "step_time_mean": metric(float(dur_ms.mean()), "ms", "mean ProfilerStep duration"),
            "num_steps": metric(int(nums.size), "count", "ProfilerStep spans in the trace"),
        }
        tok = tokens_per_step(card, rt.world_size)
        if tok is not None:
            tps = tok / (med / 1e3)
            tps_all.append(tps)
            entry["tokens_per_step"] = metric(tok, "tokens", "tokens processed by this rank per step (card)")
            entry["tokens_per_s"] = metric(tps, "tokens/s", "tokens_per_step / step_time_median")
        else:
            entry["tokens_per_s"] = metric(None, "tokens/s",
                                           "needs batch_size and seq_len (or tokens_per_step) in the workload card")
        fps = _get(card, "flops_per_step")
        fpt = _get(card, "flops_per_token", "model_flops_per_token")
        if fps is None and fpt is not None and tok is not None:
            fps = fpt * tok
        peak = _get(card, "peak_flops")
        dev_name = None
        if peak is None:
            peak, dev_name = device_peak_flops(rt)
        if fps is not None and peak:
            achieved = fps / (med / 1e3)
            entry["achieved_flops"] = metric(achieved, "FLOP/s", "model FLOPs per step / step_time_median")
            entry["mfu_pct"] = metric(100.0 * achieved / peak, "%",
                                      f"achieved_flops / peak {peak:.3g} FLOP/s"
                                      + (f" ({dev_name}, dense BF16)" if dev_name else " (card peak_flops)"))
        else:
            why = "needs model FLOPs (flops_per_token or flops_per_step) in the workload card" if fps is None \
                else f"device peak unknown for {dev_name!r}: give peak_flops in the workload card"
            entry["mfu_pct"] = metric(None, "%", why)
        out[rank_key(r)] = entry
    summary = {}
    if med_all:
        summary["step_time_median_max"] = metric(max(med_all), "ms", "slowest rank's median step time")
        summary["step_time_median_min"] = metric(min(med_all), "ms", "fastest rank's median step time")
    if tps_all:
        summary["tokens_per_s_total"] = metric(float(sum(tps_all)), "tokens/s",
                                               "sum of tokens_per_s over the ranks in the trace set")
    if not card:
        notes.append("no workload card: tokens/s and MFU not computed")
    warn = unknown_card_keys(card)
    return result("throughput", out, summary, notes, errors, [warn] if warn else [])
