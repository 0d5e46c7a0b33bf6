"""Output convention shared by every trace tool.

Every number a tool returns is a *metric*: a dict
``{"value": <float|int|None>, "unit": <str>, "definition": <str>}``.
Containers around metrics are plain dicts keyed by rank (``"rank0"``),
collective type, stream, ... A tool's result is::

    {
        "tool": "<name>",
        "ranks": {"rank0": {...metrics...}, ...},   # per-rank results
        "summary": {...metrics...},                  # across ranks (may be empty)
        "notes": ["<what was assumed / not available>", ...],
        "errors": {"<file>": "<reason>", ...},       # ranks that could not be read
        "warnings": ["<impossible value / bad input>", ...],
    }

``warnings`` always includes the physically impossible values found in ``ranks``
and ``summary`` (see :func:`impossible_values`).

Units used: ``us`` (microseconds), ``ms``, ``s``, ``%`` (percent, 0-100),
``bytes``, ``GB/s`` (1e9 bytes per second), ``tokens/s``, ``count``, ``FLOP/s``,
``ratio`` (dimensionless, 0-1). ``value`` is ``None`` when the trace does not
hold what the metric needs; the definition then says why.
"""

from __future__ import annotations

import math
import re
from typing import Any

# percentages that are shares of a time span or of a device's peak: > 100 % is impossible
_SHARE_PCT = re.compile(r"mfu|util|busy|idle|compute|overlap|share|exposed", re.I)
# signed figures (differences), where a negative time is legitimate
_SIGNED = re.compile(r"delta|change|diff|skew|offset|spread|slack|regression", re.I)
_TIME_UNITS = ("us", "ms", "s")


def metric(value: Any, unit: str, definition: str) -> dict:
    """One number with its unit and definition (see module docstring)."""
    if value is not None and hasattr(value, "item"):  # numpy scalar -> python
        value = value.item()
    return {"value": value, "unit": unit, "definition": definition}


def _is_metric(x) -> bool:
    return isinstance(x, dict) and "value" in x and "unit" in x


def impossible_values(tool: str, node: Any, path: str = "") -> list[str]:
    """Warnings for share percentages above 100 % and negative durations under ``node``."""
    out: list[str] = []
    if _is_metric(node):
        v, unit = node["value"], node["unit"]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return out
        if unit == "%" and v > 100.0 + 1e-6 and _SHARE_PCT.search(path):
            out.append(f"{tool}: {path} = {v:.4g} % is physically impossible (> 100 %); "
                       "check the inputs it is computed from (workload card, peak FLOP/s, trace)")
        elif unit in _TIME_UNITS and v < 0 and not _SIGNED.search(path):
            out.append(f"{tool}: {path} = {v:.4g} {unit} is a negative duration (corrupt timestamps?)")
        return out
    if isinstance(node, dict):
        for k, v in node.items():
            out += impossible_values(tool, v, f"{path}.{k}" if path else str(k))
    return out


def result(tool: str, ranks: dict | None = None, summary: dict | None = None,
           notes: list | None = None, errors: dict | None = None,
           warnings: list | None = None) -> dict:
    """Assemble a tool result in the shared shape (adds the impossible-value warnings)."""
    ranks, summary = ranks or {}, summary or {}
    warn = list(warnings or []) + impossible_values(tool, ranks) + impossible_values(tool, summary, "summary")
    return {
        "tool": tool,
        "ranks": ranks,
        "summary": summary,
        "notes": list(notes or []),
        "errors": dict(errors or {}),
        "warnings": list(dict.fromkeys(warn)),
    }
