"""launch: hand-built launch/kernel pairs with known delays, and HolisticTraceAnalysis's
get_cuda_kernel_launch_stats on the shared traces."""

from __future__ import annotations


import numpy as np
import pytest

from d9d_kernels.trace import launch
from tests.trace._synth import CPU_PID, CPU_TID, SynthTrace


def _pair(t, corr, call, cpu_ts, cpu_dur, gpu_ts, gpu_dur, cat="kernel"):
    t.events.append({"ph": "X", "cat": "cuda_runtime", "name": call, "pid": CPU_PID, "tid": CPU_TID,
                     "ts": cpu_ts, "dur": cpu_dur, "args": {"correlation": corr}})
    t.events.append({"ph": "X", "cat": cat, "name": f"k{corr}", "pid": 0, "tid": 7, "ts": gpu_ts,
                     "dur": gpu_dur, "args": {"device": 0, "stream": 7, "correlation": corr}})


@pytest.fixture
def trace(tmp_path):
    t = SynthTrace()
    _pair(t, 1, "cudaLaunchKernel", 0, 5, 10, 2)        # delay 5, short (2 < 5)
    _pair(t, 2, "cudaLaunchKernel", 20, 60, 300, 100)   # delay 220, runtime + delay outlier
    _pair(t, 3, "cudaLaunchKernelExC", 400, 10, 405, 50)  # starts before the call ends: delay 0
    _pair(t, 4, "cudaMemcpyAsync", 500, 4, 520, 1, cat="gpu_memcpy")  # delay 16, short
    _pair(t, 5, "hipLaunchKernel", 600, 2, 610, 1)      # HIP: only with launch_names="all"
    _pair(t, 6, "cudaStreamWaitEvent", 700, 2, 710, 1)  # not a launch call
    return t.write(tmp_path / "rank0_trace.json")


def test_synthetic_known_answers(trace):
    r = launch.metric_cal(trace, launch_names="hta")["ranks"]["rank0"]
    assert r["launches"]["value"] == 4
    assert r["launch_delay"]["mean"]["value"] == pytest.approx((5 + 220 + 0 + 16) / 4)
    assert r["launch_delay"]["max"]["value"] == 220
    assert r["short_kernels"]["value"] == 2 and r["runtime_outliers"]["value"] == 1
    assert r["launch_delay_outliers"]["value"] == 1 and r["launch_delay_outliers_pct"]["value"] == 25
    assert r["longest_delays"][0] == {"name": "k2", "delay": {"value": 220.0, "unit": "us",
                                                              "definition": "launch delay"}}
    assert launch.metric_cal(trace, launch_names="all")["ranks"]["rank0"]["launches"]["value"] == 5
    no_mem = launch.metric_cal(trace, launch_names="hta", include_memory_events=False)["ranks"]["rank0"]
    assert no_mem["launches"]["value"] == 3 and no_mem["short_kernels"]["value"] == 1


def test_cutoffs(trace):
    r = launch.metric_cal(trace, launch_names="hta", runtime_cutoff=4, launch_delay_cutoff=10)
    r = r["ranks"]["rank0"]
    # cpu durations 5, 60, 10, 4: > 4 for three; short needs cpu <= 4 -> only the memcpy
    assert r["runtime_outliers"]["value"] == 3 and r["short_kernels"]["value"] == 1
    assert r["launch_delay_outliers"]["value"] == 2


@pytest.mark.parametrize("sub", ["hta_sampled_2rank", "nccl_rank0_of2", "amd_mi250"])
def test_matches_hta(hta_on, sub):
    ta, tmp_path = hta_on(sub)
    ref = ta.get_cuda_kernel_launch_stats(ranks=list(ta.t.traces), visualize=False)
    ours = launch.metric_cal(tmp_path, launch_names="hta")["ranks"]
    for rank, df in ref.items():
        o = ours[f"rank{rank}"]
        assert o["launches"]["value"] == len(df)
        short = ((df.cpu_duration <= 50) & (df.gpu_duration < df.cpu_duration)).sum()
        assert o["short_kernels"]["value"] == short
        assert o["runtime_outliers"]["value"] == (df.cpu_duration > 50).sum()
        assert o["launch_delay_outliers"]["value"] == (df.launch_delay > 100).sum()
        for col, key in (("launch_delay", "launch_delay"), ("cpu_duration", "cpu_duration"),
                         ("gpu_duration", "gpu_duration")):
            if len(df):
                for stat, fn in (("mean", np.mean), ("median", np.median), ("max", np.max)):
                    assert o[key][stat]["value"] == pytest.approx(float(fn(df[col])), rel=0.01), (col, stat)
            else:
                assert o[key]["mean"]["value"] is None
