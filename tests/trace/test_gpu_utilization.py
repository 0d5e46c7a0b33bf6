"""Busy/idle per device and stream over GPU time only."""

from __future__ import annotations

import pytest

from d9d_kernels.trace import gpu_utilization
from tests.trace._synth import SynthTrace
from tests.trace._torch_traces import gloo_workload


def test_devices_and_streams_by_construction(tmp_path):
    t = SynthTrace()
    t.cpu("aten::something", 0, 5000)  # CPU time before/after the kernels must not count
    # device 0: stream 7 [1000,1100) + [1300,1400); stream 8 [1050,1150) -> window 400, busy 250
    t.kernel("sgemm", 1000, 100, stream=7, device=0)
    t.kernel("sgemm", 1300, 100, stream=7, device=0)
    t.kernel("sgemm", 1050, 100, stream=8, device=0)
    # device 1: one kernel -> 100% busy
    t.kernel("sgemm", 2000, 10, stream=7, device=1)
    res = gpu_utilization.metric_cal(t.write(tmp_path / "rank0.json"), step_filter="all")
    d0 = res["ranks"]["rank0"]["devices"]["device0"]
    assert d0["window"]["value"] == 400
    assert d0["busy_time"]["value"] == 250 and d0["idle_time"]["value"] == 150
    assert d0["utilization_pct"]["value"] == pytest.approx(62.5)
    assert d0["streams"]["stream7"]["busy_time"]["value"] == 200
    assert d0["streams"]["stream7"]["busy_pct"]["value"] == pytest.approx(50.0)
    assert d0["streams"]["stream8"]["events"]["value"] == 1
    d1 = res["ranks"]["rank0"]["devices"]["device1"]
    assert d1["utilization_pct"]["value"] == pytest.approx(100.0)
    assert res["summary"]["min_utilization_pct"]["value"] == pytest.approx(62.5)


def test_cpu_only_trace_has_no_devices():
    res = gpu_utilization.metric_cal(gloo_workload())
    assert all(v["mode"] == "cpu" and "devices" not in v for v in res["ranks"].values())
