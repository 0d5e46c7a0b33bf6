"""Dynamo-aware pieces that never import ``torch._dynamo`` themselves.

Importing ``torch._dynamo`` costs about a second, so a process that never
compiles must not pay it on its first ``update``. Dynamo can trace a frame
only once something has imported it, so "``torch._dynamo`` is not in
``sys.modules``" proves that nothing is being traced.
"""

from __future__ import annotations

import functools
import sys

from torch.utils._python_dispatch import TorchDispatchMode


def dynamo_loaded() -> bool:
    """True once ``torch._dynamo`` is imported (before that nothing can be traced)."""
    return "torch._dynamo" in sys.modules


def skip_dynamo(fn):
    """``fn`` run outside Dynamo, as ``torch._disable_dynamo(fn)`` runs it, but
    ``torch._dynamo`` is imported only once something else has imported it."""
    disabled = None

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        nonlocal disabled
        if not dynamo_loaded():
            return fn(*args, **kwargs)
        if disabled is None:
            import torch._dynamo

            disabled = torch._dynamo.disable(fn, recursive=True)
        return disabled(*args, **kwargs)

    return inner


class DispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose subclasses' ``__torch_dispatch__`` skip
    Dynamo through ``skip_dynamo``. torch wraps it with ``torch._disable_dynamo``
    instead, which imports ``torch._dynamo`` on the first dispatched op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:  # torch's switch for its own wrapping (utils/_python_dispatch.py)
        return False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        raw = cls.__dict__.get("__torch_dispatch__")
        if raw is not None and not isinstance(raw, classmethod):
            cls.__torch_dispatch__ = skip_dynamo(raw)
