"""preds=dk.LinearLogits(hidden, weight): the same state as preds=hidden @ weight.T, no logits materialised."""

from __future__ import annotations

import importlib

import pytest
import torch

import d9d_kernels as dk
L = importlib.import_module("d9d_kernels.ops.linear_logits")  # the module (dk.ops.linear_logits is the function)

IGN = -100


def case(shape=(40,), D=9, V=700, dtype=torch.float32, seed=0, bias=False):
    """Small-integer hidden / weight (exact logits, many ties) whose targets often rank high."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-2, 3, (*shape, D), generator=g).to(dtype)
    w = torch.randint(-2, 3, (V, D), generator=g).to(dtype)
    b = torch.randint(-1, 2, (V,), generator=g).to(dtype) if bias else None
    z = torch.nn.functional.linear(h, w, b)
    t = z.float().argmax(-1)
    flip = torch.rand(shape, generator=g) < 0.5
    t = torch.where(flip, torch.randint(0, V, shape, generator=g), t)
    t[torch.rand(shape, generator=g) < 0.15] = IGN
    return h, w, b, t


def members(V, ignore=IGN):
    mc = dict(task="multiclass", num_classes=V, ignore_index=ignore)
    return {
        "ppl": dk.Perplexity(ignore_index=ignore, num_classes=V),
        "ppl_nlls": dk.Perplexity(ignore_index=ignore),
        "acc": dk.Accuracy(**mc),
        "top5": dk.Accuracy(**mc, top_k=5),
        "acc_macro": dk.Accuracy(**mc, average="macro"),
        "top5_macro": dk.Accuracy(**mc, top_k=5, average="macro"),
        "rec10": dk.Recall(**mc, top_k=10, average="weighted"),
        "prec": dk.Precision(**mc, average="macro"),
        "f1": dk.F1Score(**mc, average="macro"),
        "mcc": dk.MatthewsCorrCoef(task="multiclass", num_classes=V, ignore_index=ignore),
    }


def assert_same(a: dict, b: dict, ppl_rtol=1e-9):
    assert a.keys() == b.keys()
    for k in a:
        rtol = ppl_rtol if k.startswith("ppl") else 0
        torch.testing.assert_close(b[k], a[k], rtol=rtol, atol=0, msg=k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(40,), (3, 13)])
def test_group_equals_materialised_logits(monkeypatch, dtype, shape):
    monkeypatch.setattr(L, "SCRATCH_BYTES", 1 << 16)  # V = 700 in blocks of 256 columns
    h, w, _, t = case(shape, dtype=dtype)
    V = w.shape[0]
    ga, gb = dk.MetricGroup(members(V)), dk.MetricGroup(members(V))
    mask = torch.rand(shape) < 0.8
    for m in (None, mask):
        ga.update(preds=h @ w.T, target=t, mask=m)
        gb.update(preds=dk.LinearLogits(h, w), target=t, mask=m)
    assert_same(ga.compute(), gb.compute(), ppl_rtol=1e-6)


def test_one_pass_serves_every_member(monkeypatch):
    calls = []
    real = L.linear_logits
    monkeypatch.setattr(L, "linear_logits", lambda *a, **k: calls.append(k.get("sumexp")) or real(*a, **k))
    h, w, _, t = case()
    g = dk.MetricGroup(members(w.shape[0]))
    g.update(preds=dk.LinearLogits(h, w), target=t)
    assert calls == [True]  # ClassStatistic and Perplexity's NLLStatistic: one pass
    calls.clear()
    g.update(preds=dk.LinearLogits(h, w), target=t, lse=torch.zeros(t.shape))  # only the Perplexity members
    assert calls == [False]  # the num_classes one; the NLL-only one needs no pass with lse


def test_bias_softcap_and_lse(monkeypatch):
    h, w, b, t = case((30,), bias=True, dtype=torch.float64)
    V = w.shape[0]
    z = 8.0 * torch.tanh(torch.nn.functional.linear(h, w, b) / 8.0)
    lse = torch.logsumexp(z, -1)
    for kw in ({}, {"lse": lse}):
        a, bb = [dk.MetricGroup({"ppl": dk.Perplexity(ignore_index=IGN, num_classes=V),
                                 "ppl2": dk.Perplexity(ignore_index=IGN)}) for _ in range(2)]
        a.update(preds=z, target=t, **kw)
        bb.update(preds=dk.LinearLogits(h, w, b, softcap=8.0), target=t, **kw)
        assert_same(a.compute(), bb.compute(), ppl_rtol=1e-12)
    acc = [dk.Accuracy(task="multiclass", num_classes=V, top_k=3, ignore_index=IGN) for _ in range(2)]
    acc[0].update(z, t)
    acc[1].update(dk.LinearLogits(h, w, b, softcap=8.0), t)
    assert acc[0].compute() == acc[1].compute()


def test_matches_torchmetrics_on_random_data():
    tm = pytest.importorskip("torchmetrics")
    g = torch.Generator().manual_seed(5)
    N, D, V = 300, 32, 1000
    h = torch.randn(N, D, generator=g)
    w = torch.randn(V, D, generator=g) / 2
    t = (h @ w.T).topk(8, -1).indices[torch.arange(N), torch.randint(0, 8, (N,), generator=g)]
    t[::9] = IGN
    z = h @ w.T
    MA = tm.classification.MulticlassAccuracy
    ref = {"ppl": tm.text.Perplexity(ignore_index=IGN), "acc": MA(V, top_k=1, average="micro", ignore_index=IGN),
           "top5": MA(V, top_k=5, average="micro", ignore_index=IGN)}
    ref["ppl"].update(z[None], t[None])
    ref["acc"].update(z, t)
    ref["top5"].update(z, t)
    mc = dict(task="multiclass", num_classes=V, ignore_index=IGN)
    ours = dk.MetricGroup({"ppl": dk.Perplexity(ignore_index=IGN), "acc": dk.Accuracy(**mc),
                           "top5": dk.Accuracy(**mc, top_k=5)})
    ours.update(preds=dk.LinearLogits(h, w), target=t)
    out = ours.compute()
    torch.testing.assert_close(out["ppl"].float(), ref["ppl"].compute(), rtol=1e-5, atol=0)
    for k in ("acc", "top5"):
        assert abs(out[k].item() - ref[k].compute().item()) < 1e-6


def test_triton_interpreted_metrics(monkeypatch):
    if "triton" not in dk.ops.backends():
        pytest.skip("no triton")
    monkeypatch.setenv("D9D_KERNELS_BACKEND", "triton")
    h, w, _, t = case((24,), D=8, V=200)
    a, b = dk.MetricGroup(members(200)), dk.MetricGroup(members(200))
    a.update(preds=h @ w.T, target=t)
    b.update(preds=dk.LinearLogits(h, w), target=t)
    assert_same(a.compute(), b.compute(), ppl_rtol=1e-6)


def test_vocab_shard_local_equals_unsharded():
    h, w, _, t = case()
    V = w.shape[0]
    a = dk.MetricGroup({k: m for k, m in members(V).items() if k not in ("prec", "f1", "mcc", "acc_macro")})
    b = dk.MetricGroup({k: m for k, m in members(V).items() if k not in ("prec", "f1", "mcc", "acc_macro")})
    a.update(preds=dk.LinearLogits(h, w), target=t)
    shard = dk.VocabShard(0, V, dk.DistributedContext.local())
    b.update(preds=dk.LinearLogits(h, w), target=t, vocab=shard)
    assert_same(a.compute(), b.compute(), ppl_rtol=1e-12)


def test_combine_of_shards_equals_whole():
    from d9d_kernels.reference import linear_logits_combine as _combine

    h, w, b, t = case((50,), V=333, bias=True)
    whole = L.linear_logits(h, w, b, t)
    zt = whole[:, 2].clone()
    cuts = [0, 100, 101, 333]
    parts = torch.stack([L.linear_logits(h, w[lo:hi], b[lo:hi], t, zt, start=lo) for lo, hi in zip(cuts, cuts[1:])])
    out = torch.empty_like(whole)
    _combine(parts, out)
    ok = torch.isfinite(whole[:, 0])
    assert torch.equal(out[:, [0, 2, 3, 4]][ok], whole[:, [0, 2, 3, 4]][ok])
    torch.testing.assert_close(out[:, 1], whole[:, 1], rtol=1e-6, atol=0)


def test_errors_name_the_metric():
    h, w, _, t = case()
    V = w.shape[0]
    ll = dk.LinearLogits(h, w)
    for m, match in [
        (dk.AUROC(task="multiclass", num_classes=V), "AUROC: argument 'preds' is a dk.LinearLogits"),
        (dk.Precision(task="multiclass", num_classes=V, top_k=5), "needs top_k=1 for Precision"),
        (dk.Specificity(task="multiclass", num_classes=V, top_k=2), "needs top_k=1 for Specificity"),
        (dk.Accuracy(task="binary"), "needs task='multiclass'"),
        (dk.CalibrationError(task="multiclass", num_classes=V), "CalibrationError: argument 'preds'"),
        (dk.Accuracy(task="multiclass", num_classes=V + 1), "num_classes=701"),
    ]:
        with pytest.raises(ValueError, match=match) as e:
            m.update(ll, t)
        assert "Perplexity" in str(e.value) or "num_classes" in match
    with pytest.raises(ValueError, match="MetricGroup\\['auc'\\].*AUROC"):
        dk.MetricGroup({"acc": dk.Accuracy(task="multiclass", num_classes=V),
                        "auc": dk.AUROC(task="multiclass", num_classes=V)}).update(preds=ll, target=t)
    with pytest.raises(ValueError, match="Perplexity: argument 'target' must have hidden's leading shape"):
        dk.Perplexity().update(ll, t[:5])
    with pytest.raises(TypeError, match="Perplexity: argument 'target'"):
        dk.Perplexity().update(ll, t.float())
    with pytest.raises(ValueError, match="Perplexity: argument 'mask'"):
        dk.Perplexity().update(ll, t, mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(TypeError, match="LinearLogits: argument 'weight' must have hidden's dtype"):
        dk.LinearLogits(h, w.double())
    with pytest.raises(ValueError, match="LinearLogits: argument 'weight' must be \\[V, D\\]"):
        dk.LinearLogits(h, w[:, :3])
    with pytest.raises(ValueError, match="LinearLogits: argument 'softcap'"):
        dk.LinearLogits(h, w, softcap=0.0)
    with pytest.raises(ValueError, match="LinearLogits: argument 'hidden'"):
        dk.LinearLogits(h[0], w)


def test_bad_rows_counted():
    h, w, _, t = case((10,), dtype=torch.float32)
    t = t.clone()
    t[0], t[1] = 5000, 3
    h = h.clone()
    h[1, 0] = float("nan")
    m = dk.Perplexity(nan_strategy="ignore", num_classes=w.shape[0], ignore_index=IGN)
    m.update(dk.LinearLogits(h, w), t)
    c = m.bad_input_counts()
    assert sum(c.values()) == 2


@pytest.mark.gpu
def test_cuda_group_equals_materialised():
    h, w, _, t = case((4, 300), D=64, V=5000, dtype=torch.bfloat16)
    h, w, t = h.cuda(), w.cuda(), t.cuda()
    a, b = dk.MetricGroup(members(5000), device="cuda"), dk.MetricGroup(members(5000), device="cuda")
    a.update(preds=h @ w.T, target=t)
    b.update(preds=dk.LinearLogits(h, w), target=t)
    assert_same(a.compute(), b.compute(), ppl_rtol=1e-6)


# the vocabulary split unevenly over the tp ranks, out of rank order at 4
TP_SPLITS = {2: [(0, 300), (300, 700)], 4: [(500, 700), (0, 120), (300, 500), (120, 300)]}
TP_KEYS = ("ppl", "ppl_nlls", "acc", "top5", "top5_macro", "rec10")


def _tp_worker(rank, world, dtype_name):
    lo, hi = TP_SPLITS[world][rank]
    h, w, b, t = case((2, 20), dtype=getattr(torch, dtype_name), bias=True, seed=4)
    g = dk.MetricGroup({k: m for k, m in members(w.shape[0]).items() if k in TP_KEYS})
    shard = dk.VocabShard(lo, hi - lo, dk.DistributedContext())
    g.update(preds=dk.LinearLogits(h, w[lo:hi], b[lo:hi]), target=t, vocab=shard)  # this rank's LM-head shard
    return {k: v.tolist() for k, v in g.compute().items()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_vocab_shards_on_gloo_ranks_equal_materialised_logits(world, dtype_name):
    """A tensor-parallel LM head: each of 2 / 4 gloo ranks holds a weight shard; every
    rank's values equal the metrics of the whole materialised logits (ppl to rounding)."""
    from tests.dist_utils import run_distributed

    out = run_distributed(_tp_worker, world, dtype_name, timeout=240.0)
    h, w, b, t = case((2, 20), dtype=getattr(torch, dtype_name), bias=True, seed=4)
    ref = dk.MetricGroup({k: m for k, m in members(w.shape[0]).items() if k in TP_KEYS})
    ref.update(preds=torch.nn.functional.linear(h, w, b), target=t)
    want = ref.compute()
    # and plain torch on those logits: argmax / stable top-5 (the tie rule), float64 cross-entropy
    z, y = torch.nn.functional.linear(h, w, b).reshape(-1, w.shape[0]), t.reshape(-1)
    keep = y != IGN
    order = torch.sort(z[keep].double(), dim=1, descending=True, stable=True).indices
    plain = {"acc": (order[:, 0] == y[keep]).double().mean(),
             "top5": (order[:, :5] == y[keep, None]).any(1).double().mean(),
             "ppl": torch.nn.functional.cross_entropy(z[keep].double(), y[keep]).exp()}
    for rank in range(world):
        got = {k: torch.tensor(v, dtype=torch.float64) for k, v in out[rank].items()}
        assert_same(want, got, ppl_rtol=1e-6)
        for k, v in plain.items():
            torch.testing.assert_close(got[k], v, rtol=1e-6 if k == "ppl" else 0, atol=0, msg=k)


@pytest.mark.gpu
def test_cuda_update_makes_no_host_sync_and_replays_in_a_cuda_graph():
    """After a warm-up (Triton autotune, plans): an update from LinearLogits reads
    nothing on the host, and captured in a CUDA graph each replay adds the batch
    as an eager update does."""
    V = 4096
    h, w, _, t = case((256,), D=64, V=V, dtype=torch.bfloat16, seed=6)
    h, w, t = h.cuda(), w.cuda(), t.cuda()
    keys = ("ppl", "acc", "top5")
    g, ref = (dk.MetricGroup({k: m for k, m in members(V).items() if k in keys}, device="cuda") for _ in range(2))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            g.update(preds=dk.LinearLogits(h, w), target=t)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        g.update(preds=dk.LinearLogits(h, w), target=t)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g.update(preds=dk.LinearLogits(h, w), target=t)
    for _ in range(2):
        graph.replay()
    for _ in range(3 + 1 + 2):  # warm-up, the sync-debug update, the two replays (capture itself adds nothing)
        ref.update(preds=h @ w.T, target=t)
    assert_same(ref.compute(), g.compute(), ppl_rtol=1e-6)
