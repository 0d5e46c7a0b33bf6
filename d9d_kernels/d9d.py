"""d9d integration: every ``dk.Metric`` (and so every ``dk.MetricGroup``) is a ``d9d.metric.Metric``.

d9d (>= 0.24, ``pip install d9d_kernels[d9d]``) is an optional dependency and
this module never imports it. ``d9d.metric.Metric`` is an ABC, so
``d9d.metric.Metric.register(dk.Metric)`` makes dk metrics virtual subclasses
(``isinstance(m, d9d.metric.Metric)`` is True) without inheriting from it.
Registering needs both classes; ``install()`` (run by ``import d9d_kernels``)
registers at once when ``d9d.metric`` and ``d9d_kernels.core.metric`` are
both imported already, and otherwise puts a finder on ``sys.meta_path`` that
wraps the loader of whichever of the two modules is imported later and
registers right after it executes. So ``import d9d_kernels`` imports neither
d9d nor torch, and the order of the imports does not matter.

d9d's ``DistributedContext`` is accepted wherever a ``ctx`` is: see
``DistributedContext.from_d9d`` in ``d9d_kernels.distributed``.
"""

from __future__ import annotations

import sys

__all__ = ["install", "register"]

_WATCHED = ("d9d.metric", "d9d_kernels.core.metric")


def register() -> bool:
    """Registers ``dk.Metric`` with ``d9d.metric.Metric`` if both modules are
    imported (never imports either); True once registered."""
    d9d_metric = sys.modules.get("d9d.metric")
    core_metric = sys.modules.get("d9d_kernels.core.metric")
    base = getattr(d9d_metric, "Metric", None)
    ours = getattr(core_metric, "Metric", None)
    if base is None or ours is None:
        return False
    if not issubclass(ours, base):
        base.register(ours)
    return True


class _Loader:
    """Wraps a module's loader: runs ``register()`` after the module executed.
    Everything else (``get_source``, resource readers, ...) is the real loader's,
    and the module's ``__loader__`` / ``__spec__.loader`` are the real loader again
    once it has executed."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = self._loader
            if module.__spec__ is not None:
                module.__spec__.loader = self._loader
        if register():
            _uninstall()

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder:
    """``sys.meta_path`` entry that only acts on the watched module names: it asks
    the finders after it for the spec and wraps that spec's loader."""

    def find_spec(self, name, path, target=None):
        if name not in _WATCHED:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


_FINDER = _Finder()


def _uninstall() -> None:
    try:
        sys.meta_path.remove(_FINDER)
    except ValueError:
        pass


def install() -> None:
    """Registers now if possible, else installs the import hook (idempotent)."""
    if register():
        _uninstall()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
