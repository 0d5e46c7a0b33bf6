"""Imports an example script (examples/ is no package) as a module, for the tests that call its functions.

examples/ goes on ``sys.path`` (appended), as running ``python examples/<file>`` puts it
there: the examples import their sibling modules by name (``d9d_cpu_standin``)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _examples_on_path() -> None:
    if str(EXAMPLES) not in sys.path:
        sys.path.append(str(EXAMPLES))


def load_example(filename: str, name: str):
    """``examples/<filename>`` as module ``name``; registered in ``sys.modules`` (its dataclasses
    resolve their annotations through it)."""
    _examples_on_path()
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / filename)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def cpu_standin():
    """examples/d9d_cpu_standin.py, imported by the name the examples import it by."""
    _examples_on_path()
    return importlib.import_module("d9d_cpu_standin")
