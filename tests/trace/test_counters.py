"""counters (queue length): a hand-built launch pattern with a known step function,
and HolisticTraceAnalysis's get_queue_length_summary on the shared traces."""

from __future__ import annotations


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
