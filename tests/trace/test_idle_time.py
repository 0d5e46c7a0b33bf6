"""idle_time: hand-built gaps with known categories, and HolisticTraceAnalysis's
get_idle_time_breakdown on the shared traces."""

from __future__ import annotations


import pytest

from d9d_kernels.trace import idle_time
from tests.trace._synth import SynthTrace


def test_synthetic_categories(tmp_path):
    t = SynthTrace()
    t.kernel("k1", 100, 10, launch_ts=90)    # first event: no gap
    t.kernel("k2", 130, 10, launch_ts=115)   # launched after k1 ended: host wait 20
    t.kernel("k3", 145, 5, launch_ts=116)    # queued, gap 5 < 30: kernel wait 5
    t.kernel("k4", 250, 10, launch_ts=117)   # queued, gap 100: other 100
    t.kernel("s8", 500, 10, stream=8, launch_ts=400)
    t.kernel("s8b", 600, 10, stream=8, launch_ts=400.5)  # queued, gap 90: other
    r = idle_time.metric_cal(t.write(tmp_path / "rank0_trace.json"))["ranks"]["rank0"]
    s7 = r["streams"]["stream7"]
    assert (s7["host_wait"]["value"], s7["kernel_wait"]["value"], s7["other"]["value"]) == (20, 5, 100)
    assert s7["host_wait_pct"]["value"] == pytest.approx(100 * 20 / 125)
    assert r["streams"]["stream8"]["other"]["value"] == 90
    assert r["idle_time"]["value"] == 215 and r["other"]["value"] == 190


def test_threshold_and_missing_launch(tmp_path):
    t = SynthTrace()
    t.kernel("a", 0, 10, launch_ts=0)
    t.kernel("b", 50, 10, launch_ts=1)       # gap 40: other at 30 us, kernel wait at 50 us
    t.events.append({"ph": "X", "cat": "kernel", "name": "orphan", "pid": 0, "tid": 7, "ts": 200,
                     "dur": 5, "args": {"device": 0, "stream": 7, "correlation": 999}})
    f = t.write(tmp_path / "rank0_trace.json")
    r30 = idle_time.metric_cal(f)["ranks"]["rank0"]
    r50 = idle_time.metric_cal(f, consecutive_kernel_delay=50)["ranks"]["rank0"]
    # the orphan (no launching call in the trace) gap of 140 us cannot be a host wait
    assert (r30["kernel_wait"]["value"], r30["other"]["value"], r30["host_wait"]["value"]) == (0, 180, 0)
    assert (r50["kernel_wait"]["value"], r50["other"]["value"]) == (40, 140)


@pytest.mark.parametrize("sub", ["hta_sampled_2rank", "nccl_rank0_of2", "amd_mi250"])
def test_matches_hta(hta_on, sub):
    ta, tmp_path = hta_on(sub)
    ref, _ = ta.get_idle_time_breakdown(ranks=list(ta.t.traces), visualize=False)
    ours = idle_time.metric_cal(tmp_path)["ranks"]
    n = 0
    for _, row in ref.iterrows():
        m = ours[f"rank{int(row['rank'])}"]["streams"][f"stream{int(row['stream'])}"]
        got = m[row["idle_category"]]["value"]
        assert got == pytest.approx(row["idle_time"], rel=0.01, abs=1.0), (row.to_dict(), got)
        if row["idle_time_ratio"] == row["idle_time_ratio"]:  # not NaN
            assert abs(m[f"{row['idle_category']}_pct"]["value"] - 100 * row["idle_time_ratio"]) <= 0.5
        n += 1
    assert n >= 2
