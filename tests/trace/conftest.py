"""Fixtures of the trace tests: the shared real data (see ``_data.py``)."""

from __future__ import annotations

import pytest

from tests.trace._data import DATA


@pytest.fixture(scope="session")
def data_dir():
    """Root of the shared test data; the test is skipped when it is not there."""
    if not DATA.is_dir():
        pytest.skip(f"shared test data not found at {DATA} (set D9D_TEST_DATA)")
    return DATA
