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

d9d's ``ComposeMetric`` takes any mapping of children and acts on each in
turn; a member of a ``dk.MetricGroup`` shares its group's storage, so it
cannot be a child of its own (its ``to`` at ``bind()`` would move the
group's buffers). When ``d9d.metric.impl.container.compose`` is imported,
its ``ComposeMetric.__init__`` is wrapped to refuse such children at
construction, naming the member and the group to pass instead.

d9d's tracker logs scalars only (``d9d.tracker.Scalar`` raises "A scalar must
have one element"); ``Scalars(metric)`` makes vector results (``average="none"``,
``ConfusionMatrix``, per-class curves) loggable as one scalar per element.
"""

from __future__ import annotations

import sys

__all__ = ["Scalars", "install", "register", "split_vectors"]

_COMPOSE = "d9d.metric.impl.container.compose"
_WATCHED = ("d9d.metric", "d9d_kernels.core.metric", _COMPOSE)


def register() -> bool:
    """Registers ``dk.Metric`` with ``d9d.metric.Metric`` if both modules are
    imported (never imports either); True once registered."""
    d9d_metric = sys.modules.get("d9d.metric")
    core_metric = sys.modules.get("d9d_kernels.core.metric")
    base = getattr(d9d_metric, "Metric", None)
    ours = getattr(core_metric, "Metric", None)
    if base is None or ours is None:
        return False
    for cls in (ours, Scalars):
        if not issubclass(cls, base):
            base.register(cls)
    return True


def check_children(children) -> None:
    """Raises ``ValueError`` when a child is a member of a ``dk.MetricGroup``."""
    for name, child in children.items():
        group = getattr(child, "__dict__", {}).get("_group")
        if group is not None:
            raise ValueError(
                f"ComposeMetric: child {name!r} is {child._label}, a member of a dk.MetricGroup; a member shares "
                "its group's state, so pass the group itself as one child, e.g. ComposeMetric({'train': g})"
            )


def _check_compose() -> bool:
    """Wraps ``ComposeMetric.__init__`` with ``check_children`` once its module
    is imported (never imports it); True once wrapped."""
    cls = getattr(sys.modules.get(_COMPOSE), "ComposeMetric", None)
    if cls is None:
        return False
    init = cls.__init__
    if not getattr(init, "_dk_checked", False):
        def checked(self, children, *args, **kwargs):
            check_children(children)
            init(self, children, *args, **kwargs)

        checked.__doc__, checked.__wrapped__, checked._dk_checked = init.__doc__, init, True
        cls.__init__ = checked
    return True


def _hook() -> bool:
    """Registers and wraps whatever is importable now; True once both are done."""
    return register() & _check_compose()


def split_vectors(tree):
    """``tree`` with every tensor of more than one element replaced by
    ``{"0": t[0], "1": t[1], ...}`` (recursively, so a matrix gives
    ``{"i": {"j": t[i, j]}}``); dicts are walked, other leaves kept. d9d's
    ``JobLogger`` joins the keys with "/": ``train/f1/3``, ``train/cm/1/2``."""
    if isinstance(tree, dict):
        return {k: split_vectors(v) for k, v in tree.items()}
    if getattr(tree, "ndim", 0) > 0 and tree.numel() != 1:
        return {str(i): split_vectors(tree[i]) for i in range(tree.shape[0])}
    return tree


class Scalars:
    """A dk metric or group as a d9d metric whose results d9d's tracker can log.

    ``compute()`` is the wrapped metric's with vector results split into one
    scalar per element (``split_vectors``): with ``{"train": Scalars(g)}`` from
    ``create_metrics``, a member ``"f1"`` with ``average="none"`` is logged as
    ``train/f1/0``, ``train/f1/1``, ... . Everything else (``update``,
    ``sync``, ``reset``, ``to``, ``state_dict``, ``g["name"]``, attributes) is
    the wrapped metric's, so checkpoints are the same.

    Example:
        >>> import torch, d9d_kernels as dk
        >>> from d9d_kernels.d9d import Scalars
        >>> m = Scalars(dk.MetricGroup({"f1": dk.F1Score(task="multiclass", num_classes=3, average="none")}))
        >>> m.update(preds=torch.tensor([0, 1, 1]), target=torch.tensor([0, 1, 2]))
        >>> {k: round(v.item(), 3) for k, v in m.compute()["f1"].items()}
        {'0': 1.0, '1': 0.667, '2': 0.0}
    """

    def __init__(self, metric):
        self.metric = metric

    def update(self, *args, **kwargs):
        return self.metric.update(*args, **kwargs)

    def sync(self, dist_context) -> None:
        self.metric.sync(dist_context)

    def compute(self):
        return split_vectors(self.metric.compute())

    def reset(self) -> None:
        self.metric.reset()

    def to(self, device) -> "Scalars":
        self.metric.to(device)
        return self

    def state_dict(self) -> dict:
        return self.metric.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.metric.load_state_dict(state_dict)

    def __getitem__(self, name):
        return self.metric[name]

    def __getattr__(self, name):
        if name == "metric":  # not set yet (unpickling, copying): no recursion
            raise AttributeError(name)
        return getattr(self.metric, name)

    def __repr__(self) -> str:
        return f"Scalars({self.metric!r})"


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
        if _hook():
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
    """Registers (and wraps ComposeMetric) now if possible, else installs the import hook (idempotent)."""
    if _hook():
        _uninstall()
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
