"""Every docstring example of the package runs and prints what it shows.

The modules are found by walking the package (``pkgutil.walk_packages``),
not listed, so a new module's examples run without anyone adding it here.
What ``doctest`` collects is checked against an independent count, the
``>>>`` prompts in the module's source: an example the finder does not
reach (a docstring of an object whose ``__module__`` is another module, a
decorator that hides it) fails instead of passing unrun. The modules that
export the public names (``d9d_kernels._EXPORTS``) and the op wrappers
(``ops/<op>.py`` for every op in ``_extension.OPS``) must have examples.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil
import re
from pathlib import Path

import pytest

import d9d_kernels
from d9d_kernels import _extension

_UNWALKED: list[str] = []  # subpackages walk_packages could not import (their modules are unseen)
MODULES = sorted(
    {m.name for m in pkgutil.walk_packages(d9d_kernels.__path__, "d9d_kernels.", onerror=_UNWALKED.append)}
    | {"d9d_kernels", *_UNWALKED}
)
PROMPT = re.compile(r"^\s*>>>", re.MULTILINE)
REQUIRED = ("d9d_kernels", "torch")  # pyproject's dependencies: any other package is optional here


def _import(name: str):
    """The module, or a skip naming the optional dependency it lacks."""
    if name == "d9d_kernels._C" and _extension.CPP_ERROR is not None:  # a supported state (_extension.py)
        pytest.skip(_extension.CPP_ERROR)
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing = (e.name or "").partition(".")[0]
        if missing and missing not in REQUIRED:
            pytest.skip(f"{name} needs the optional package {missing!r}: {e}")
        raise


def _examples(module) -> list[doctest.DocTest]:
    return [t for t in doctest.DocTestFinder().find(module) if t.examples]


def _prompts_in_source(module) -> int:
    path = Path(getattr(module, "__file__", "") or "")
    return len(PROMPT.findall(path.read_text())) if path.suffix == ".py" else 0


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = _import(name)
    tests = _examples(module)
    found = sum(len(t.examples) for t in tests)
    assert found == _prompts_in_source(module), (
        f"{name}: doctest collects {found} examples, its source has {_prompts_in_source(module)} '>>>' prompts")
    runner = doctest.DocTestRunner(verbose=False)
    out = io.StringIO()
    for t in tests:
        runner.run(t, out=out.write)
        t.globs.clear()
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed\n{out.getvalue()}"


def test_public_modules_and_op_wrappers_have_examples():
    """The modules of every public name and every op wrapper: examples found, not zero."""
    expected = {*d9d_kernels._EXPORTS, *(f"d9d_kernels.ops.{op}" for op in _extension.OPS)}
    assert not _UNWALKED, f"subpackages that did not import during the walk: {_UNWALKED}"
    assert expected <= set(MODULES), sorted(expected - set(MODULES))
    empty = [name for name in sorted(expected) if not _examples(importlib.import_module(name))]
    assert not empty, f"no docstring example found in {empty}"
