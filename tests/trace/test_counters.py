"""counters: queue length and memory bandwidth on hand-built traces with known step
functions, and against HolisticTraceAnalysis's get_queue_length_summary,
get_memory_bw_time_series and get_memory_bw_summary on the shared traces."""

from __future__ import annotations

import json

import pytest

from d9d_kernels.trace import counters
from tests.trace._synth import SynthTrace


def test_synthetic_queue(tmp_path):
    t = SynthTrace()
    for i in range(3):  # launched at 0, 1, 2; start at 10, 20, 30
        t.kernel(f"k{i}", 10 * (i + 1), 5, launch_ts=i)
    t.kernel("other_stream", 50, 5, stream=9, launch_ts=40)
    s = counters.metric_cal(t.write(tmp_path / "rank0_trace.json"))["ranks"]["rank0"]["streams"]
    q = s["stream7"]
    assert q["series"]["queue_length"] == [1, 2, 3, 2, 1, 0]
    assert q["series"]["ts_us"] == [0, 1, 2, 10, 20, 30]
    assert q["max"]["value"] == 3 and q["mean"]["value"] == 1.5 and q["median"]["value"] == 1.5
    assert q["time_weighted_mean"]["value"] == pytest.approx((1 + 2 + 3 * 8 + 2 * 10 + 1 * 10) / 30)
    assert s["stream9"]["max"]["value"] == 1


def test_series_capped(tmp_path):
    t = SynthTrace()
    for i in range(50):
        t.kernel("k", 1000 + 10 * i, 5, launch_ts=i)
    r = counters.metric_cal(t.write(tmp_path / "rank0_trace.json"), max_points=10)
    q = r["ranks"]["rank0"]["streams"]["stream7"]
    assert len(q["series"]["ts_us"]) == 10 and q["changes"]["value"] == 100
    assert q["max"]["value"] == 50  # statistics use every point


@pytest.mark.parametrize("sub", ["hta_sampled_2rank", "nccl_rank0_of2", "amd_mi250"])
def test_matches_hta(hta_on, sub):
    ta, tmp_path = hta_on(sub)
    ref = ta.get_queue_length_summary(ranks=list(ta.t.traces))
    ours = counters.metric_cal(tmp_path)["ranks"]
    assert len(ref) >= 1
    for (rank, stream), row in ref.iterrows():
        m = ours[f"rank{rank}"]["streams"][f"stream{int(stream)}"]
        assert m["changes"]["value"] == row[("queue_length", "count")]
        assert m["max"]["value"] == row[("queue_length", "max")]
        assert m["median"]["value"] == row[("queue_length", "50%")]
        assert m["mean"]["value"] == pytest.approx(row[("queue_length", "mean")], rel=0.01)


# ----------------------------------------------------------------------------- memory bandwidth
def _memop(t, name, ts, dur, gbps=None, nbytes=None, stream=7, cat="gpu_memcpy"):
    args = {}
    if gbps is not None:
        args["memory bandwidth (GB/s)"] = gbps
    if nbytes is not None:
        args["bytes"] = nbytes
    t.kernel(name, ts, dur, stream=stream, cat=cat, **args)


def test_synthetic_memory_bw(tmp_path):
    t = SynthTrace()
    # DtoD: [10, 20) at 100 GB/s and [15, 25) at 50 GB/s overlap -> 100, 150, 50, 0
    _memop(t, "Memcpy DtoD (Device -> Device)", 10, 10, gbps=100.0, nbytes=1000)
    _memop(t, "Memcpy DtoD (Device -> Device)", 15, 10, gbps=50.0, nbytes=500, stream=9)
    # HtoD without a bandwidth arg: bytes / dur = 4e3 B / 2 us = 2 GB/s
    _memop(t, "Memcpy HtoD (Pinned -> Device)", 30, 2, nbytes=4000)
    # zero-length memset ends 1 us after it starts (HTA's rule)
    _memop(t, "Memset (Device)", 40, 0, gbps=7.0, cat="gpu_memset")
    # dma* copies are HTA's "Memcpy Unknown"; an ordinary kernel is not a memory op
    _memop(t, "dma_copy_kernel", 50, 4, gbps=3.0)
    t.kernel("gemm", 60, 5)
    r = counters.metric_cal(t.write(tmp_path / "rank0_trace.json"))
    m = r["ranks"]["rank0"]["memory_bw"]
    assert sorted(m) == ["Memcpy DtoD", "Memcpy HtoD", "Memcpy Unknown", "Memset"]
    d = m["Memcpy DtoD"]
    assert d["series"]["ts_us"] == [10, 15, 20, 25]
    assert d["series"]["gbps"] == [100.0, 150.0, 50.0, 0.0]
    assert d["max"]["value"] == 150.0 and d["min"]["value"] == 50.0 and d["points"]["value"] == 3
    assert d["mean"]["value"] == pytest.approx(100.0) and d["median"]["value"] == 100.0
    assert d["time_weighted_mean"]["value"] == pytest.approx((100 * 5 + 150 * 5 + 50 * 5) / 15)
    assert d["ops"]["value"] == 2 and d["bytes"]["value"] == 1500
    h = m["Memcpy HtoD"]
    assert h["max"]["value"] == pytest.approx(2.0) and h["series"]["ts_us"] == [30, 32]
    s = m["Memset"]
    assert s["series"]["ts_us"] == [40, 41] and s["max"]["value"] == 7.0 and s["bytes"]["value"] is None
    assert m["Memcpy Unknown"]["max"]["value"] == 3.0
    assert r["summary"]["peak_memory_bw"]["Memcpy DtoD"]["value"] == 150.0
    assert r["summary"]["memory_bytes"]["Memcpy DtoD"]["value"] == 1500


def test_no_memory_ops_noted(tmp_path):
    t = SynthTrace()
    t.kernel("gemm", 10, 5)
    r = counters.metric_cal(t.write(tmp_path / "rank0_trace.json"))
    assert r["ranks"]["rank0"]["memory_bw"] == {}
    assert "peak_memory_bw" not in r["summary"]
    assert any("no memcpy/memset" in n for n in r["notes"])


@pytest.mark.parametrize("sub", ["hta_sampled_2rank", "nccl_rank0_of2", "amd_mi250"])
def test_memory_bw_matches_hta(hta_on, sub):
    ta, tmp_path = hta_on(sub)
    ranks = list(ta.t.traces)
    ours = counters.metric_cal(tmp_path)["ranks"]
    series = ta.get_memory_bw_time_series(ranks=ranks)
    for rank, df in series.items():
        mine = ours[f"rank{rank}"]["memory_bw"]
        assert sorted(mine) == sorted(df["name"].unique())
        for kind, g in df.groupby("name"):
            assert mine[kind]["ops"]["value"] * 2 == len(g)
            assert mine[kind]["max"]["value"] == pytest.approx(max(g["memory_bw_gbps"].max(), 0) or None)
    ref = ta.get_memory_bw_summary(ranks=ranks)
    if ref is None or len(ref) == 0:  # amd_mi250: no bandwidth args, every point is 0
        for rank in ranks:
            assert all(m["points"]["value"] == 0 for m in ours[f"rank{rank}"]["memory_bw"].values())
        return
    for (rank, kind), row in ref.iterrows():
        m = ours[f"rank{rank}"]["memory_bw"][kind]
        assert m["points"]["value"] == row[("memory_bw_gbps", "count")]
        for ours_key, hta_key in (("max", "max"), ("min", "min"), ("mean", "mean"), ("median", "50%")):
            assert m[ours_key]["value"] == pytest.approx(row[("memory_bw_gbps", hta_key)], rel=1e-9)


def test_cli_text_json_html(tmp_path, capsys):
    from d9d_kernels.trace.__main__ import main

    t = SynthTrace()
    _memop(t, "Memcpy DtoD (Device -> Device)", 10, 10, gbps=100.0, nbytes=1000)
    t.kernel("gemm", 30, 5, launch_ts=1)
    path = t.write(tmp_path / "in" / "rank0_trace.json")
    out_json, out_html = tmp_path / "r.json", tmp_path / "r.html"
    assert main([str(path), "--tools", "counters", "--json", str(out_json), "--html", str(out_html),
                 "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "memory_bw.Memcpy DtoD.max" in text and "100 GB/s" in text
    doc = json.loads(out_json.read_text())
    m = doc["tools"]["counters"]["ranks"]["rank0"]["memory_bw"]["Memcpy DtoD"]
    assert m["series"]["gbps"] == [100.0, 0.0] and m["max"]["unit"] == "GB/s"
    page = out_html.read_text()
    assert "alt='Memory bandwidth'" in page and "alt='Queue length'" in page
