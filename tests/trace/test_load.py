"""Workload discovery, parsing, bad-input errors, interval helpers."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from d9d_kernels.trace import _intervals as iv
from d9d_kernels.trace._load import (
    KIND_KERNEL,
    KIND_MEMCPY,
    KIND_MEMSET,
    KIND_PROFILER_STEP,
    TraceError,
    find_workload,
    load_rank,
    load_ranks,
)
from tests.trace._synth import SynthTrace
from tests.trace._torch_traces import gloo_workload

from tests.trace._data import TRACES as DATA
needs_data = pytest.mark.skipif(not DATA.exists(), reason="shared trace data not available")


def _raw_events(path):
    op = gzip.open if str(path).endswith(".gz") else open
    with op(path, "rt") as fh:
        return json.load(fh)["traceEvents"]


# ----------------------------------------------------------------------------- discovery
def test_torchtitan_layout_discovery(tmp_path):
    root = tmp_path / "run"
    for it in (10, 20):
        for r in (0, 1):
            SynthTrace(rank=r, world_size=2).kernel("k", 0, 1).write(
                root / "profile_traces" / f"iteration_{it}" / f"rank{r}_trace.json.gz")
            p = root / "memory_snapshot" / f"iteration_{it}" / f"rank{r}_memory_snapshot.pickle"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(b"x")
    (root / "workload_card.yaml").write_text("batch_size: 2\nseq_len: 8\n")
    wl = find_workload(root)
    assert sorted(wl.traces) == [0, 1]
    assert all("iteration_20" in str(p) for p in wl.traces.values())  # latest iteration
    assert sorted(wl.memory_snapshots) == [0, 1]
    assert all("iteration_20" in str(p) for p in wl.memory_snapshots.values())
    assert wl.card == {"batch_size": 2, "seq_len": 8}
    assert wl.iteration == 20


def test_rank_from_distributed_info_beats_file_name(tmp_path):
    # file names say rank 0/1 but the traces say 5/7
    a = SynthTrace(rank=7, world_size=8).kernel("k", 0, 1).write(tmp_path / "rank0.json")
    b = SynthTrace(rank=5, world_size=8).kernel("k", 0, 1).write(tmp_path / "rank1.json.gz")
    wl = find_workload([a, b])
    assert wl.traces == {7: a, 5: b}


def test_rank_from_file_name_and_order(tmp_path):
    for name in ("trace_rank-3.json", "x.json"):
        (tmp_path / name).write_text(json.dumps({"traceEvents": [
            {"ph": "X", "cat": "cpu_op", "name": "a", "ts": 0, "dur": 1, "pid": 1, "tid": 1}]}))
    wl = find_workload(tmp_path)
    assert wl.traces[3].name == "trace_rank-3.json"
    assert wl.traces[0].name == "x.json"
    assert any("assigned rank 0" in n for n in wl.notes)


def test_generated_gloo_workload_discovered_and_parsed():
    root = gloo_workload()
    wl = find_workload(root)
    assert sorted(wl.traces) == [0, 1]
    assert wl.traces[1].name.endswith(".json.gz")
    assert wl.card["batch_size"] == 4
    ranks = load_ranks(wl, parallel=True, progress=False)
    for r, rt in ranks.items():
        raw = _raw_events(wl.traces[r])
        assert rt.rank == r
        assert len(rt) == sum(e.get("ph") == "X" for e in raw)
        steps = sorted(int(e["name"].split("#")[1]) for e in raw
                       if e.get("ph") == "X" and e["name"].startswith("ProfilerStep#"))
        assert rt.steps[0].tolist() == steps and len(steps) == 3
        # gloo all_reduce ranges are the collectives, with their shapes captured
        gloo = [e for e in raw if e.get("name") == "gloo:all_reduce"]
        comm_rows = [i for i in np.flatnonzero(rt.is_comm) if rt.names[rt.name_id[i]] == "gloo:all_reduce"]
        assert len(comm_rows) == len(gloo) == 3
        assert all(rt.comm_args[int(i)]["Input Dims"] == [[1000]] for i in comm_rows)


@needs_data
@pytest.mark.parametrize("sub", ["hta_sampled_2rank", "nccl_rank0_of2", "amd_mi250", "cpu_only"])
def test_real_trace_columns_match_raw_json(sub):
    wl = find_workload(DATA / sub)
    for r, rt in load_ranks(wl, parallel=False).items():
        raw = [e for e in _raw_events(wl.traces[r]) if e.get("ph") == "X"]
        assert len(rt) == len(raw)
        np.testing.assert_array_equal(rt.ts, [float(e["ts"]) for e in raw])
        for kind, cat in ((KIND_KERNEL, "kernel"), (KIND_MEMCPY, "gpu_memcpy"), (KIND_MEMSET, "gpu_memset")):
            assert (rt.kind == kind).sum() == sum(e["cat"] == cat for e in raw)
        assert (rt.kind == KIND_PROFILER_STEP).sum() == sum(
            e["name"].startswith("ProfilerStep#") and e["cat"] != "gpu_user_annotation" for e in raw)
        nccl = sum(e["cat"] == "kernel" and e["name"].startswith("nccl") for e in raw)
        assert (rt.is_comm & (rt.kind == KIND_KERNEL)).sum() == nccl


@needs_data
def test_msgspec_and_stdlib_paths_agree():
    pytest.importorskip("msgspec")
    files = sorted(DATA.glob("*/*.json.gz")) + sorted(find_workload(gloo_workload()).traces.values())
    for f in files:
        a, b = load_rank(f, fast=True), load_rank(f, fast=False)
        for col in ("name_id", "cat_id", "kind", "ts", "dur", "pid", "tid", "stream", "device",
                    "correlation", "external_id", "is_comm", "nbytes", "mem_bw"):
            np.testing.assert_array_equal(getattr(a, col), getattr(b, col), err_msg=f"{f}: {col}")
        assert a.names == b.names and a.cats == b.cats and a.comm_args == b.comm_args
        assert a.distributed_info == b.distributed_info and a.device_properties == b.device_properties


# ----------------------------------------------------------------------------- bad input
@pytest.fixture(params=[True, False], ids=["msgspec", "stdlib"])
def fast(request):
    return request.param


def _good(tmp_path):
    return SynthTrace().kernel("k", 0, 1).write(tmp_path / "rank0_trace.json")


def test_truncated_json_names_file(tmp_path, fast):
    p = _good(tmp_path)
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError) as ei:
        load_rank(p, fast=fast)
    assert ei.value.file == str(p) and "truncated" in ei.value.reason


def test_truncated_gzip_names_file(tmp_path, fast):
    p = SynthTrace().kernel("k", 0, 1).write(tmp_path / "rank0_trace.json.gz")
    data = p.read_bytes()
    p.write_bytes(data[: len(data) - 12])
    with pytest.raises(TraceError) as ei:
        load_rank(p, fast=fast)
    assert str(p) in str(ei.value)


def test_corrupt_json(tmp_path, fast):
    p = tmp_path / "rank0_trace.json"
    p.write_text('{"traceEvents": [ {"ph": "X", oops} ], "schemaVersion": 1}')
    with pytest.raises(TraceError, match="corrupt JSON"):
        load_rank(p, fast=fast)


@pytest.mark.parametrize("text,reason", [
    ("", "empty file"),
    ('{"schemaVersion": 1}', "no 'traceEvents'"),
    ('{"traceEvents": []}', "empty trace"),
    ('{"traceEvents": [{"ph": "X", "name": "a", "dur": 1}]}', "lack a numeric 'ts'"),
])
def test_missing_fields_and_empty(tmp_path, fast, text, reason):
    p = tmp_path / "rank0_trace.json"
    p.write_text(text)
    with pytest.raises(TraceError, match=reason):
        load_rank(p, fast=fast)


def test_bad_rank_collected_not_raised(tmp_path):
    good = _good(tmp_path)
    bad = tmp_path / "rank1_trace.json"
    bad.write_text('{"traceEvents": [')
    wl = find_workload(tmp_path)
    errors: dict = {}
    ranks = load_ranks(wl, parallel=True, errors=errors)
    assert list(ranks) == [0] and ranks[0].path == str(good)
    assert list(errors) == [str(bad)] and "truncated" in errors[str(bad)]
    with pytest.raises(TraceError):
        load_ranks(wl, parallel=False)


def test_missing_path_and_no_traces(tmp_path):
    with pytest.raises(TraceError, match="no such file"):
        find_workload(tmp_path / "nope")
    with pytest.raises(TraceError, match="no .json"):
        find_workload(tmp_path)


def test_tool_reports_bad_rank_as_error(tmp_path):
    from d9d_kernels.trace import overlap

    _good(tmp_path)
    (tmp_path / "rank1_trace.json").write_text("not json")
    res = overlap.metric_cal(tmp_path, step_filter="all")
    assert list(res["ranks"]) == ["rank0"]
    assert str(tmp_path / "rank1_trace.json") in res["errors"]


# ----------------------------------------------------------------------------- intervals
def _brute(ivs, lo=0, hi=60):
    grid = np.zeros(hi - lo, dtype=bool)
    for s, e in ivs:
        grid[s - lo:e - lo] = True
    return grid


interval_lists = st.lists(st.tuples(st.integers(0, 50), st.integers(0, 10)).map(lambda t: (t[0], t[0] + t[1])),
                          max_size=12)


@settings(max_examples=200, deadline=None)
@given(interval_lists, interval_lists)
def test_intervals_match_unit_grid(a, b):
    # integer endpoints: the union/intersection lengths are the counts of covered unit cells
    ga, gb = _brute(a), _brute(b)
    A = (np.array([s for s, _ in a], float), np.array([e for _, e in a], float))
    B = (np.array([s for s, _ in b], float), np.array([e for _, e in b], float))
    assert iv.total(*A) == ga.sum()
    assert iv.intersection_length(A, B) == (ga & gb).sum()
    assert iv.subtract_length(A, B) == (ga & ~gb).sum()
    s, e = iv.union(*A)
    assert np.all(s[1:] > e[:-1])  # disjoint, sorted, non-touching


def test_tool_cache_sees_rewritten_file(tmp_path):
    from d9d_kernels.trace import overlap

    p = SynthTrace().kernel("sgemm", 0, 100).write(tmp_path / "rank0_trace.json")
    assert overlap.metric_cal(tmp_path, step_filter="all")["ranks"]["rank0"]["busy_time"]["value"] == 100
    SynthTrace().kernel("sgemm", 0, 2500).write(p)  # same dir, same name: new mtime and size
    assert overlap.metric_cal(tmp_path, step_filter="all")["ranks"]["rank0"]["busy_time"]["value"] == 2500
