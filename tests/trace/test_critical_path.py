"""critical_path: hand-built steps whose binding chain is known. (HTA 0.5.0's
critical_path_analysis cannot be the reference: its call graph raises under numpy 2.)"""

from __future__ import annotations

import pytest

from d9d_kernels.trace import critical_path
from tests.trace._synth import CPU_PID, CPU_TID, SynthTrace


def _ev(t, name, ts, dur, cat="cpu_op", **args):
    t.events.append({"ph": "X", "cat": cat, "name": name, "pid": CPU_PID, "tid": CPU_TID, "ts": ts,
                     "dur": dur, "args": args})


def _gpu(t, name, ts, dur, corr, stream=7):
    t.events.append({"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": stream, "ts": ts,
                     "dur": dur, "args": {"device": 0, "stream": stream, "correlation": corr}})


def test_sync_bound_step(tmp_path):
    t = SynthTrace()
    t.step(1, 0, 130)
    _ev(t, "op_a", 0, 10)
    _ev(t, "cudaLaunchKernel", 2, 1, cat="cuda_runtime", correlation=1)
    _gpu(t, "k1", 5, 100, 1)
    _ev(t, "cudaDeviceSynchronize", 12, 95, cat="cuda_runtime")
    _ev(t, "op_b", 110, 10)
    r = critical_path.metric_cal(t.write(tmp_path / "rank0_trace.json"))["ranks"]["rank0"]
    s = r["steps"]["step1"]
    # op_b 10 + sync after k1 ends 2 + launch 1 + op_a before the launch 2 = 15 CPU;
    # k1 100 GPU; gaps: op_b start - sync end 3, k1 start - launch end 2
    assert s["path_time"]["value"] == 120
    assert (s["cpu_time"]["value"], s["gpu_time"]["value"], s["gap_time"]["value"]) == (15, 100, 5)
    top = {(e["name"], e["side"]): e["time"]["value"] for e in r["top_events"]}
    assert top[("k1", "gpu")] == 100 and top[("op_b", "cpu")] == 10


def test_stream_order_binds(tmp_path):
    t = SynthTrace()
    t.step(1, 0, 200)
    _ev(t, "cudaLaunchKernel", 0, 1, cat="cuda_runtime", correlation=1)
    _ev(t, "cudaLaunchKernel", 2, 1, cat="cuda_runtime", correlation=2)
    _gpu(t, "k1", 10, 50, 1)
    _gpu(t, "k2", 60, 40, 2)  # queued behind k1: bound by k1's end, not by its launch
    r = critical_path.metric_cal(t.write(tmp_path / "rank0_trace.json"))["ranks"]["rank0"]["steps"]["step1"]
    assert r["path_time"]["value"] == 100
    assert r["gpu_time"]["value"] == 90 and r["cpu_time"]["value"] == 1 and r["gap_time"]["value"] == 9
    assert r["gpu_pct"]["value"] == pytest.approx(90)


def test_interval_queries_match_scans():
    import numpy as np

    rng = np.random.default_rng(0)
    ts = rng.integers(0, 500, 400).astype(float)
    end = ts + rng.choice([0.0, 1.0, 7.0, 50.0, 300.0], 400)
    rows = np.sort(rng.choice(400, 250, replace=False))
    by_end, by_start = critical_path._ByEnd(rows, end), critical_path._ByStart(rows, ts, end)
    for x in np.r_[np.arange(-1.0, 900.0, 3.5), ts[:50], end[:50]]:
        prev = rows[end[rows] <= x]  # latest end <= x, first row among equal ends
        want = (int(prev[np.argmax(end[prev])]), float(end[prev].max())) if prev.size else None
        assert by_end.last_le(x) == want
        lt = end[rows][end[rows] < x]
        assert by_end.max_lt(x) == (lt.max() if lt.size else -np.inf)
        enc = rows[(ts[rows] < x) & (end[rows] >= x)]  # innermost enclosing: latest start, first row
        assert by_start.enclosing(x) == (int(enc[np.argmax(ts[enc])]) if enc.size else None)


def test_pool_over_ranks_equals_serial(tmp_path, monkeypatch):
    from d9d_kernels.trace import _common, sequences

    for r in range(8):
        t = SynthTrace(rank=r, world_size=8)
        t.step(1, 0, 300)
        for i in range(4):
            _ev(t, "aten::linear", 10 + 60 * i, 50)
            t.kernel(f"k{i % 2}", 100 + 40 * i + r, 30, launch_ts=20 + 60 * i)
        t.write(tmp_path / f"rank{r}_trace.json")
    pooled = [critical_path.metric_cal(tmp_path), sequences.metric_cal(tmp_path, min_pattern_len=1)]
    monkeypatch.setattr(_common, "MAP_POOL_MIN_RANKS", 1 << 30)
    _common._CACHE.clear()
    _common._STEPS_CACHE.clear()
    serial = [critical_path.metric_cal(tmp_path), sequences.metric_cal(tmp_path, min_pattern_len=1)]
    assert len(pooled[0]["ranks"]) == 8 and pooled[0]["ranks"]["rank7"]["steps"]["step1"]["gpu_time"]["value"] > 0
    assert pooled == serial
