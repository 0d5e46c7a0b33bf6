"""Fixtures of the trace tests: the shared real data (see ``_data.py``)."""

from __future__ import annotations

import logging
import shutil

import pytest

from tests.trace._data import DATA


@pytest.fixture(scope="session")
def data_dir():
    """Root of the shared test data; the test is skipped when it is not there."""
    if not DATA.is_dir():
        pytest.skip(f"shared test data not found at {DATA} (set D9D_TEST_DATA)")
    return DATA


@pytest.fixture
def hta_on(tmp_path, data_dir):
    """``hta_on(sub)`` -> (HTA's TraceAnalysis, the trace dir) on a copy of
    ``traces/<sub>`` (HTA may write beside its inputs); skips without HTA."""
    hta_ta = pytest.importorskip("hta.trace_analysis")
    logging.getLogger("hta").setLevel(logging.ERROR)

    def open_copy(sub: str):
        for f in (data_dir / "traces" / sub).iterdir():
            shutil.copy(f, tmp_path / f.name)
        return hta_ta.TraceAnalysis(trace_dir=str(tmp_path)), tmp_path

    return open_copy
