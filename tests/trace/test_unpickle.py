"""The snapshot unpickler refuses pickles that would run code."""

from __future__ import annotations

import os
import pickle
import pickletools
from pathlib import Path

import pytest

from d9d_kernels.trace._unpickle import (
    SnapshotError,
    UnsafePickleError,
    load_snapshot,
    loads_snapshot,
)

from tests.trace._data import SNAPSHOT as REAL


def _write_marker(path):  # module-level so pickle can reference it by name
    Path(path).write_text("pwned")


class _CallsOsSystem:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _CallsPythonFunction:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (_write_marker, (str(self.marker),))


class _EvalPayload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (eval, (f"open({str(self.marker)!r}, 'w').write('x')",))


@pytest.mark.parametrize("payload", [_CallsOsSystem, _CallsPythonFunction, _EvalPayload])
def test_code_running_pickle_is_refused_and_marker_not_created(tmp_path, payload):
    marker = tmp_path / "marker"
    # Nested inside an otherwise plausible snapshot, as an attacker would.
    evil = {"segments": [{"blocks": [payload(marker)]}], "device_traces": []}
    f = tmp_path / "rank0_memory_snapshot.pickle"
    f.write_bytes(pickle.dumps(evil))
    # Sanity: the stock unpickler WOULD run it (proves the payload is live) —
    # checked on a copy in another dir so the real assertion stays clean.
    live_marker = tmp_path / "live" / "marker"
    live_marker.parent.mkdir()
    pickle.loads(pickle.dumps(payload(live_marker)))
    assert live_marker.exists()

    with pytest.raises(UnsafePickleError) as ei:
        load_snapshot(f)
    assert str(f) in str(ei.value)
    assert "refused" in str(ei.value)
    assert not marker.exists()


def test_real_snapshot_loads_and_has_no_globals(data_dir):
    data = REAL.read_bytes()
    ops = {op.name for op, _, _ in pickletools.genops(data)}
    assert not ops & {"GLOBAL", "STACK_GLOBAL", "INST", "OBJ", "REDUCE"}
    snap = load_snapshot(REAL)
    assert snap == pickle.loads(data)  # same object as the unrestricted load
    assert set(snap) == {"segments", "device_traces"}


@pytest.mark.parametrize("proto", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_plain_containers_roundtrip_every_protocol(proto):
    obj = {
        "a": [1, 2.5, None, True, "s", b"\x00\x01", (1, (2, 3))],
        "s": {1, 2},
        "f": frozenset({"x"}),
        "c": 1 + 2j,
        "ba": bytearray(b"ab"),
    }
    assert loads_snapshot(pickle.dumps(obj, protocol=proto)) == obj


def test_truncated_pickle_is_a_clear_error(tmp_path, data_dir):
    f = tmp_path / "trunc.pickle"
    f.write_bytes(REAL.read_bytes()[:500])
    with pytest.raises(SnapshotError) as ei:
        load_snapshot(f)
    assert str(f) in str(ei.value)
    assert not isinstance(ei.value, UnsafePickleError)


def test_allowlisted_module_other_name_refused():
    # builtins is allowlisted only for named constructors, not getattr/eval.
    evil = b"cbuiltins\ngetattr\n(cbuiltins\nset\nS'__init__'\ntR."
    with pytest.raises(UnsafePickleError, match="builtins.getattr"):
        loads_snapshot(evil, source="x.pickle")
