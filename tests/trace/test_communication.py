"""Communication: volume, algbw/busbw factors, grouping, traces without args."""

from __future__ import annotations

import json

import pytest

from d9d_kernels.trace import communication
from d9d_kernels.trace.communication import busbw_factor, normalize_collective
from tests.trace._synth import SynthTrace, nccl_args
from tests.trace._torch_traces import NUMEL, STEPS, gloo_workload


@pytest.mark.parametrize("kind,n,factor", [
    ("allreduce", 4, 1.5), ("allreduce", 2, 1.0), ("allgather", 4, 0.75),
    ("reducescatter", 8, 0.875), ("alltoall", 4, 0.75), ("broadcast", 4, 1.0), ("reduce", 4, 1.0),
])
def test_nccl_tests_factors(kind, n, factor):
    assert busbw_factor(kind, n) == pytest.approx(factor)


@pytest.mark.parametrize("raw,norm", [
    ("allreduce", "allreduce"), ("all_gather_into_tensor_coalesced", "allgather"),
    ("_reduce_scatter_base", "reducescatter"), ("all_to_all", "alltoall"), ("AllReduce", "allreduce"),
    ("SendRecv", "sendrecv"), ("broadcast", "broadcast"), ("reduce", "reduce"),
])
def test_normalize(raw, norm):
    assert normalize_collective(raw) == norm


def test_volume_and_bandwidth_by_construction(tmp_path):
    t = SynthTrace(rank=0, world_size=4)
    # 2 all-reduces of 1e6 floats (4e6 bytes) taking 1000 us each on a 4-rank group
    for i in range(2):
        t.kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)", 1000.0 + 3000 * i, 1000.0,
                 stream=20, **nccl_args("allreduce", 1_000_000, "Float", group=4))
    # an all-gather whose output is 4 x 250000 bf16 = 2e6 bytes, 500 us, on process group "1"
    t.kernel("ncclDevKernel_AllGather_RING_LL(ncclDevComm*)", 9000.0, 500.0, stream=21,
             **nccl_args("all_gather_into_tensor", 250_000, "BFloat16", group=4, pg="1",
                         out_nelems=1_000_000))
    t.kernel("sgemm", 0.0, 100.0)
    res = communication.metric_cal(t.write(tmp_path / "rank0.json"))
    c = res["ranks"]["rank0"]["collectives"]
    ar = c["allreduce"]["0:default_pg"]
    assert ar["count"]["value"] == 2
    assert ar["time"]["value"] == pytest.approx(2000.0)
    assert ar["volume"]["value"] == pytest.approx(8e6)
    assert ar["algbw"]["value"] == pytest.approx(4.0)  # 8e6 B / 2e-3 s = 4 GB/s
    assert ar["busbw"]["value"] == pytest.approx(6.0)  # x 2*3/4
    ag = c["allgather"]["1:default_pg"]
    assert ag["volume"]["value"] == pytest.approx(2e6)
    assert ag["algbw"]["value"] == pytest.approx(4.0)
    assert ag["busbw"]["value"] == pytest.approx(3.0)  # x 3/4
    assert res["ranks"]["rank0"]["total_time"]["value"] == pytest.approx(2500.0)
    for entry in (ar, ag):  # every number carries unit + definition
        for m in entry.values():
            assert set(m) == {"value", "unit", "definition"} and m["unit"] and m["definition"]


def test_kernel_without_args_gives_count_and_time_only(tmp_path):
    t = SynthTrace(rank=0, world_size=2)
    t.kernel("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", 0, 50.0)
    t.kernel("ncclKernel_AllReduce_RING_LL_Sum_float(ncclDevComm*, unsigned long, ncclWork*)", 100, 70.0)
    res = communication.metric_cal(t.write(tmp_path / "rank0.json"))
    e = res["ranks"]["rank0"]["collectives"]["allreduce"]["unknown"]
    assert e["count"]["value"] == 2 and e["time"]["value"] == pytest.approx(120.0)
    assert e["volume"]["value"] is None and "busbw" not in e
    assert any("count and time only" in n for n in res["notes"])


def test_gloo_trace_from_torch_profiler():
    root = gloo_workload()
    res = communication.metric_cal(root)
    for r in ("rank0", "rank1"):
        e = res["ranks"][r]["collectives"]["allreduce"]["0:default_pg"]
        assert res["ranks"][r]["mode"] == "cpu"
        assert e["count"]["value"] == STEPS
        assert e["volume"]["value"] == STEPS * NUMEL * 4  # float32
        assert e["group_size"]["value"] == 2
    # time = summed duration of the gloo:all_reduce ranges, read independently
    import gzip
    raw = json.load(gzip.open(root / "profile_traces" / f"iteration_{STEPS}" / "rank1_trace.json.gz"))
    want = sum(e["dur"] for e in raw["traceEvents"] if e.get("name") == "gloo:all_reduce")
    got = res["ranks"]["rank1"]["collectives"]["allreduce"]["0:default_pg"]["time"]["value"]
    assert got == pytest.approx(want)
