"""Where the shared test data lives: ``$D9D_TEST_DATA``, else ``<repo>/../shared/data``
(a checkout next to ``shared/``), else ``<repo>/../../shared/data`` (a worktree one level
further down, e.g. ``wt/<name>``)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def data_root() -> Path:
    env = os.environ.get("D9D_TEST_DATA")
    if env:
        return Path(env)
    for cand in (REPO.parent / "shared" / "data", REPO.parent.parent / "shared" / "data"):
        if cand.is_dir():
            return cand
    return REPO.parent / "shared" / "data"


DATA = data_root()
TRACES = DATA / "traces"
SNAPSHOT = DATA / "memory" / "segments_only.pickle"
