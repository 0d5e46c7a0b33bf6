"""sequences: hand-built call trees with known kernel sequences. (HTA 0.5.0's
get_frequent_cuda_kernel_sequences cannot be the reference here: its call-graph
construction raises TypeError with numpy 2 on every shared trace.)"""

from __future__ import annotations

from d9d_kernels.trace import sequences
from tests.trace._synth import SynthTrace


def _op(t, name, ts, kernels, gpu_ts):
    """CPU op ``name`` at ``ts`` (100 us) launching ``kernels`` from a nested aten op."""
    t.cpu(name, ts, 100)
    t.cpu("aten::addmm", ts + 5, 80)
    for j, k in enumerate(kernels):
        t.kernel(k, gpu_ts + 10 * j, 5, launch_ts=ts + 10 + 10 * j)


def _trace(tmp_path):
    t = SynthTrace()
    for i in range(3):
        _op(t, "aten::linear", 1000 * i, ["gemm", "bias", "act"], 1000 * i + 500)
    _op(t, "aten::linear", 5000, ["gemm", "act", "bias"], 5500)
    _op(t, "aten::linear", 6000, ["gemm", "bias"], 6500)  # 2 kernels: below min_pattern_len
    _op(t, "aten::conv2d", 7000, ["conv", "relu", "add"], 7500)
    return t.write(tmp_path / "rank0_trace.json")


def test_known_sequences(tmp_path):
    f = _trace(tmp_path)
    r = sequences.metric_cal(f, operator_name="aten::linear", steps="all")["ranks"]["rank0"]
    p = r["patterns"]
    assert p["top1"]["pattern"] == "aten::linear|gemm|bias|act" and p["top1"]["count"]["value"] == 3
    assert p["top1"]["gpu_time"]["value"] == 3 * 15 and p["top1"]["cpu_time"]["value"] == 300
    assert p["top2"]["pattern"] == "aten::linear|gemm|act|bias" and p["top2"]["count"]["value"] == 1
    assert r["roots_with_kernels"]["value"] == 4 and r["distinct_patterns"]["value"] == 2
    assert p["top1"]["share_pct"]["value"] == 75
    # nested matches count once: addmm lies inside linear, so only the shallowest is a root
    r2 = sequences.metric_cal(f, operator_name="aten::", steps="all")["ranks"]["rank0"]
    assert r2["roots_with_kernels"]["value"] == 5  # 4 linear + 1 conv2d; addmm nested
    assert sequences.metric_cal(f, operator_name="aten::linear", min_pattern_len=2,
                                steps="all")["ranks"]["rank0"]["roots_with_kernels"]["value"] == 5


def test_default_roots_are_outermost_ops(tmp_path):
    r = sequences.metric_cal(_trace(tmp_path), steps="all", top_k=10)["ranks"]["rank0"]
    pats = {v["pattern"]: v["count"]["value"] for v in r["patterns"].values()}
    assert pats == {"aten::linear|gemm|bias|act": 3, "aten::linear|gemm|act|bias": 1,
                    "aten::conv2d|conv|relu|add": 1}


def _stack_tree(rt):
    """Readable reference: per thread, a stack of the events still open."""
    import numpy as np

    parent, depth = {}, {}
    rows = [i for i in range(len(rt)) if not rt.gpu_mask[i] and rt.stream[i] < 0]
    rows.sort(key=lambda i: (rt.pid[i], rt.tid[i], rt.ts[i], -rt.dur[i], i))
    stack, key = [], None
    for i in rows:
        if (rt.pid[i], rt.tid[i]) != key:
            stack, key = [], (rt.pid[i], rt.tid[i])
        while stack and rt.ts[i] >= rt.ts[stack[-1]] + rt.dur[stack[-1]]:
            stack.pop()
        parent[i], depth[i] = (stack[-1] if stack else -1), len(stack)
        stack.append(i)
    n = len(rt)
    return (np.array([parent.get(i, -1) for i in range(n)]), np.array([depth.get(i, -1) for i in range(n)]))


def test_call_tree_matches_a_stack(tmp_path):
    import random

    import numpy as np

    from d9d_kernels.trace._load import load_rank

    rng = random.Random(0)
    t = SynthTrace()
    for tid in (1, 2):
        for _ in range(300):  # nested, disjoint, equal-start and partly overlapping ranges
            ts = rng.randrange(0, 2000, 5)
            t.cpu(f"op{rng.randrange(5)}", ts, rng.choice((0, 1, 5, 20, 100, 400)), tid=tid)
    t.kernel("k", 10, 5)
    rt = load_rank(t.write(tmp_path / "rank0_trace.json"))
    parent, depth = sequences.call_tree(rt)
    ref_parent, ref_depth = _stack_tree(rt)
    np.testing.assert_array_equal(parent, ref_parent)
    np.testing.assert_array_equal(depth, ref_depth)
    assert depth.max() >= 3
