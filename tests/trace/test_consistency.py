"""One step filter for every tool, honest names, warnings for impossible values,
mixed jobs refused, snapshot input runs only ``memory``."""

from __future__ import annotations

import json
import shutil

import pytest

from d9d_kernels.trace import communication, kernel, overlap, throughput, training_phases
from d9d_kernels.trace.__main__ import TOOLS, main
from d9d_kernels.trace._common import parse_steps
from d9d_kernels.trace._result import impossible_values, metric, result
from d9d_kernels.trace.report import text_report
from tests.trace._synth import SynthTrace, nccl_args

LONG = "k" * 100 + "_end"


def _three_steps(tmp_path, name="rank0_trace.json", rank=0, world=1):
    """Steps 1..3 of 1000 us; each launches one 100 us kernel and one 10 us NCCL all_reduce."""
    t = SynthTrace(rank=rank, world_size=world)
    for i, s in enumerate((0, 1000, 2000)):
        t.step(i + 1, s, 1000)
        t.kernel(LONG, s + 100, 100, launch_ts=s + 10)
        t.kernel("ncclDevKernel_AllReduce_Sum_f32", s + 300, 10, stream=9, launch_ts=s + 20,
                 **nccl_args("allreduce", 1024))
    return t.write(tmp_path / name)


def test_parse_steps():
    assert parse_steps("hta") == "hta" and parse_steps("all") == "all"
    assert parse_steps("2:5") == (2, 5) and parse_steps("4") == (4, 4)
    for bad in ("5:2", "x", "1:2:3"):
        with pytest.raises(ValueError, match="steps"):
            parse_steps(bad)


@pytest.mark.parametrize("steps,n_coll,kernel_us", [("hta", 2, 200), ("all", 3, 300), ("2:3", 2, 200),
                                                   ("1:1", 1, 100)])
def test_every_tool_uses_the_same_filter(tmp_path, steps, n_coll, kernel_us):
    f = _three_steps(tmp_path)
    comm = communication.metric_cal(f, steps=steps)
    coll = comm["ranks"]["rank0"]
    counts = [m["count"]["value"] for m in coll["by_type"].values()] if "by_type" in coll else None
    ov = overlap.metric_cal(f, steps=steps)
    kr = kernel.metric_cal(f, steps=steps)
    note = {"hta": "step filter 'hta'", "all": "step filter 'all'", "2:3": "step filter 2:3",
            "1:1": "step filter 1:1"}[steps]
    for res in (comm, ov, kr, throughput.metric_cal(f, steps=steps),
                training_phases.metric_cal(f, steps=steps)):
        assert any(note in n for n in res["notes"]), (res["tool"], res["notes"])
    assert ov["ranks"]["rank0"]["comm_time"]["value"] == pytest.approx(10 * n_coll)
    ours = json.dumps(comm)
    assert f'"value": {n_coll}' in ours, counts
    assert kr["ranks"]["rank0"]["by_class"]["other"]["time"]["value"] == pytest.approx(kernel_us)


@pytest.mark.parametrize("tool", TOOLS)
def test_every_section_names_the_step_filter(tmp_path, tool):
    import importlib

    f = _three_steps(tmp_path)
    res = importlib.import_module(f"d9d_kernels.trace.{tool}").metric_cal(f, steps="2:3")
    assert any("step filter" in n for n in res["notes"]), (tool, res["notes"])


def test_steps_out_of_range_is_an_error(tmp_path):
    f = _three_steps(tmp_path)
    with pytest.raises(Exception, match="7:9.*steps present: 1..3"):
        overlap.metric_cal(f, steps="7:9")


def test_cli_steps_out_of_range_exits_1(tmp_path, capsys):
    f = _three_steps(tmp_path)
    assert main([str(f), "--steps", "7:9", "--no-progress", "--quiet"]) == 1
    assert "steps present: 1-3" in capsys.readouterr().err
    assert main([str(f), "--steps", "9:7", "--no-progress", "--quiet"]) == 2
    assert main([str(f), "--steps", "2:3", "--no-progress", "--quiet"]) == 0


def test_training_phases_names_total_and_mean(tmp_path):
    f = _three_steps(tmp_path)
    tp = training_phases.metric_cal(f)["ranks"]["rank0"]
    assert "step_time" not in tp
    assert tp["step_time_total"]["value"] == pytest.approx(3000)
    assert tp["step_time_mean"]["value"] == pytest.approx(1000)
    th = throughput.metric_cal(f)["ranks"]["rank0"]
    assert th["step_time_median"]["value"] == pytest.approx(1.0)  # ms


def test_labels_whole_in_json_ellipsis_in_text(tmp_path):
    f = _three_steps(tmp_path)
    out = tmp_path / "r.json"
    assert main([str(f), "--tools", "kernel", "--json", str(out), "--quiet"]) == 0
    assert LONG in out.read_text()
    # a label as a row key (per-kernel / per-group tables): cut, with a visible ellipsis
    res = result("x", ranks={"rank0": {LONG: metric(1.0, "us", "d")}})
    txt = text_report({"x": res})
    assert LONG not in txt and "k" * 59 + "\u2026" in txt


def test_impossible_values_warned():
    node = {"rank0": {"mfu_pct": {"value": 141.6, "unit": "%", "definition": ""},
                      "idle_time": {"value": -3.0, "unit": "us", "definition": ""},
                      "time_change": {"value": -3.0, "unit": "us", "definition": ""},
                      "step_time_spread_pct": {"value": 150.0, "unit": "%", "definition": ""}}}
    w = impossible_values("t", node)
    assert len(w) == 2
    assert "mfu_pct = 141.6 %" in w[0] and "negative duration" in w[1]


def test_mfu_over_100_warned_everywhere(tmp_path, capsys):
    f = _three_steps(tmp_path)
    card = tmp_path / "card.yaml"
    card.write_text("tokens_per_step: 1000\nflops_per_token: 1.0e12\npeak_flops: 1.0e12\nbatch: 4\n")
    res = throughput.metric_cal(f, workload_card_path=card)
    assert res["ranks"]["rank0"]["mfu_pct"]["value"] > 100
    assert any("mfu_pct" in w and "impossible" in w for w in res["warnings"])
    assert any("unknown key(s) batch" in w and "batch_size" in w for w in res["warnings"])
    out, html = tmp_path / "r.json", tmp_path / "r.html"
    assert main([str(f), "--tools", "throughput", "--workload-card", str(card), "--json", str(out),
                 "--html", str(html), "--no-progress"]) == 0
    cap = capsys.readouterr()
    assert "WARNING: throughput: rank0.mfu_pct" in cap.out and "warning: throughput" in cap.err
    doc = json.loads(out.read_text())
    assert any("mfu_pct" in w for w in doc["warnings"])
    assert any("mfu_pct" in w for w in doc["tools"]["throughput"]["warnings"])
    assert "mfu_pct = " in html.read_text()


def test_mixed_jobs_refused(tmp_path, capsys):
    d = tmp_path / "mixed"
    _three_steps(d, "rank0_trace.json", rank=0, world=2)
    t = SynthTrace(rank=1, world_size=8)
    t.step(1, 0, 10).kernel("x", 1, 2)
    t.write(d / "rank1_trace.json")
    assert main([str(d), "--tools", "overlap", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "2 different jobs" in err and "world_size 2" in err and "world_size 8" in err
    assert "--allow-mixed" in err
    assert main([str(d), "--tools", "overlap", "--no-progress", "--allow-mixed"]) == 0


def test_same_job_start_times_far_apart_refused(tmp_path, capsys):
    d = tmp_path / "runs"
    a = _three_steps(d, "rank0_trace.json", rank=0, world=2)
    t = SynthTrace(rank=1, world_size=2)
    t.step(1, 5e12, 10).kernel("x", 5e12 + 1, 2)
    t.write(d / "rank1_trace.json")
    assert a.exists()
    assert main([str(d), "--tools", "overlap", "--no-progress"]) == 1
    assert "2 different jobs" in capsys.readouterr().err


def test_real_mixed_directory_refused(tmp_path, data_dir, capsys):
    for f in (data_dir / "traces").rglob("*.json.gz"):
        shutil.copy(f, tmp_path / f.name)
    assert main([str(tmp_path), "--no-progress", "--quiet"]) == 1
    assert "4 different jobs" in capsys.readouterr().err


def test_snapshot_runs_only_memory_once(data_dir, capsys):
    out = data_dir / "memory" / "segments_only.pickle"
    assert main([str(out), "--no-progress"]) == 0
    cap = capsys.readouterr()
    assert cap.err.count("only the memory tool runs") == 1
    for t in TOOLS:
        if t != "memory":
            assert f"== {t} " not in cap.out
    assert "== memory " in cap.out
