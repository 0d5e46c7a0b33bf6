"""fsdp tool on a CPU trace made here with record_function blocks named exactly as
FSDP2 names them and real gloo collectives; expectations from the raw events."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from d9d_kernels.trace import fsdp

STEPS = 2


def _work(n=64):
    return (torch.randn(n, n) @ torch.randn(n, n)).sum()


def _fsdp_like_step():
    x = torch.ones(4096)
    out = torch.empty(4096)
    for mod in ("layers.0", "layers.1"):
        with record_function(f"FSDP::pre_forward ({mod})"):
            with record_function(f"FSDP::all_gather ({mod})"):
                with record_function("fsdp::all_gather_copy_in"):
                    _work()
                dist.all_gather_into_tensor(out, x)
            with record_function(f"FSDP::all_gather_copy_out ({mod})"):
                _work()
        _work(128)
        with record_function(f"FSDP::post_forward ({mod})"):
            _work()
    for mod in ("layers.1", "layers.0"):
        with record_function(f"FSDP::pre_backward ({mod})"):
            with record_function(f"FSDP::all_gather ({mod})"):
                dist.all_gather_into_tensor(out, x)
        _work(128)
        with record_function(f"FSDP::post_backward_reshard ({mod})"):
            _work()
        with record_function(f"FSDP::post_backward_reduce ({mod})"):
            with record_function("fsdp::chunk_cat"):
                _work()
            dist.reduce_scatter_tensor(out, x)
    with record_function("FSDP::backward_prefetch for layers.0"):
        _work()


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp")
    path = d / "rank0_trace.json"
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        sched = schedule(wait=0, warmup=1, active=STEPS, repeat=1)
        with profile(activities=[ProfilerActivity.CPU], schedule=sched,
                     on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
            for _ in range(STEPS + 1):
                _fsdp_like_step()
                prof.step()
    finally:
        dist.destroy_process_group()
    return path


def _union(ivs):
    total, cs, ce = 0.0, None, None
    for a, b in sorted(ivs):
        if ce is None or a > ce:
            total += 0 if ce is None else ce - cs
            cs, ce = a, b
        else:
            ce = max(ce, b)
    return total + (0 if ce is None else ce - cs)


EXPECTED_GROUP = {  # label prefix (before " (") -> group, written independently of the tool
    "FSDP::pre_forward": "pre_forward", "FSDP::all_gather": "all_gather",
    "fsdp::all_gather_copy_in": "all_gather_copy_in", "FSDP::all_gather_copy_out": "all_gather_copy_out",
    "FSDP::post_forward": "post_forward", "FSDP::pre_backward": "pre_backward",
    "FSDP::post_backward_reshard": "reshard", "FSDP::post_backward_reduce": "reduce_scatter",
    "fsdp::chunk_cat": "reduce_scatter_copy_in", "FSDP::backward_prefetch": "prefetch",
}


def test_fsdp_groups_counts_and_union_times(trace):
    ev = [e for e in json.loads(Path(trace).read_text())["traceEvents"] if e.get("ph") == "X"]
    r = fsdp.metric_cal(trace)
    assert not r["errors"]
    rk = r["ranks"]["rank0"]
    assert rk["fsdp_activity"] is True and r["summary"]["fsdp_activity"] is True
    groups = rk["groups"]
    for label, g in EXPECTED_GROUP.items():
        mine = [e for e in ev if re.split(r" \(| for ", e["name"])[0] == label]
        assert mine, label
        assert groups[g]["count"]["value"] == len(mine), g
        assert groups[g]["cpu_time"]["value"] == pytest.approx(
            _union([(e["ts"], e["ts"] + e["dur"]) for e in mine]), abs=1e-2), g
        assert groups[g]["cpu_time"]["unit"] == "us"
    # 2 modules x (forward + backward) all-gathers per step
    assert groups["all_gather"]["count"]["value"] == 4 * STEPS
    # nested: pre_forward encloses all_gather — its union is not the sum of its children
    pf = [e for e in ev if e["name"].startswith("FSDP::pre_forward")]
    assert groups["pre_forward"]["cpu_time"]["value"] == pytest.approx(sum(e["dur"] for e in pf), abs=1e-2)
    assert set(groups) == set(EXPECTED_GROUP.values())


def test_fsdp_collectives_from_gloo_ops(trace):
    ev = [e for e in json.loads(Path(trace).read_text())["traceEvents"] if e.get("ph") == "X"]
    col = fsdp.metric_cal(trace)["ranks"]["rank0"]["collectives"]
    ag = [e for e in ev if e["name"].startswith("c10d::") and "allgather" in e["name"]]
    rs = [e for e in ev if e["name"].startswith("c10d::") and "reduce_scatter" in e["name"]]
    assert len(ag) == 4 * STEPS and len(rs) == 2 * STEPS
    assert col["all_gather"]["count"]["value"] == len(ag)
    assert col["reduce_scatter"]["count"]["value"] == len(rs)
    assert col["all_gather"]["time"]["value"] == pytest.approx(
        _union([(e["ts"], e["ts"] + e["dur"]) for e in ag]), abs=1e-2)
    assert "exposed_time" not in col["all_gather"]  # not defined without GPU kernels


def test_no_fsdp_activity_is_a_clear_result_not_an_error(data_dir):
    r = fsdp.metric_cal(data_dir / "traces" / "nccl_rank0_of2")
    assert not r["errors"]
    assert r["summary"]["fsdp_activity"] is False
    assert r["notes"][0].startswith("no FSDP activity found")
    rk = r["ranks"]["rank0"]
    assert rk["fsdp_activity"] is False and rk["groups"] == {}
    # the 15 all-reduce kernels of this DDP trace are still listed, minus HTA's last-step drop
    ar = rk["collectives"]["all_reduce"]
    assert 0 < ar["count"]["value"] <= 15
    assert 0 <= ar["exposed_time"]["value"] <= ar["time"]["value"]


def test_every_fsdp2_label_in_torch_has_a_group():
    """Labels FSDP2 actually emits (grepped from the installed torch) are all classified."""
    root = Path(torch.__file__).parent / "distributed" / "fsdp" / "_fully_shard"
    labels = set()
    for f in root.glob("*.py"):
        labels |= set(re.findall(r'"(FSDP::[A-Za-z_]+)', f.read_text()))
    assert "FSDP::all_gather" in labels and "FSDP::post_backward_reduce" in labels
    for lab in labels:
        assert fsdp.group_of(fsdp.operation_of(lab + " (m)")) != "other", lab


def test_gpu_collectives_exposed_time_synthetic(tmp_path):
    """Hand-built GPU trace: compute [100,300) and [500,600); all-gather kernel [250,400)
    overlaps compute for 50 us -> exposed 100 of 150; reduce-scatter [550,700) likewise."""
    from tests.trace._synth import SynthTrace

    t = SynthTrace(rank=0, world_size=2)
    t.step(1, 0, 1000).step(2, 1000, 1000)
    t.cpu("FSDP::all_gather (layers.0)", 5, 45, cat="user_annotation")
    t.cpu("FSDP::post_backward_reduce (layers.0)", 60, 20, cat="user_annotation")
    t.kernel("ampere_sgemm_128x64_nn", 100, 200, stream=7, launch_ts=10)
    t.kernel("ampere_sgemm_128x64_nn", 500, 100, stream=7, launch_ts=11)
    t.kernel("ncclDevKernel_AllGather_RING_LL(ncclDevComm*, unsigned long, ncclWork*)", 250, 150,
             stream=20, launch_ts=12)
    t.kernel("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevComm*, unsigned long, ncclWork*)",
             550, 150, stream=20, launch_ts=13)
    f = t.write(tmp_path / "rank0_trace.json")
    r = fsdp.metric_cal(f)
    col = r["ranks"]["rank0"]["collectives"]
    for kind in ("all_gather", "reduce_scatter"):
        assert col[kind]["count"]["value"] == 1
        assert col[kind]["time"]["value"] == pytest.approx(150)
        assert col[kind]["exposed_time"]["value"] == pytest.approx(100)
        assert col[kind]["exposed_pct"]["value"] == pytest.approx(100 * 100 / 150)
    groups = r["ranks"]["rank0"]["groups"]
    assert groups["all_gather"]["cpu_time"]["value"] == pytest.approx(45)
    assert groups["reduce_scatter"]["cpu_time"]["value"] == pytest.approx(20)
    assert groups["all_gather"]["cpu_time_per_step"]["value"] == pytest.approx(45 / 2)
