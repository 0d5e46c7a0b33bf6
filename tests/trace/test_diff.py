"""diff: two hand-built runs with known per-op changes, the CLI, and HTA's
TraceDiff.compare_traces on the shared 2-rank trace (rank 0 vs rank 1)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest

from d9d_kernels.trace import diff
from d9d_kernels.trace.__main__ import main
from tests.trace._synth import SynthTrace


def _run(path, gemm_us, n_relu, steps=3):
    t = SynthTrace()
    for i in range(steps):
        s = 1000 * i
        t.step(i + 1, s, 1000)
        t.cpu("aten::mm", s + 10, 20)
        t.kernel("gemm_kernel", s + 100, gemm_us, launch_ts=s + 15)
        for j in range(n_relu):
            t.kernel("relu_kernel", s + 400 + 20 * j, 10, launch_ts=s + 40 + j)
    return t.write(path)


def test_known_changes(tmp_path):
    a = _run(tmp_path / "a" / "rank0_trace.json", gemm_us=100, n_relu=2)
    b = _run(tmp_path / "b" / "rank0_trace.json", gemm_us=160, n_relu=3, steps=4)
    r = diff.compare(a, b, steps="all")
    gpu = r["ops"]["gpu"]
    assert list(gpu) == ["gemm_kernel", "relu_kernel"]  # largest regression first
    g = gpu["gemm_kernel"]
    assert (g["time_a"]["value"], g["time_b"]["value"], g["time_change"]["value"]) == (100, 160, 60)
    assert g["time_change_pct"]["value"] == pytest.approx(60)
    rl = gpu["relu_kernel"]
    assert (rl["count_a"]["value"], rl["count_b"]["value"], rl["count_change"]["value"]) == (2, 3, 1)
    assert rl["time_change"]["value"] == 10
    assert r["ops"]["cpu"]["aten::mm"]["time_change"]["value"] == 0
    assert r["summary"]["num_steps_a"]["value"] == 3 and r["summary"]["num_steps_b"]["value"] == 4
    assert r["summary"]["gpu_time_change"]["value"] == 70
    # default 'hta' filter: GPU work of the last step dropped, per-step figures unchanged
    h = diff.compare(a, b)["ops"]["gpu"]["gemm_kernel"]
    assert (h["time_a"]["value"], h["time_b"]["value"]) == (100, 160)
    # one step window
    w = diff.compare(a, b, steps="2:2")["ops"]["gpu"]["relu_kernel"]
    assert (w["count_a"]["value"], w["count_b"]["value"]) == (2, 3)


def test_cli(tmp_path, capsys):
    a = _run(tmp_path / "a" / "rank0_trace.json", gemm_us=100, n_relu=2)
    b = _run(tmp_path / "b" / "rank0_trace.json", gemm_us=160, n_relu=2)
    out = tmp_path / "d.json"
    assert main(["diff", str(a), str(b), "--json", str(out), "--html", str(tmp_path / "d.html")]) == 0
    txt = capsys.readouterr().out
    assert "gpu regressions" in txt and txt.index("gemm_kernel") < txt.index("note:")
    doc = json.loads(out.read_text())
    assert doc["ops"]["gpu"]["gemm_kernel"]["time_change"]["value"] == 60
    assert "gemm_kernel" in (tmp_path / "d.html").read_text()
    assert main(["diff", str(a), str(tmp_path / "missing")]) == 2


hta_diff = pytest.importorskip("hta.trace_diff")


def test_matches_hta_trace_diff(tmp_path, data_dir):
    logging.getLogger("hta").setLevel(logging.ERROR)
    src = data_dir / "traces" / "hta_sampled_2rank"
    da, db = tmp_path / "a", tmp_path / "b"
    da.mkdir()
    db.mkdir()
    shutil.copy(src / "sampled_rank-0.json.gz", da)
    shutil.copy(src / "sampled_rank-1.json.gz", db)
    A = hta_diff.LabeledTrace("A", trace_dir=str(da))
    B = hta_diff.LabeledTrace("B", trace_dir=str(db))
    ref = hta_diff.TraceDiff.compare_traces(A, B, control_iteration=551, test_iteration=551)
    ours = diff.compare(da, db, steps="551:551")
    merged = {}
    for ops in ours["ops"].values():
        for n, m in ops.items():
            x = merged.setdefault(n, [0, 0, 0.0, 0.0])
            for i, k in enumerate(("count_a", "count_b", "time_a", "time_b")):
                x[i] += m[k]["value"]
    assert set(merged) == set(ref.index)
    for name, row in ref.iterrows():
        ca, cb, ta, tb = merged[name]
        assert (ca, cb) == (row["A_counts"], row["B_counts"]), name
        assert ta == pytest.approx(row["A_total_duration"], rel=0.01, abs=1)
        assert tb == pytest.approx(row["B_total_duration"], rel=0.01, abs=1)
