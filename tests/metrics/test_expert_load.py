"""dk.ExpertLoad vs a numpy reference written here (router statistics of MoE layers)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import d9d_kernels as dk

NAN = float("nan")


# ---------------------------------------------------------------- numpy reference
def np_load(batches, L, E):
    """[L, E] slots per layer and expert; batches: (indices [L', T, k] numpy, layer ids)."""
    load = np.zeros((L, E))
    for idx, layers in batches:
        for i, l in enumerate(layers):
            v = idx[i].ravel()
            load[l] += np.bincount(v[(v >= 0) & (v < E)], minlength=E)
    return load


def np_summary(load, gate=None):
    L, E = load.shape
    tot = load.sum(1)
    act = tot > 0
    out = dict(max_violation=NAN, dead_experts=NAN, cv=NAN, entropy=NAN)
    if gate is not None:
        out.update(lb_loss=NAN, gate_entropy=NAN)
    if not act.any():
        return out
    a = load[act]
    mean = a.mean(1)
    out["max_violation"] = float((a.max(1) / mean - 1).max())
    out["dead_experts"] = float((a == 0).sum())
    out["cv"] = float((a.std(1) / mean).mean())  # numpy std: population
    p = a / a.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        plogp = np.where(p > 0, p * np.log(p), 0.0)
    out["entropy"] = float((-plogp.sum(1) / np.log(E)).mean()) if E > 1 else 1.0
    if gate is not None:
        n = gate[:, E]
        has = n > 0
        P = gate[:, :E] / np.where(has, n, 1)[:, None]
        f = load / np.where(act, tot, 1)[:, None]
        both = has & act
        if both.any():
            out["lb_loss"] = float((E * (f * P).sum(1))[both].mean())
        if has.any():
            q = P[has] / P[has].sum(1, keepdims=True)
            out["gate_entropy"] = float((-(q * np.log(q)).sum(1) / np.log(E)).mean())
    return out


def assert_matches(got: dict, want: dict):
    assert set(got) == set(want), (set(got), set(want))
    for k, w in want.items():
        g = got[k].item()
        assert got[k].dim() == 0 and got[k].dtype == torch.float64, k
        if math.isnan(w):
            assert math.isnan(g), (k, g)
        else:
            assert g == pytest.approx(w, rel=1e-12, abs=1e-12), (k, g, w)


def feed(m, batches):
    for idx, layers in batches:
        m.update(torch.from_numpy(idx), layers=layers)


# ---------------------------------------------------------------- values
def routing(rng, Lp, T, k, E, drop=0.0, skew=0.0):
    """Random top-k routing [Lp, T, k] (distinct experts per token), some slots dropped (-1)."""
    w = rng.random((Lp, T, E)) + skew * (np.arange(E) == 0)
    idx = np.argsort(-w, axis=-1)[..., :k]
    idx[rng.random(idx.shape) < drop] = -1
    return idx.astype(np.int64)


@pytest.mark.parametrize("L,E,k", [(1, 1, 1), (3, 8, 2), (4, 33, 5)])
def test_random_matches_numpy(L, E, k):
    rng = np.random.default_rng(L * 100 + E)
    batches = [(routing(rng, L, 50, k, E, drop=0.1, skew=0.5), list(range(L))) for _ in range(3)]
    m = dk.ExpertLoad(E, num_layers=L, top_k=k)
    feed(m, batches)
    load = np_load(batches, L, E)
    assert_matches(m.compute(), np_summary(load))
    assert torch.equal(m.per_layer()["load"], torch.from_numpy(load))


def test_adversarial():
    E, k, T = 8, 2, 40
    m = dk.ExpertLoad(E, num_layers=4, top_k=k)
    one = np.zeros((1, T, k), np.int64)  # layer 0: one expert takes all (slot 2 of each token to it too)
    uniform = np.arange(T * k).reshape(1, T, k) % E  # layer 1: exactly uniform
    dead = np.tile(np.array([[0, 1]]), (1, T, 1))  # layer 2: experts 2..7 dead
    dropped = np.full((1, T, k), -1)  # layer 3: every slot dropped -> no tokens: left out
    batches = [(one, [0]), (uniform, [1]), (dead, [2]), (dropped, [3])]
    feed(m, batches)
    want = np_summary(np_load(batches, 4, E))
    assert_matches(m.compute(), want)
    per = m.per_layer()
    assert per["violation"][:3].tolist() == [E - 1, 0.0, E / 2 - 1] and math.isnan(per["violation"][3])
    assert per["dead"].tolist() == [E - 1, 0, E - 2, 0] and per["active"].tolist() == [True, True, True, False]
    assert per["entropy"][:3].tolist() == [0.0, 1.0, pytest.approx(math.log(2) / math.log(E))]
    assert m.compute()["dead_experts"].item() == 2 * E - 3


def test_layer_subsets_counts_and_reset():
    E, L, k = 6, 5, 2
    rng = np.random.default_rng(1)
    m = dk.ExpertLoad(E, num_layers=L, top_k=k)
    a, b = routing(rng, 2, 30, k, E), routing(rng, 1, 20, k, E)[0]
    m.update(torch.from_numpy(a), layers=[4, 1])
    m.update(torch.from_numpy(b), layers=range(2, 3))  # [T, k]: one layer
    counts = rng.integers(0, 9, (2, E))
    m.update(counts=torch.from_numpy(counts), layers=torch.tensor([0, 4]))  # non-contiguous: index_add
    m.update(counts=torch.from_numpy(counts[:1]).int(), layers=[3])
    load = np_load([(a, [4, 1]), (b[None], [2])], L, E)
    load[[0, 4]] += counts
    load[3] += counts[0]
    assert torch.equal(m.per_layer()["load"], torch.from_numpy(load))
    assert_matches(m.compute(), np_summary(load))
    m.update(counts=torch.zeros(0, E), layers=[])  # a stage without MoE layers: nothing
    m.update(torch.zeros(0, 3, k, dtype=torch.long), layers=[])
    assert torch.equal(m.per_layer()["load"], torch.from_numpy(load))
    m.reset()  # after reset: nothing, NaN everywhere; then only the new data
    assert_matches(m.compute(), np_summary(np.zeros((L, E))))
    m.update(torch.from_numpy(a), layers=[0, 3])
    assert_matches(m.compute(), np_summary(np_load([(a, [0, 3])], L, E)))


def test_gate_probabilities():
    E, L, k, T = 5, 3, 2, 64
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, T, E, generator=g)
    probs = torch.softmax(logits, -1)
    idx = logits.topk(k, -1).indices
    m = dk.ExpertLoad(E, num_layers=L, top_k=k, with_probs=True)
    m.update(idx, layers=[2, 0], probs=probs)
    m.update(counts=torch.ones(1, E), layers=[1])  # counts only: no gate data for layer 1
    load = np_load([(idx.numpy(), [2, 0])], L, E)
    load[1] += 1
    gate = np.zeros((L, E + 1))
    gate[[2, 0], :E] = probs.double().sum(1).numpy()
    gate[[2, 0], E] = T
    got = m.compute()
    assert_matches(got, np_summary(load, gate))
    per = m.per_layer()
    torch.testing.assert_close(per["gate_mass"][[2, 0]], probs.double().mean(1))
    assert torch.isnan(per["gate_mass"][1]).all()
    # uniform routing and uniform probabilities: the load-balancing term is exactly 1
    u = dk.ExpertLoad(4, top_k=1, with_probs=True)
    u.update(torch.arange(8).remainder(4)[:, None], probs=torch.full((8, 4), 0.25))
    assert u.compute()["lb_loss"].item() == pytest.approx(1.0, abs=1e-15)


def test_percentiles():
    E = 4
    m = dk.ExpertLoad(E, num_layers=6, top_k=1)
    loads = [[4, 0, 0, 0], [1, 1, 1, 1], [2, 1, 1, 0], [3, 1, 0, 0], [2, 2, 0, 0]]
    for l, row in enumerate(loads):
        m.update(counts=torch.tensor(row), layers=[l])  # layer 5: none
    per = m.per_layer()
    v = np.array([max(r) / (sum(r) / E) - 1 for r in loads])
    assert per["violation_p50"].item() == pytest.approx(np.percentile(v, 50))
    assert per["violation_p90"].item() == pytest.approx(np.percentile(v, 90))
    assert per["violation_max"].item() == v.max()
    one = dk.ExpertLoad(E, num_layers=3)
    one.update(counts=torch.tensor([3, 1, 0, 0]), layers=[1])  # one active layer: every percentile is its value
    assert [one.per_layer()[k].item() for k in ("violation_p50", "violation_p90", "violation_max")] == [2.0] * 3
    empty = dk.ExpertLoad(E, num_layers=2).per_layer()
    assert all(math.isnan(empty[k].item()) for k in ("violation_p50", "violation_p90", "violation_max"))


def test_bad_indices_raise_and_counts():
    m = dk.ExpertLoad(4, num_layers=1, top_k=2)
    m.update(torch.tensor([[0, 4], [-1, 1], [-3, 2]]))
    assert m.bad_input_counts() == {"expert_index_out_of_range": 2}
    with pytest.raises(ValueError, match="2 routed slot"):
        m.compute()
    with pytest.raises(ValueError, match="2 routed slot"):
        m.compute_to_host().result()
    c = dk.ExpertLoad(3)
    c.update(counts=torch.tensor([1.0, -1.0, float("inf")]))
    assert c.bad_input_counts() == {"expert_index_out_of_range": 2}


def test_argument_errors_leave_state():
    m = dk.ExpertLoad(4, num_layers=3, top_k=2, with_probs=False)
    before = m.per_layer()["load"].clone()
    cases = [
        (dict(indices=torch.zeros(3, 5, 3, dtype=torch.long)), "indices", ValueError),  # top_k
        (dict(indices=torch.zeros(5, 2, dtype=torch.long)), "indices", ValueError),  # [T, k] with 3 layers
        (dict(indices=torch.zeros(2, 5, 2, dtype=torch.long), layers=[0, 3]), "layers", ValueError),
        (dict(indices=torch.zeros(2, 5, 2, dtype=torch.long), layers=[0]), "layers", ValueError),
        (dict(indices=torch.zeros(3, 5, 2)), "indices", TypeError),
        (dict(indices=torch.zeros(3, 5, 2, dtype=torch.long), probs=torch.rand(3, 5, 4)), "probs", ValueError),
        (dict(counts=torch.zeros(3, 5)), "counts", ValueError),
        (dict(), "indices", ValueError),
    ]
    for kw, arg, exc in cases:
        with pytest.raises(exc, match=f"ExpertLoad.*'{arg}'"):
            m.update(**kw)
    assert torch.equal(m.per_layer()["load"], before)
    with pytest.raises(ValueError, match="top_k"):
        dk.ExpertLoad(2, top_k=3)
    p = dk.ExpertLoad(4, num_layers=1, top_k=2, with_probs=True)
    with pytest.raises(ValueError, match="'probs'"):
        p.update(torch.zeros(5, 2, dtype=torch.long), probs=torch.rand(6, 4))


def test_group_planned_updates_and_forward():
    E, L, k = 8, 3, 2
    rng = np.random.default_rng(7)
    batches = [(routing(rng, L, 20, k, E, drop=0.2), list(range(L))) for _ in range(4)]
    g = dk.MetricGroup({"moe": dk.ExpertLoad(E, num_layers=L, top_k=k), "loss": dk.WeightedMeanMetric()})
    for i, (idx, _) in enumerate(batches):
        g["moe"].update(torch.from_numpy(idx))  # same signature: replayed after the first call
        g["loss"].update(values=torch.tensor(float(i)))
    assert any(p is not None and type(p).__name__ == "Plan" for p in g._storage.plans.values())
    out = g.compute()
    assert_matches(out["moe"], np_summary(np_load(batches, L, E)))
    assert out["loss"].item() == 1.5
    m = dk.ExpertLoad(E, num_layers=L, top_k=k)
    batch = m(torch.from_numpy(batches[0][0]))  # forward: this batch's value
    assert_matches(batch, np_summary(np_load(batches[:1], L, E)))


def test_update_from_d9d_model():
    moe = pytest.importorskip("d9d.module.block.moe")
    torch.manual_seed(0)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = moe.MoELayer(hidden_dim=8, intermediate_dim_grouped=8, num_grouped_experts=6, top_k=2,
                                    router_renormalize_probabilities=True)
            self.mlp.reset_parameters()

    class Stage(torch.nn.Module):  # a pipeline stage holding global layers 3 and 5
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleDict({"3": Block(), "5": Block()})

    stage = Stage()
    want = np.zeros((6, 6))
    for _ in range(2):  # the router and the counter update of d9d's MoELayer (its expert kernels need CUDA)
        for key, blk in stage.layers.items():
            h = torch.randn(10, 8)
            idx = blk.mlp.router(h).selected_expert_indices
            blk.mlp._update_tokens_per_expert(idx)
            want[int(key)] += np.bincount(idx.reshape(-1).numpy(), minlength=6)
    assert [i for i, _ in dk.metrics.expert_load.moe_layers(stage)] == [3, 5]
    m = dk.ExpertLoad(6, num_layers=6, top_k=2)
    m.update_from_model(stage)
    assert torch.equal(m.per_layer()["load"], torch.from_numpy(want))
    assert all(int(b.mlp.tokens_per_expert.sum()) == 0 for b in stage.layers.values())  # reset_stats ran
    m.update_from_model(stage)  # nothing new: unchanged
    assert_matches(m.compute(), np_summary(want))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_gpu_no_host_sync_graph_capture_and_values(backend, monkeypatch):
    """On a GPU: the planned update makes no host sync, replays inside a CUDA graph, and
    matches numpy; compute() makes no host sync either."""
    if backend not in dk.ops.backends():
        pytest.skip(f"backend {backend} not available")
    monkeypatch.setenv("D9D_KERNELS_BACKEND", backend)
    E, L, k = 128, 48, 8
    rng = np.random.default_rng(5)
    batches = [(routing(rng, L, 512, k, E, drop=0.05), list(range(L))) for _ in range(3)]
    dev = torch.device("cuda")
    idx = [torch.from_numpy(b[0]).to(dev) for b in batches]
    m = dk.ExpertLoad(E, num_layers=L, top_k=k).to(dev)
    m.update(idx[0])  # records the plan (and warms the kernel)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m.update(idx[1])
        out = m.compute()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_matches({kk: v.cpu() for kk, v in out.items()}, np_summary(np_load(batches[:2], L, E)))
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            m.update(idx[2])
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    m._storage.dirty = True  # replays run no Python (docs/metrics_core.md)
    torch.cuda.synchronize()
    assert torch.equal(m.per_layer()["load"].cpu(), torch.from_numpy(np_load(batches, L, E)))


def test_group_compute_to_host_takes_the_dict_value():
    g = dk.MetricGroup({"router": dk.ExpertLoad(4, num_layers=2, top_k=1), "loss": dk.WeightedMeanMetric()})
    g["router"].update(torch.tensor([[[0], [0], [1], [3]], [[2], [2], [2], [2]]]))
    g["loss"].update(torch.tensor([1.0, 3.0]))
    got = g.compute_to_host().result()
    want = {k: float(v) for k, v in g.compute()["router"].items()}
    assert got["loss"] == 2.0 and got["router"] == want
    # layer 0 loads [2, 1, 0, 1]: max / mean - 1 = 1; layer 1 [0, 0, 4, 0]: 3; one dead expert, three dead
    assert got["router"]["max_violation"] == 3.0 and got["router"]["dead_experts"] == 4.0
