"""Restricted unpickler for CUDA caching-allocator snapshots.

``torch.cuda.memory._snapshot()`` returns plain data (dicts, lists, tuples,
strings, ints, floats, bools, None); ``pickle.dump`` of it contains no
``GLOBAL``/``STACK_GLOBAL`` opcodes at all. Any pickle that names a callable
(``os.system``, ``builtins.eval``, a class with ``__reduce__``) is therefore
not a snapshot, and loading it with ``pickle.load`` would run that callable.
This module refuses every global except a short allowlist of inert
container/scalar constructors, and refuses persistent ids.

Example:
    >>> import io, pickle
    >>> from d9d_kernels.trace._unpickle import loads_snapshot
    >>> loads_snapshot(pickle.dumps({"segments": [], "device_traces": []}))
    {'segments': [], 'device_traces': []}
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any

__all__ = ["SnapshotError", "UnsafePickleError", "load_snapshot", "loads_snapshot", "ALLOWED_GLOBALS"]

# Inert constructors only: none of them can reach the filesystem, the network
# or the interpreter. `_codecs.encode` is what protocol-2 pickles use to
# rebuild `bytes` (pickle.dumps(b"..", protocol=2)); it only re-encodes a str.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "bytearray"),
        ("builtins", "complex"),
        ("builtins", "slice"),
        ("collections", "OrderedDict"),
        ("_codecs", "encode"),
        # Python-2 spellings, remapped by pickle's fix_imports.
        ("__builtin__", "set"),
        ("__builtin__", "frozenset"),
        ("__builtin__", "bytearray"),
        ("__builtin__", "complex"),
    }
)

from ._load import TraceError


class SnapshotError(TraceError):
    """A memory snapshot file cannot be read (truncated, not a pickle, wrong shape).

    ``file`` and ``reason`` as :class:`TraceError`; ``str()`` is ``"<file>: <reason>"``.
    """

    def __reduce__(self):
        return (type(self), (self.file, self.reason))


class UnsafePickleError(SnapshotError):
    """A snapshot pickle names a callable or class outside the allowlist."""


class _SnapshotUnpickler(pickle.Unpickler):
    def __init__(self, fh: io.BufferedIOBase, source: str):
        super().__init__(fh)
        self._source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise UnsafePickleError(
            self._source,
            f"refused to unpickle global '{module}.{name}' — a CUDA memory "
            "snapshot holds only plain containers and scalars; this pickle would construct "
            "or call arbitrary objects (possibly running code), so it was not loaded"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(
            self._source, "refused persistent id in pickle (not a memory snapshot)")


def loads_snapshot(data: bytes, source: str = "<bytes>") -> Any:
    """Unpickle ``data`` allowing only plain containers and scalars.

    Raises:
        UnsafePickleError: the pickle refers to a callable/class not allowed.
        SnapshotError: the bytes are not a (complete) pickle; message names ``source``.
    """
    try:
        return _SnapshotUnpickler(io.BytesIO(data), source).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
            KeyError, AttributeError, MemoryError, RecursionError) as exc:
        raise SnapshotError(
            source, f"not a readable memory-snapshot pickle ({type(exc).__name__}: {exc})"
        ) from None


def load_snapshot(path: str | os.PathLike) -> Any:
    """Read a ``torch.cuda.memory._snapshot()`` pickle from ``path`` safely."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise SnapshotError(path, f"cannot read: {exc.strerror or exc}") from None
    return loads_snapshot(data, source=path)
