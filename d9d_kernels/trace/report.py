"""Text tables and a self-contained HTML report for trace-tool results.

``flatten(result)`` turns one tool result (see :mod:`._result`) into rows
``(path, {rank: metric})``; ``text_report`` renders every tool as a table
(ranks as columns; min/median/max columns beyond 8 ranks); ``html_report``
renders the same tables plus charts (per-rank step time, time breakdown,
communication bandwidth, memory, kernel classes, launch queue length, memcpy/memset
bandwidth) as base64 PNGs made with
matplotlib's Agg backend — no scripts, stylesheets or images are fetched,
so the file opens offline.
"""

from __future__ import annotations

import base64
import html
import io
import math
from typing import Any, Iterable

MAX_RANK_COLUMNS = 8
# detail kept in the JSON but left out of tables (per-step series, name lists)
_SKIP_KEYS = {"steps", "snapshot_iterations", "annotations", "operations", "top_kernels",
              "by_iteration", "hta_kernel_type", "series", "longest_delays", "top_events"}
_MAX_DEPTH = 5


def _is_metric(x: Any) -> bool:
    return isinstance(x, dict) and "value" in x and "unit" in x


def _walk(node: Any, prefix: str, depth: int, out: dict):
    if _is_metric(node):
        out[prefix] = node
        return
    if isinstance(node, dict) and depth < _MAX_DEPTH:
        for k, v in node.items():
            if k in _SKIP_KEYS:
                continue
            _walk(v, f"{prefix}.{k}" if prefix else str(k), depth + 1, out)
    elif isinstance(node, (str, bool, int, float)) or node is None:
        out[prefix] = {"value": node, "unit": "", "definition": ""}


def flatten(res: dict) -> tuple[list[str], list[tuple[str, dict]], list[tuple[str, dict]]]:
    """``(rank_keys, rank_rows, summary_rows)``; a row is ``(path, {rank: metric})``."""
    ranks = res.get("ranks") or {}
    rank_keys = sorted(ranks, key=_rank_sort)
    paths: dict[str, dict] = {}
    for r in rank_keys:
        flat: dict = {}
        _walk(ranks[r], "", 0, flat)
        for p, m in flat.items():
            paths.setdefault(p, {})[r] = m
    summ: dict = {}
    _walk(res.get("summary") or {}, "", 0, summ)
    return rank_keys, list(paths.items()), [(p, {"all": m}) for p, m in summ.items()]


def _rank_sort(k: str):
    d = "".join(c for c in k if c.isdigit())
    return (int(d) if d else 1 << 30, k)


def fmt(m: dict | None) -> str:
    """Human-readable ``value unit``."""
    if m is None:
        return ""
    v, unit = m.get("value"), m.get("unit", "")
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            return "n/a"
        if unit == "bytes":
            return _bytes(v)
        if unit == "us" and abs(v) >= 1000:
            return f"{v / 1000:.4g} ms"
        if unit == "ratio":
            return f"{v:.4g}"
        if isinstance(v, int) or float(v).is_integer() and abs(v) < 1e15:
            return f"{int(v)} {unit}".strip()
        return f"{v:.4g} {unit}".strip()
    return f"{v} {unit}".strip()


def _bytes(n: float) -> str:
    for u in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or u == "TiB":
            return f"{n:.0f} B" if u == "B" else f"{n:.3g} {u}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _columns(rank_keys: list[str]) -> tuple[list[str], bool]:
    if len(rank_keys) <= MAX_RANK_COLUMNS:
        return rank_keys, False
    return ["min", "median", "max", "max at"], True


def _aggregate(cells: dict) -> list[str]:
    nums = [(m["value"], r) for r, m in cells.items()
            if isinstance(m.get("value"), (int, float)) and not isinstance(m.get("value"), bool)
            and math.isfinite(m["value"])]
    if not nums:
        vals = {str(m.get("value")) for m in cells.values()}
        return [ellipsize(", ".join(sorted(vals)), 40), "", "", ""]
    nums.sort(key=lambda x: x[0])
    unit = next(iter(cells.values())).get("unit", "")
    med = nums[len(nums) // 2][0]
    return [fmt({"value": nums[0][0], "unit": unit}), fmt({"value": med, "unit": unit}),
            fmt({"value": nums[-1][0], "unit": unit}), nums[-1][1]]


def _table_rows(res: dict) -> tuple[list[str], list[list[str]], list[list[str]]]:
    rank_keys, rows, summ = flatten(res)
    cols, agg = _columns(rank_keys)
    body = []
    for path, cells in rows:
        body.append([path] + (_aggregate(cells) if agg else [fmt(cells.get(r)) for r in cols]))
    srows = [[p, fmt(c["all"])] for p, c in summ]
    return ["metric"] + cols, body, srows


TEXT_WIDTH = 60


def ellipsize(s: str, width: int = TEXT_WIDTH) -> str:
    """Cut ``s`` to ``width`` characters with a visible ellipsis (text output only; JSON keeps it whole)."""
    return s if len(s) <= width else s[: width - 1] + "\u2026"


def _text_table(header: list[str], body: list[list[str]]) -> str:
    if not body:
        return ""
    widths = [max(len(str(r[i])) for r in [header] + body) for i in range(len(header))]
    widths = [min(w, TEXT_WIDTH) for w in widths]
    line = lambda r: "  ".join(ellipsize(str(c)).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in body])


def trailer_lines(res: dict) -> list[str]:
    """The warning, note and error lines that close a result's text section."""
    return ([f"WARNING: {w}" for w in res.get("warnings") or []]
            + [f"note: {n}" for n in res.get("notes") or []]
            + [f"error: {f}: {why}" for f, why in (res.get("errors") or {}).items()])


def text_report(results: dict[str, dict]) -> str:
    """All tool results as plain-text tables (what the CLI prints)."""
    parts = []
    for tool, res in results.items():
        parts.append(f"== {tool} " + "=" * max(0, 70 - len(tool)))
        header, body, srows = _table_rows(res)
        if body:
            parts.append(_text_table(header, body))
        if srows:
            parts.append("summary:")
            parts.append(_text_table(["metric", "value"], srows))
        parts.extend(trailer_lines(res))
        parts.append("")
    return "\n".join(parts)


# ----------------------------------------------------------------------------- charts


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _val(m):
    return m.get("value") if _is_metric(m) else None


def _ranks(res: dict | None) -> list[tuple[str, dict]]:
    if not res:
        return []
    rk = res.get("ranks") or {}
    return [(k, rk[k]) for k in sorted(rk, key=_rank_sort)]


def _chart_step_time(results, plt):
    rs = _ranks(results.get("throughput"))
    if not rs:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.2))
    names, med = [], []
    for i, (r, d) in enumerate(rs):
        steps = d.get("steps") or {}
        ys = [_val(m) for m in steps.values() if _val(m) is not None]
        ax.scatter([i] * len(ys), ys, s=10, color="tab:gray", zorder=3)
        names.append(r)
        med.append(_val(d.get("step_time_median")) or 0)
    ax.bar(range(len(names)), med, color="tab:blue", alpha=0.7, label="median")
    _xticks(ax, names)
    unit = next((d.get("step_time_median", {}).get("unit") for _, d in rs
                 if _is_metric(d.get("step_time_median"))), "")
    ax.set_ylabel(f"step time ({unit})")
    ax.set_title("Per-rank step time (bar: median, dots: each ProfilerStep)")
    return fig


def _xticks(ax, labels, fontsize=8):
    """Rank labels on the x axis; beyond 24 bars only every k-th is written."""
    n = len(labels)
    step = max(1, -(-n // 24))
    ax.set_xticks([i for i in range(n) if i % step == 0], [l for i, l in enumerate(labels) if i % step == 0],
                  rotation=45 if n > 8 else 0, fontsize=fontsize)


def _stacked(ax, labels, series: dict[str, list], title, ylabel):
    bottom = [0.0] * len(labels)
    for name, vals in series.items():
        vals = [v or 0.0 for v in vals]
        ax.bar(range(len(labels)), vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    _xticks(ax, labels)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _chart_breakdown(results, plt):
    ov = _ranks(results.get("overlap"))
    tp = _ranks(results.get("training_phases"))
    ov = [(r, d) for r, d in ov if _val(d.get("compute_pct")) is not None]
    tp = [(r, d) for r, d in tp if _val(d.get("step_time_total"))]
    if not ov and not tp:
        return None
    n = int(bool(ov)) + int(bool(tp))
    fig, axes = plt.subplots(1, n, figsize=(6 * n, 3.2), squeeze=False)
    i = 0
    if ov:
        _stacked(axes[0][i], [r for r, _ in ov],
                 {k: [_val(d.get(f"{k}_pct")) for _, d in ov] for k in ("compute", "non_compute", "idle")},
                 "GPU time breakdown (overlap tool)", "% of GPU span")
        i += 1
    if tp:
        _stacked(axes[0][i], [r for r, _ in tp],
                 {k: [_val(d.get(f"{k}_pct")) for _, d in tp]
                  for k in ("forward", "backward", "optimizer", "other")},
                 "Training phases (CPU, training_phases tool)", "% of step time")
    return fig


def _chart_comm(results, plt):
    rs = _ranks(results.get("communication"))
    bw: dict[str, list] = {}
    for _, d in rs:
        for ctype, groups in (d.get("collectives") or {}).items():
            if not isinstance(groups, dict):
                continue
            for _, m in groups.items():
                v = _val((m or {}).get("busbw")) if isinstance(m, dict) else None
                if v is not None:
                    bw.setdefault(ctype, []).append(v)
    if not bw:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.2))
    types = sorted(bw)
    means = [sum(bw[t]) / len(bw[t]) for t in types]
    lo = [m - min(bw[t]) for m, t in zip(means, types)]
    hi = [max(bw[t]) - m for m, t in zip(means, types)]
    ax.bar(range(len(types)), means, yerr=[lo, hi], capsize=4, color="tab:orange")
    ax.set_xticks(range(len(types)), types, fontsize=8)
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("Communication bus bandwidth per collective (mean, min-max over ranks/groups)")
    return fig


def _chart_memory(results, plt):
    rs = _ranks(results.get("memory"))
    labels, res_, alc = [], [], []
    for r, d in rs:
        devs = dict((d.get("snapshot") or {}).get("devices") or {})
        for dev, m in (d.get("trace_events") or {}).items():
            devs.setdefault(dev + " (trace)", m)
        for dev, m in devs.items():
            star = " *" if m.get("peak_source") == "snapshot_state" else ""
            labels.append(f"{r}\n{dev}{star}")
            res_.append((_val(m.get("peak_reserved")) or 0) / 2**30)
            alc.append((_val(m.get("peak_allocated")) or 0) / 2**30)
    if not labels:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.2))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], res_, width=0.4, label="peak reserved")
    ax.bar([i + 0.2 for i in x], alc, width=0.4, label="peak allocated")
    _xticks(ax, labels, fontsize=7)
    ax.set_ylabel("GiB")
    title = "Memory per rank and device"
    if any(l.endswith(" *") for l in labels):
        title += "\n(* no device_traces: snapshot-time values, not true peaks)"
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return fig


def _chart_kernels(results, plt):
    res = results.get("kernel") or {}
    pct = (res.get("summary") or {}).get("by_class_pct") or {}
    items = [(k, _val(m)) for k, m in pct.items() if _val(m)]
    if not items:
        return None
    fig, ax = plt.subplots(figsize=(7, 3.0))
    ax.barh([k for k, _ in items], [v for _, v in items], color="tab:green")
    ax.set_xlabel("% of GPU kernel time")
    ax.set_title("Kernel time by class (all ranks)")
    return fig


def _step_chart(plt, series: list, y: str, xlabel: str, ylabel: str, title: str):
    """Step lines of ``[(label, {"ts_us": [...], y: [...]})]`` against ms since the first point."""
    fig, ax = plt.subplots(figsize=(9, 3.0))
    t0 = min(s["ts_us"][0] for _, s in series)
    for k, s in series:
        ax.step([(t - t0) / 1e3 for t in s["ts_us"]], s[y], where="post", label=k, lw=0.8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def _chart_queue(results, plt):
    rs = _ranks(results.get("counters"))
    if not rs:
        return None
    rank, d = rs[0]
    streams = [(k, v["series"]) for k, v in (d.get("streams") or {}).items() if v.get("series", {}).get("ts_us")]
    if not streams:
        return None
    return _step_chart(plt, streams, "queue_length", "ms since the first launch", "queued operations",
                       f"Launch queue length per stream ({rank}; counters tool)")


def _chart_memory_bw(results, plt):
    rs = [(r, d) for r, d in _ranks(results.get("counters"))
          if any(v.get("series", {}).get("ts_us") for v in (d.get("memory_bw") or {}).values())]
    if not rs:
        return None
    rank, d = rs[0]
    kinds = [(k, v["series"]) for k, v in d["memory_bw"].items() if v.get("series", {}).get("ts_us")]
    return _step_chart(plt, kinds, "gbps", "ms since the first memory operation", "GB/s",
                       f"Memcpy / memset bandwidth in use per kind ({rank}; counters tool)")


CHARTS = (("Per-rank step time", _chart_step_time), ("Time breakdown", _chart_breakdown),
          ("Communication bandwidth", _chart_comm), ("Memory", _chart_memory),
          ("Kernel classes", _chart_kernels), ("Queue length", _chart_queue),
          ("Memory bandwidth", _chart_memory_bw))


def charts(results: dict[str, dict]) -> list[tuple[str, str | None, str | None]]:
    """``[(title, png_base64 | None, error | None)]`` for every chart that has data."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except Exception as exc:  # pragma: no cover - matplotlib missing
        return [("charts", None, f"matplotlib unavailable: {exc}")]
    out = []
    for title, fn in CHARTS:
        try:
            fig = fn(results, plt)
        except Exception as exc:  # a bad chart must not lose the report
            out.append((title, None, f"{type(exc).__name__}: {exc}"))
            plt.close("all")
            continue
        if fig is not None:
            out.append((title, _png(fig), None))
    return out


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#222}
h1{font-size:22px} h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:28px}
table{border-collapse:collapse;font-size:12px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right} td:first-child,th:first-child{text-align:left}
th{background:#f3f3f3} .note{color:#555;font-size:12px} .err{color:#b00;font-size:13px}
img{max-width:100%;border:1px solid #eee;margin:6px 0}
"""


def _html_table(header: list[str], body: list[list[str]], defs: list[str] | None = None) -> str:
    e = html.escape
    out = ["<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>"]
    for i, row in enumerate(body):
        title = f' title="{e(defs[i])}"' if defs and defs[i] else ""
        out.append(f"<tr><td{title}>{e(str(row[0]))}</td>"
                   + "".join(f"<td>{e(str(c))}</td>" for c in row[1:]) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def html_report(results: dict[str, dict], title: str = "Trace analysis",
                inputs: Iterable[str] = (), errors: dict | None = None,
                warnings: Iterable[str] = ()) -> str:
    """A self-contained HTML page: charts (inline base64 PNG) and one table per tool."""
    e = html.escape
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
             f"<style>{_CSS}</style></head><body><h1>{e(title)}</h1>"]
    ins = list(inputs)
    if ins:
        parts.append("<p class='note'>inputs: " + ", ".join(e(str(i)) for i in ins) + "</p>")
    for f, why in (errors or {}).items():
        parts.append(f"<p class='err'>error: {e(str(f))}: {e(str(why))}</p>")
    for w in warnings:
        parts.append(f"<p class='err'>warning: {e(str(w))}</p>")
    toc = ["<a href='#charts'>charts</a>"] + [f"<a href='#tool-{e(t)}'>{e(t)}</a>" for t in results]
    parts.append("<p>" + " · ".join(toc) + "</p>")
    ch = charts(results)
    if ch:
        parts.append("<h2 id='charts'>Charts</h2>")
        for t, png, err in ch:
            if png:
                parts.append(f"<div><img alt='{e(t)}' src='data:image/png;base64,{png}'></div>")
            else:
                parts.append(f"<p class='err'>chart '{e(t)}' failed: {e(str(err))}</p>")
    for tool, res in results.items():
        parts.append(f"<h2 id='tool-{e(tool)}'>{e(tool)}</h2>")
        header, body, srows = _table_rows(res)
        rank_keys, rows, summ = flatten(res)
        defs = [next((m.get("definition", "") for m in cells.values()), "") for _, cells in rows]
        if body:
            parts.append(_html_table(header, body, defs))
        if srows:
            parts.append("<p><b>summary</b></p>")
            parts.append(_html_table(["metric", "value"], srows,
                                     [c["all"].get("definition", "") for _, c in summ]))
        for w in res.get("warnings") or []:
            parts.append(f"<p class='err'>warning: {e(str(w))}</p>")
        for n in res.get("notes") or []:
            parts.append(f"<p class='note'>note: {e(str(n))}</p>")
        for f, why in (res.get("errors") or {}).items():
            parts.append(f"<p class='err'>error: {e(str(f))}: {e(str(why))}</p>")
    parts.append("<p class='note'>Hover a metric name for its definition. Full results (per-step "
                 "series, definitions) are in the --json output.</p></body></html>")
    return "\n".join(parts)
