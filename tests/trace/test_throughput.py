"""Step time, tokens/s and MFU."""

from __future__ import annotations

import pytest

from d9d_kernels.trace import throughput
from tests.trace._synth import SynthTrace
from tests.trace._torch_traces import STEPS, gloo_workload


def _steps_trace(tmp_path, durs_us, device=None):
    t = SynthTrace(device_name=device)
    ts = 0.0
    for i, d in enumerate(durs_us, start=5):
        t.step(i, ts, d)
        ts += d
    return t.write(tmp_path / "rank0_trace.json")


def test_steps_tokens_mfu_by_construction(tmp_path):
    p = _steps_trace(tmp_path, [100_000, 200_000, 200_000], device="NVIDIA H100 80GB HBM3")
    card = tmp_path / "card.yaml"
    card.write_text("batch_size: 8\nseq_len: 1024\nflops_per_token: 6.0e9\n")
    r = throughput.metric_cal(p, workload_card_path=card)["ranks"]["rank0"]
    assert [m["value"] for m in r["steps"].values()] == [100.0, 200.0, 200.0]
    assert list(r["steps"]) == ["step5", "step6", "step7"]
    assert r["step_time_median"]["value"] == 200.0 and r["step_time_median"]["unit"] == "ms"
    assert r["tokens_per_s"]["value"] == pytest.approx(8 * 1024 / 0.2)
    # 6e9 FLOP/token x 8192 tokens / 0.2 s over the H100 dense BF16 peak 989e12
    assert r["mfu_pct"]["value"] == pytest.approx(100 * 6e9 * 8192 / 0.2 / 989e12)


def test_card_peak_overrides_and_missing_inputs(tmp_path):
    p = _steps_trace(tmp_path, [1000.0, 1000.0])
    card = tmp_path / "card.yaml"
    card.write_text("tokens_per_step: 10\nflops_per_step: 1.0e6\npeak_flops: 2.0e9\n")
    r = throughput.metric_cal(p, workload_card_path=card)["ranks"]["rank0"]
    assert r["tokens_per_s"]["value"] == pytest.approx(10_000.0)
    assert r["mfu_pct"]["value"] == pytest.approx(100 * 1e6 / 1e-3 / 2e9)
    r = throughput.metric_cal(p)["ranks"]["rank0"]
    assert r["tokens_per_s"]["value"] is None and "workload card" in r["tokens_per_s"]["definition"]
    assert r["mfu_pct"]["value"] is None


def test_gloo_workload_card_discovered():
    res = throughput.metric_cal(gloo_workload())
    for r in ("rank0", "rank1"):
        m = res["ranks"][r]
        assert m["num_steps"]["value"] == STEPS
        med = m["step_time_median"]["value"]
        assert m["tokens_per_s"]["value"] == pytest.approx(4 * 128 / (med / 1e3))
        assert m["mfu_pct"]["value"] == pytest.approx(100 * 1000 * 512 / (med / 1e3) / 1e9)
