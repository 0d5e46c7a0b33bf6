"""The CLI on the shared real traces and on corrupted copies: no tracebacks, the
bad file named, JSON that parses, an HTML report that needs no network."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from d9d_kernels.trace.__main__ import main, missing_ranks

from tests.trace._data import DATA
SAMPLED = DATA / "traces" / "hta_sampled_2rank"
pytestmark = pytest.mark.skipif(not DATA.is_dir(), reason=f"shared test data not found at {DATA}")
ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "d9d_kernels.trace", *map(str, args)],
                       capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert "Traceback" not in p.stderr and "Traceback" not in p.stdout, p.stderr[-3000:]
    return p


def test_real_traces_table_json_html(tmp_path):
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    p = _cli(SAMPLED, "--json", out_json, "--html", out_html)
    assert p.returncode == 0, p.stderr
    assert "== throughput" in p.stdout and "== memory" in p.stdout and "rank1" in p.stdout
    doc = json.loads(out_json.read_text())
    assert set(doc["tools"]) == {"throughput", "communication", "memory", "overlap", "training_phases",
                                 "fsdp", "straggler", "kernel", "gpu_utilization", "idle_time", "launch",
                                 "counters", "sequences", "critical_path"}
    # JSON numbers are the trace's numbers: median ProfilerStep duration, from the raw file
    raw = json.loads(gzip.open(SAMPLED / "sampled_rank-0.json.gz").read())
    steps = [e["dur"] for e in raw["traceEvents"]
             if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")]
    m = doc["tools"]["throughput"]["ranks"]["rank0"]["step_time_median"]
    scale = {"us": 1, "ms": 1e3, "s": 1e6}[m["unit"]]
    assert m["value"] * scale == pytest.approx(statistics.median(steps), rel=1e-9)
    # world_size 128 with 2 rank files: the missing ranks are said, not hidden
    assert any("missing rank(s) 2-127" in w for w in doc["warnings"])
    page = out_html.read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?://", page), "HTML must not reference external URLs"
    assert not re.search(r"<(script|link)\b", page)
    assert len(re.findall(r"src='data:image/png;base64,[A-Za-z0-9+/=]{100,}'", page)) >= 2
    for tool in doc["tools"]:
        assert f"<h2 id='tool-{tool}'>{tool}</h2>" in page
    assert "<td title=" in page  # definitions on hover


def test_one_truncated_rank_gives_partial_result(tmp_path):
    shutil.copy(SAMPLED / "sampled_rank-0.json.gz", tmp_path)
    good = (SAMPLED / "sampled_rank-1.json.gz").read_bytes()
    bad = tmp_path / "sampled_rank-1.json.gz"
    bad.write_bytes(good[: len(good) // 3])   # truncated gzip stream
    out_json = tmp_path / "r.json"
    p = _cli(tmp_path, "--json", out_json, "--tools", "throughput,overlap,training_phases", "--progress")
    assert p.returncode == 0
    assert "parsing ranks" in p.stderr  # tqdm bar on stderr while ranks are parsed
    assert str(bad) in p.stderr
    assert len([ln for ln in p.stderr.splitlines() if str(bad) in ln]) == 1  # said once
    doc = json.loads(out_json.read_text())
    for t in ("throughput", "overlap", "training_phases"):
        assert list(doc["tools"][t]["ranks"]) == ["rank0"]
        assert str(bad) in doc["tools"][t]["errors"]


@pytest.mark.parametrize("content,what", [
    (b"", "empty"),
    (b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 2},', "truncated"),
    (b"{this is not json", "corrupt"),
    (b'{"traceEvents": [{"ph": "X", "name": "a"}]}', "ts"),           # missing fields
    (b'{"schemaVersion": 1}', "traceEvents"),
])
def test_unusable_single_trace_fails_cleanly(tmp_path, content, what):
    f = tmp_path / "rank0_trace.json"
    f.write_bytes(content)
    p = _cli(f, "--tools", "throughput,overlap")
    assert p.returncode == 1
    line = next(ln for ln in p.stderr.splitlines() if str(f) in ln)
    assert line.startswith("error: ") and what in line


def test_corrupt_gzip_bytes(tmp_path, capsys):
    f = tmp_path / "rank0_trace.json.gz"
    f.write_bytes(b"\x1f\x8b\x08\x00garbage-not-deflate")
    assert main([str(f), "--tools", "kernel,straggler", "--quiet", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert str(f) in err and "Traceback" not in err


def test_nonexistent_dir_and_unknown_tool(tmp_path):
    p = _cli(tmp_path / "nope")
    assert p.returncode == 2 and str(tmp_path / "nope") in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_unknown_tool_in_process(capsys):
    assert main([str(SAMPLED), "--tools", "throughput,bogus"]) == 2
    assert "bogus" in capsys.readouterr().err


def test_snapshot_input_and_malicious_snapshot(tmp_path, capsys):
    assert main([str(DATA / "memory" / "segments_only.pickle"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "external_fragmentation" in out and "cuda:1" in out

    # a workload dir whose snapshot would run code: memory reports it, other tools still run
    marker = tmp_path / "marker"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    wl = tmp_path / "wl"
    (wl / "profile_traces" / "iteration_10").mkdir(parents=True)
    shutil.copy(SAMPLED / "sampled_rank-0.json.gz", wl / "profile_traces" / "iteration_10" / "rank0_trace.json.gz")
    (wl / "memory_snapshot" / "iteration_10").mkdir(parents=True)
    evil = wl / "memory_snapshot" / "iteration_10" / "rank0_memory_snapshot.pickle"
    evil.write_bytes(pickle.dumps({"segments": [Evil()]}))
    out_json = tmp_path / "r.json"
    rc = main([str(wl), "--tools", "memory,throughput", "--json", str(out_json), "--quiet",
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 0
    assert not marker.exists()
    assert str(evil) in err and "refused" in err
    doc = json.loads(out_json.read_text())
    assert str(evil) in doc["tools"]["memory"]["errors"]
    assert doc["tools"]["throughput"]["ranks"]["rank0"]["num_steps"]["value"] == 2


def test_tool_crash_is_contained(monkeypatch, tmp_path, capsys):
    from d9d_kernels.trace import kernel

    def boom(*a, **k):
        raise RuntimeError("synthetic failure")

    monkeypatch.setattr(kernel, "metric_cal", boom)
    out_json = tmp_path / "r.json"
    rc = main([str(SAMPLED), "--tools", "kernel,throughput", "--json", str(out_json), "--quiet",
               "--no-progress"])
    assert rc == 0
    doc = json.loads(out_json.read_text())
    assert "synthetic failure" in json.dumps(doc["tools"]["kernel"]["errors"])
    assert doc["tools"]["throughput"]["ranks"]
    assert "Traceback" not in capsys.readouterr().err


def test_missing_ranks_message():
    assert missing_ranks([0, 1, 3], []) == ("3 rank trace(s) found, missing rank(s) 2 "
                                            "(gaps in the rank numbering)")
    assert "missing rank(s) 2-3,5" in missing_ranks([0, 1, 4], [6])
    assert missing_ranks([0, 1], [2]) is None


def test_bad_workload_card_is_one_line_usage_error(tmp_path, capsys):
    card = tmp_path / "card.yaml"
    card.write_text("batch_size: [1, 2\n")
    assert main([str(SAMPLED), "--workload-card", str(card), "--quiet", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(card) in err[0] and err[0].startswith("error: ")


def test_many_ranks_table_aggregates(tmp_path, capsys):
    from tests.trace._synth import SynthTrace

    for r in range(10):
        t = SynthTrace(rank=r, world_size=10)
        dur = 1000 + (500 if r == 7 else 10 * r)      # rank 7 is the slow one
        t.step(1, 0, dur).step(2, dur, dur)
        t.cpu("## forward ##", 10, 100, cat="user_annotation")
        t.write(tmp_path / f"rank{r}_trace.json")
    assert main([str(tmp_path), "--tools", "throughput,training_phases", "--no-progress"]) == 0
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if ln.startswith("metric") and "min" in ln)
    assert header.split() == ["metric", "min", "median", "max", "max", "at"]
    row = next(ln for ln in out.splitlines() if ln.startswith("step_time_median "))
    assert row.split()[-1] == "rank7" and "1.5 ms" in row and "1 ms" in row
