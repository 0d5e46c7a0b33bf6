"""Imports an example script (examples/ is no package) as a module, for the tests that call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_example(filename: str, name: str):
    """``examples/<filename>`` as module ``name``; registered in ``sys.modules`` (its dataclasses
    resolve their annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / filename)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
