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
    }

Units used: ``us`` (microseconds), ``ms``, ``s``, ``%`` (percent, 0-100),
``bytes``, ``GB/s`` (1e9 bytes per second), ``tokens/s``, ``count``, ``FLOP/s``,
``ratio`` (dimensionless, 0-1). ``value`` is ``None`` when the trace does not
hold what the metric needs; the definition then says why.
"""

from __future__ import annotations

from typing import Any


def metric(value: Any, unit: str, definition: str) -> dict:
    """One number with its unit and definition (see module docstring)."""
    if value is not None and hasattr(value, "item"):  # numpy scalar -> python
        value = value.item()
    return {"value": value, "unit": unit, "definition": definition}


def result(tool: str, ranks: dict | None = None, summary: dict | None = None,
           notes: list | None = None, errors: dict | None = None) -> dict:
    """Assemble a tool result in the shared shape."""
    return {
        "tool": tool,
        "ranks": ranks or {},
        "summary": summary or {},
        "notes": list(notes or []),
        "errors": dict(errors or {}),
    }
