"""Overlap, exposed communication and idle time on traces built by hand."""

from __future__ import annotations

import pytest

from d9d_kernels.trace import overlap
from tests.trace._synth import SynthTrace
from tests.trace._torch_traces import gloo_workload

NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)"


def _write(tmp_path, t):
    return t.write(tmp_path / "rank0_trace.json")


def test_breakdown_by_construction(tmp_path):
    # timeline (us): gemm [0,100) on stream 7, nccl [50,150) on stream 20, idle [150,200),
    # memcpy [200,210), elementwise [210,250)  -> span 250
    t = SynthTrace()
    t.kernel("sgemm_128x64", 0, 100)
    t.kernel(NCCL, 50, 100, stream=20)
    t.kernel("Memcpy HtoD (Pageable -> Device)", 200, 10, cat="gpu_memcpy")
    t.kernel("vectorized_elementwise_kernel", 210, 40)
    r = overlap.metric_cal(_write(tmp_path, t), step_filter="all")["ranks"]["rank0"]
    v = {k: m["value"] for k, m in r.items() if isinstance(m, dict) and "value" in m}
    assert v["gpu_span"] == 250
    assert v["busy_time"] == 200 and v["idle_time"] == 50
    assert v["compute_time"] == 140  # gemm + elementwise
    assert v["non_compute_time"] == 60  # comm not under compute (50) + memcpy (10)
    assert v["comm_time"] == 100 and v["overlap_time"] == 50
    assert v["overlap_pct"] == pytest.approx(50.0)
    assert v["exposed_comm_time"] == 50
    assert v["idle_pct"] == pytest.approx(20.0)
    assert v["compute_pct"] + v["non_compute_pct"] + v["idle_pct"] == pytest.approx(100.0)


def test_concurrent_compute_counted_once(tmp_path):
    t = SynthTrace()
    t.kernel("sgemm", 0, 100, stream=7)
    t.kernel("sgemm", 0, 100, stream=8)  # same interval on a second stream
    t.kernel(NCCL, 0, 100, stream=20)
    r = overlap.metric_cal(_write(tmp_path, t), step_filter="all")["ranks"]["rank0"]
    assert r["compute_time"]["value"] == 100
    assert r["overlap_pct"]["value"] == pytest.approx(100.0)
    assert r["exposed_comm_time"]["value"] == 0


def test_last_step_dropped_like_hta(tmp_path):
    # 3 steps; the kernel launched in the last step is dropped by the default filter
    t = SynthTrace()
    for n, s in ((1, 0), (2, 1000), (3, 2000)):
        t.step(n, s, 1000)
    t.kernel("sgemm", 100, 100, launch_ts=50)
    t.kernel("sgemm", 1100, 100, launch_ts=1050)
    t.kernel("sgemm", 2100, 700, launch_ts=2050)  # launched in ProfilerStep#3
    p = _write(tmp_path, t)
    kept = overlap.metric_cal(p)["ranks"]["rank0"]
    assert kept["gpu_span"]["value"] == 1100 and kept["busy_time"]["value"] == 200
    every = overlap.metric_cal(p, step_filter="all")["ranks"]["rank0"]
    assert every["gpu_span"]["value"] == 2700 and every["busy_time"]["value"] == 900


def test_hta_rounding_vs_exact(tmp_path):
    t = SynthTrace()
    t.kernel("sgemm", 0.4, 10.2)   # hta: [1, 10) -> 9 us ; exact 10.2 us
    t.kernel("sgemm", 20.0, 5.0)
    p = _write(tmp_path, t)
    assert overlap.metric_cal(p, step_filter="all")["ranks"]["rank0"]["busy_time"]["value"] == 14
    exact = overlap.metric_cal(p, step_filter="all", rounding="exact")["ranks"]["rank0"]
    assert exact["busy_time"]["value"] == pytest.approx(15.2)


def test_cpu_mode_gloo():
    res = overlap.metric_cal(gloo_workload())
    for r in ("rank0", "rank1"):
        m = res["ranks"][r]
        assert m["mode"] == "cpu"
        assert 0 <= m["overlap_time"]["value"] <= m["comm_time"]["value"]
        assert m["exposed_comm_time"]["value"] == pytest.approx(
            m["comm_time"]["value"] - m["overlap_time"]["value"])
    # rank 0 waits ~lag inside every all_reduce: more communication time than rank 1
    assert res["ranks"]["rank0"]["comm_time"]["value"] > res["ranks"]["rank1"]["comm_time"]["value"]


def test_profile_mode(tmp_path):
    t = SynthTrace()
    t.kernel("sgemm", 0, 100)
    t.cpu("record_param_comms", 10, 20, **{"Collective name": "allreduce", "In msg nelems": 4,
                                           "Out msg nelems": 4, "dtype": "Float", "Group size": 2})
    t.cpu("aten::mm", 0, 100, tid=7)
    p = _write(tmp_path, t)
    assert overlap.metric_cal(p)["ranks"]["rank0"]["mode"] == "gpu"
    cpu = overlap.metric_cal(p, profile_mode="cpu")["ranks"]["rank0"]
    assert cpu["mode"] == "cpu" and cpu["comm_time"]["value"] == 20
    assert cpu["overlap_time"]["value"] == 20  # aten::mm runs on another thread throughout
    with pytest.raises(ValueError, match="profile_mode"):
        overlap.metric_cal(p, profile_mode="tpu")
