"""Who waits on whom: collectives matched by order, the shortest one arrived last."""

from __future__ import annotations


from d9d_kernels.trace import straggler
from tests.trace._synth import SynthTrace, nccl_args
from tests.trace._torch_traces import LAG_S, STEPS, gloo_workload

AR = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevComm*)"


def test_three_ranks_by_construction(tmp_path):
    # collective k ends at the same time everywhere; arrival times differ per rank.
    # k=0: rank 2 arrives last (waits 0), ranks 0/1 wait 30/10
    # k=1: rank 0 arrives last, ranks 1/2 wait 5/20
    arrive = {0: [0, 100], 1: [20, 95], 2: [30, 80]}
    end = [40, 110]
    files = []
    for r, arr in arrive.items():
        t = SynthTrace(rank=r, world_size=3)
        t.step(1, 0, 200)
        for k in range(2):
            t.kernel(AR, arr[k], end[k] - arr[k], stream=20, **nccl_args("allreduce", 10, group=3))
        files.append(t.write(tmp_path / f"rank{r}_trace.json"))
    res = straggler.metric_cal(files)
    ranks = res["ranks"]
    assert ranks["rank0"]["wait_time"]["value"] == 30
    assert ranks["rank1"]["wait_time"]["value"] == 10 + 5
    assert ranks["rank2"]["wait_time"]["value"] == 20
    assert ranks["rank0"]["waited_on"]["rank2"]["value"] == 30
    assert ranks["rank2"]["waited_on"]["rank0"]["value"] == 20
    assert ranks["rank2"]["last_to_arrive"]["value"] == 1 and ranks["rank0"]["last_to_arrive"]["value"] == 1
    assert res["summary"]["matched_collectives"]["value"] == 2
    assert res["summary"]["wait_caused"]["rank2"]["value"] == 40


def test_mismatched_counts_are_noted(tmp_path):
    files = []
    for r, n in ((0, 3), (1, 2)):
        t = SynthTrace(rank=r, world_size=2)
        for k in range(n):
            t.kernel(AR, 100 * k, 10 + r, stream=20, **nccl_args("allreduce", 10))
        files.append(t.write(tmp_path / f"rank{r}_trace.json"))
    res = straggler.metric_cal(files)
    assert res["summary"]["matched_collectives"]["value"] == 2
    assert any("different collective counts" in n for n in res["notes"])


def test_gloo_lagging_rank_is_the_straggler():
    # rank 1 sleeps LAG_S before every all_reduce (tests/trace/_torch_traces.py)
    res = straggler.metric_cal(gloo_workload())
    assert res["summary"]["straggler_rank"]["value"] == 1
    assert res["ranks"]["rank1"]["last_to_arrive"]["value"] == STEPS
    waited = res["ranks"]["rank0"]["waited_on"]["rank1"]["value"]
    assert waited >= 0.8 * STEPS * LAG_S * 1e6
    assert res["ranks"]["rank1"]["wait_time"]["value"] == 0


def test_single_rank_note(data_dir):
    p = data_dir / "traces" / "nccl_rank0_of2"
    res = straggler.metric_cal(p)
    assert res["summary"]["matched_collectives"]["value"] == 0
    assert any("one rank only" in n for n in res["notes"])
