"""Metric lifecycle, custom metrics, host reads, torch.compile (single process)."""

from __future__ import annotations

import doctest
import math

import pytest
import torch

import d9d_kernels as dk
import d9d_kernels.core.metric as metric_mod


def test_custom_metric_docstring_example_runs():
    res = doctest.testmod(metric_mod, verbose=False)
    assert res.attempted >= 5 and res.failed == 0


class RangeMetric(dk.Metric):
    """Custom metric with a SUM and a MAX slot (max and negated min)."""

    def __init__(self):
        super().__init__()
        self.add_state("count", kind="sum", shape=())
        self.add_state("ext", kind="max", shape=(2,))

    def _update(self, x, mask=None):
        keep = torch.ones_like(x, dtype=torch.bool) if mask is None else mask
        self.count += keep.sum()
        ninf = torch.full_like(x, -math.inf, dtype=torch.float64)
        cand = torch.stack([torch.where(keep, x.double(), ninf).amax(), torch.where(keep, -x.double(), ninf).amax()])
        self.ext = torch.maximum(self.ext, cand)  # assignment copies into the slot

    def _compute(self, state):
        return torch.stack([state["count"], state["ext"][0] + state["ext"][1]])


def test_custom_metric_slots_and_group():
    x = torch.randn(50)
    mask = torch.rand(50) > 0.5
    m = RangeMetric()
    m.update(x[:20], mask=mask[:20])
    m.update(x=x[20:], mask=mask[20:])
    kept = x[mask].double()
    exp = [float(mask.sum()), (kept.max() - kept.min()).item()]
    assert m.compute().tolist() == pytest.approx(exp)
    m.reset()
    assert m.compute()[0].item() == 0
    g = dk.MetricGroup({"r": RangeMetric(), "s": dk.SumMetric()})
    g.update(x=x)  # only RangeMetric takes `x`
    assert g["r"].compute()[0].item() == 50 and g["s"].compute().item() == 0
    assert g._storage.local["max"].numel() == 2


def test_lifecycle_synced_vs_local_and_reset():
    m = dk.SumMetric()
    m.update(torch.tensor([1.0, 2.0]))
    m.trigger_sync()
    m.update(10.0)  # between trigger and wait: not in this sync, kept locally
    m.wait_sync()
    assert m.compute().item() == 3.0  # the synced snapshot
    m.trigger_sync(dk.DistributedContext.local())
    m.wait_sync()
    assert m.compute().item() == 13.0  # counted in the next sync, once
    m.update(1.0)
    assert m.compute().item() == 14.0  # local after an update
    with pytest.raises(RuntimeError, match="wait_sync"):
        m.wait_sync()
    m.trigger_sync()
    with pytest.raises(RuntimeError, match="twice"):
        m.trigger_sync()
    m.reset()  # discards the in-flight result
    m.wait_sync()
    assert m.compute().item() == 0.0


def test_compute_to_host_one_copy_and_errors():
    g = dk.MetricGroup({"a": dk.SumMetric(), "b": dk.WeightedMeanMetric(), "c": dk.MaxMetric()})
    g.update(values=torch.tensor([1.0, 2.0, 6.0]))
    h = g.compute_to_host()
    assert h.result() == {"a": 9.0, "b": 3.0, "c": 6.0}
    s = dk.SumMetric(nan_strategy="error")
    s.update(torch.tensor([1.0, float("nan")]))
    with pytest.raises(ValueError, match="1 invalid"):
        s.compute_to_host().result()
    ok = dk.MinMetric()
    ok.update(-2.0)
    assert ok.compute_to_host().result() == -2.0


def test_to_device_roundtrip_keeps_state():
    m = dk.WeightedMeanMetric()
    m.update(torch.tensor([1.0, 5.0]))
    assert m.to("cpu") is m and m.device == torch.device("cpu")
    assert m.compute().item() == 3.0
    g = dk.MetricGroup({"m": dk.SumMetric()})
    with pytest.raises(RuntimeError, match="move the group"):
        g["m"].to("cpu")


def test_compile_fullgraph_update_reset_trigger_local():
    torch._dynamo.reset()
    g = dk.MetricGroup({"sum": dk.SumMetric(), "mean": dk.WeightedMeanMetric(), "max": dk.MaxMetric()})
    m = dk.WeightedMeanMetric()
    local = dk.DistributedContext.local()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(x, w):
        g["sum"].update(x)
        g["mean"].update(values=x, weights=w)
        g["max"].update(x)
        m.update(x, weights=w)
        m.update(2.0)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def log_step():
        g.trigger_sync(local)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def clear():
        g.reset()
        m.reset()

    x, w = torch.randn(16), torch.rand(16)
    step(x, w)
    step(x, w)
    log_step()
    g.wait_sync()
    out = g.compute()
    assert out["sum"].item() == pytest.approx(2 * x.double().sum().item())
    assert out["mean"].item() == pytest.approx((x.double() * w).sum().item() / w.double().sum().item())
    assert out["max"].item() == x.max().item()
    wsum = w.double().sum().item()
    assert m.compute().item() == pytest.approx((2 * (x.double() * w).sum().item() + 4.0) / (2 * wsum + 2))
    clear()
    assert g.compute()["sum"].item() == 0.0 and math.isnan(m.compute().item())

    # group routing and ctx=None (no process group: local) compile too
    g2 = dk.MetricGroup({"sum": dk.SumMetric(), "max": dk.MaxMetric()})

    @torch.compile(fullgraph=True, backend="aot_eager")
    def routed(x, w):
        g2.update(values=x, weights=w)
        g2.trigger_sync(None)

    routed(x, w)
    g2.wait_sync()
    assert g2.compute()["sum"].item() == pytest.approx((x.double() * w).sum().item())
    assert g2.compute()["max"].item() == x.max().item()


def test_device_cuda_names_the_current_index(monkeypatch):
    """A metric built with device="cuda" compares equal to the tensors made there
    (their device is cuda:<current>); a device with an index keeps it."""
    from d9d_kernels.core.device import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.gpu
def test_no_host_sync_on_cuda():
    g = dk.MetricGroup({"s": dk.SumMetric(), "m": dk.WeightedMeanMetric(), "mx": dk.MaxMetric()}, device="cuda")
    x = torch.randn(1000, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        g["s"].update(x)
        g["m"].update(values=x, weights=x.abs())
        g["mx"].update(3.0)
        g.update(values=x)
        g.trigger_sync(dk.DistributedContext.local())
        g.wait_sync()
        g.reset()
        g.update(values=x)
        h = g.compute_to_host()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out = h.result()
    assert out["s"] == pytest.approx(x.double().sum().item(), rel=1e-9)


def test_docs_python_blocks_run(tmp_path, monkeypatch):
    import pathlib
    import re
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the checkpoint block writes there

    text = (pathlib.Path(__file__).parents[2] / "docs" / "metrics_core.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 5
    ns: dict = {}
    for code in blocks:
        exec(compile(code, "docs/metrics_core.md", "exec"), ns)  # the blocks assert their results
    assert ns["logged"]["tokens"] == 104.0
