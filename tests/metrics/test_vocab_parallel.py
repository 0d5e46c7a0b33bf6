"""Vocab-parallel logits (``update(..., vocab=dk.VocabShard(...))``) on 2 and 4
real gloo ranks, the vocabulary split unevenly (and out of rank order): the
state every tp rank writes equals the unsharded single-process update's
(counts exactly, NLL sums to float64 rounding), perplexity within 1e-6 of
float64 ``F.cross_entropy``; ties, -inf masked columns, ignore_index, mask,
bad rows, ``lse=`` given; dp x tp synced over dp only; bad splits raise
ValueError on every rank."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

import d9d_kernels as dk
from tests.dist_utils import run_distributed, run_distributed_expect_errors

IGNORE = -100
V = 37
N = 41
# shard bounds by tp rank: uneven, and the 4-rank split out of vocabulary order
SPLITS = {2: [(0, 12), (12, 37)], 4: [(25, 30), (0, 5), (30, 37), (5, 25)]}
# a vocabulary wider than vocab_parallel.BLOCK: several candidate blocks per
# shard, one shard exactly one block wide, short last blocks
WIDE_V = 413
WIDE_SPLITS = {2: [(0, 150), (150, 413)], 4: [(300, 413), (0, 64), (200, 300), (64, 200)]}


def _batch(seed, dtype, dirty=False, V=V):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, V, generator=g, dtype=torch.float64) * 3
    t = torch.randint(0, V, (N,), generator=g)
    ties = torch.rand(N, generator=g) < 0.5  # coarse logits: many equal scores, across shard borders too
    x[ties] = torch.randint(-2, 3, (int(ties.sum()), V), generator=g).double()
    masked = torch.rand(N, V, generator=g) < 0.3  # -inf masked vocabulary entries, never the target
    masked[torch.arange(N), t] = False
    x = x.masked_fill(masked, float("-inf"))
    x[5] = 1.0  # one row of equal logits
    t[torch.rand(N, generator=g) < 0.15] = IGNORE
    mask = torch.rand(N, generator=g) < 0.9
    if dirty:  # bad rows: NaN, +Inf, all -Inf, target out of range; one NaN row ignored
        x[0, 3] = float("nan")
        x[1, 30] = float("inf")
        x[2] = float("-inf")
        t[3] = V + 2
        x[4, 20] = float("nan")
        t[4] = IGNORE
        mask[:5] = True
    return x.to(dtype), t, mask


def _metrics(V=V):
    nf = dict(nan_strategy="ignore")
    return {
        "group": dk.MetricGroup({
            "ppl": dk.Perplexity(ignore_index=IGNORE, num_classes=V),
            "acc": dk.Accuracy(task="multiclass", num_classes=V, ignore_index=IGNORE),
            "top5": dk.Accuracy(task="multiclass", num_classes=V, top_k=5, ignore_index=IGNORE),
            "top3_macro": dk.Accuracy(task="multiclass", num_classes=V, top_k=3, average="macro", ignore_index=IGNORE),
            "cm": dk.ConfusionMatrix(task="multiclass", num_classes=V, ignore_index=IGNORE),
        }),
        "ppl_alone": dk.Perplexity(ignore_index=IGNORE),
        "top2_nf": dk.Accuracy(task="multiclass", num_classes=V, top_k=2, ignore_index=IGNORE, **nf),
        "ppl_nf": dk.Perplexity(ignore_index=IGNORE, **nf),
        # given the loss's logsumexp: no exp pass
        "lse_group": dk.MetricGroup({
            "ppl": dk.Perplexity(ignore_index=IGNORE, num_classes=V),
            "top5": dk.Accuracy(task="multiclass", num_classes=V, top_k=5, ignore_index=IGNORE),
        }),
        "ppl_lse_nf": dk.Perplexity(ignore_index=IGNORE, **nf),
    }


def _feed(ms, x, t, mask, shard=None, lo=0, hi=None):
    kw = {} if shard is None else {"vocab": shard}
    p = x[:, lo:hi]
    ms["group"].update(preds=p, target=t, mask=mask, **kw)
    ms["ppl_alone"].update(p.reshape(1, N, -1), t.reshape(1, N), **kw)  # [B, T, V] logits
    ms["top2_nf"].update(p, t, mask, **kw)
    ms["ppl_nf"].update(p, t, mask, **kw)
    lse = torch.logsumexp(x.float(), dim=-1)  # the whole vocabulary's, as a vocab-parallel loss computes it
    ms["lse_group"].update(preds=p, target=t, mask=mask, lse=lse, **kw)
    ms["ppl_lse_nf"].update(p, t, mask, lse=lse, **kw)


def _states(ms):
    out = {}
    for name, m in ms.items():
        members = m._members.items() if isinstance(m, dk.MetricGroup) else [(name, m)]
        for mname, mm in members:
            for sname, s in mm._states().items():
                for slot, v in s.items():
                    out[f"{name}.{mname}.{sname}.{slot}"] = v.tolist()
    return out


def _run(ms, dtype, dirty, shard=None, lo=0, hi=None, V=V):
    for seed in (1, 2):
        x, t, mask = _batch(seed, dtype, dirty and seed == 2, V)
        _feed(ms, x, t, mask, shard, lo, hi)
    return _states(ms)


def _tp_worker(rank, world, dtype_name, dirty, V):
    lo, hi = (SPLITS if V == 37 else WIDE_SPLITS)[world][rank]
    shard = dk.VocabShard(lo, hi - lo, dk.DistributedContext())
    return _run(_metrics(V), getattr(torch, dtype_name), dirty, shard, lo, hi, V)


def _assert_same_state(got, want):
    assert got.keys() == want.keys()
    for k in want:
        g, w = torch.tensor(got[k], dtype=torch.float64), torch.tensor(want[k], dtype=torch.float64)
        if k.endswith(".extras"):  # [valid rows, NLL sum]: the NLL to float64 rounding of a different order
            assert g[0] == w[0], k
            torch.testing.assert_close(g[1], w[1], rtol=1e-6, atol=1e-9, msg=k)
        else:
            assert torch.equal(g, w), f"{k}: {g} != {w}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
@pytest.mark.parametrize("dirty", [False, True])
@pytest.mark.parametrize("V", [V, WIDE_V])
def test_sharded_state_equals_unsharded(world, dtype_name, dirty, V):
    out = run_distributed(_tp_worker, world, dtype_name, dirty, V, timeout=240.0)
    want = _run(_metrics(V), getattr(torch, dtype_name), dirty, V=V)
    for rank in range(world):
        _assert_same_state(out[rank], want)


def _ppl_worker(rank, world, dtype_name):
    lo, hi = SPLITS[world][rank]
    ms = _metrics()
    shard = dk.VocabShard(lo, hi - lo, None)
    _run(ms, getattr(torch, dtype_name), False, shard, lo, hi)
    vals = ms["group"].compute()
    return {"ppl": vals["ppl"].item(), "ppl_alone": ms["ppl_alone"].compute().item(),
            "acc": vals["acc"].item(), "top5": vals["top5"].item()}


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_perplexity_and_topk_match_float64_torch(dtype_name):
    out = run_distributed(_ppl_worker, 2, dtype_name, timeout=180.0)
    xs, ts = [], []
    for seed in (1, 2):
        x, t, mask = _batch(seed, getattr(torch, dtype_name))
        xs.append(x.double())
        ts.append(torch.where(mask, t, IGNORE))
    x, t = torch.cat(xs), torch.cat(ts)
    want = torch.exp(F.cross_entropy(x, t, ignore_index=IGNORE)).item()
    keep = t != IGNORE
    # top-k with ties broken towards the lower index: a stable descending sort
    order = torch.sort(x[keep], dim=1, descending=True, stable=True).indices
    hits = order == t[keep][:, None]
    for r in out:
        assert abs(r["ppl"] - want) <= 1e-6 * want
        assert r["acc"] == pytest.approx(hits[:, :1].any(1).double().mean().item(), abs=1e-12)
        assert r["top5"] == pytest.approx(hits[:, :5].any(1).double().mean().item(), abs=1e-12)
    # ppl_alone saw the batches without the mask
    xs2 = torch.cat([_batch(s, getattr(torch, dtype_name))[0].double() for s in (1, 2)])
    ts2 = torch.cat([_batch(s, getattr(torch, dtype_name))[1] for s in (1, 2)])
    want2 = torch.exp(F.cross_entropy(xs2, ts2, ignore_index=IGNORE)).item()
    assert all(abs(r["ppl_alone"] - want2) <= 1e-6 * want2 for r in out)


def _dp_tp_worker(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    lo, hi = SPLITS[2][tp]
    ms = _metrics()
    for seed in (10 + dp, 20 + dp):  # each dp replica its own batches
        x, t, mask = _batch(seed, torch.float32)
        _feed(ms, x, t, mask, dk.VocabShard(lo, hi - lo, mesh["tp"]), lo, hi)
    ctx = dk.DistributedContext.from_mesh(mesh, dims=("dp",))
    for m in ms.values():
        m.sync_and_compute(ctx)
    return {"group": {k: v.tolist() for k, v in ms["group"].compute().items()},
            "ppl_alone": ms["ppl_alone"].compute().item()}


def test_dp_x_tp_synced_over_dp_equals_unsharded():
    out = run_distributed(_dp_tp_worker, 4, timeout=240.0)
    ms = _metrics()
    for dp in (0, 1):
        for seed in (10 + dp, 20 + dp):
            x, t, mask = _batch(seed, torch.float32)
            _feed(ms, x, t, mask)
    want = {k: v.tolist() for k, v in ms["group"].compute().items()}
    for r in out:
        for k, w in want.items():  # counts exact; perplexity to the 1e-6 of its float32 row sums
            torch.testing.assert_close(torch.tensor(r["group"][k]), torch.tensor(w), rtol=1e-6 if k == "ppl" else 1e-12,
                                       atol=0, msg=k)
        assert r["ppl_alone"] == pytest.approx(ms["ppl_alone"].compute().item(), rel=1e-6)


def _bad_worker(rank, world, case):
    lo, hi = SPLITS[world][rank]
    rows = N
    if case == "gap" and rank == 1:
        lo += 1
    if case == "overlap" and rank == 1:
        lo -= 2
    if case == "rows" and rank == world - 1:
        rows = N - 3
    width = hi - lo
    size = width + 1 if case == "size" and rank == 0 else width
    x = torch.randn(rows, width)
    t = torch.randint(0, 5, (rows,))
    m = dk.Perplexity() if case != "size" else dk.Accuracy(task="multiclass", num_classes=V, top_k=2)
    m.update(x, t, vocab=dk.VocabShard(lo, size, None))
    return "no error"


@pytest.mark.parametrize("world,case", [(2, "gap"), (2, "overlap"), (4, "gap"), (2, "rows"), (4, "rows"), (2, "size")])
def test_bad_split_raises_value_error_on_every_rank(world, case):
    out = run_distributed_expect_errors(_bad_worker, world, case, timeout=120.0)
    name = "Accuracy" if case == "size" else "Perplexity"
    arg = "'preds'" if case == "rows" else "'vocab'"
    for rank, (status, msg) in out.items():
        assert status == "error", (rank, status, msg)
        assert msg.startswith(f"ValueError: {name}: argument {arg}"), msg
        if case in ("gap", "overlap"):
            assert case in msg and "do not tile the vocabulary" in msg


def _wrong_tp_worker(rank, world, how):
    """dp 2 x tp 2, the vocabulary split over tp; ``tp`` names all 4 ranks instead."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    lo, hi = SPLITS[2][mesh.get_local_rank("tp")]
    tp = {"none": None, "mesh": mesh}[how]
    dk.Perplexity().update(torch.randn(N, hi - lo), torch.randint(0, 5, (N,)), vocab=dk.VocabShard(lo, hi - lo, tp))
    return "no error"


@pytest.mark.parametrize("how", ["none", "mesh"])
def test_shard_without_the_tp_ranks_says_to_pass_them(how):
    """No tp (the world) or the whole 2-d mesh: the error says to pass the d9d
    context or mesh["tp"], before the tiling details."""
    out = run_distributed_expect_errors(_wrong_tp_worker, 4, how, timeout=120.0)
    for rank, (status, msg) in out.items():
        assert status == "error", (rank, status, msg)
        head = msg.split("(", 1)[0]
        assert msg.startswith("ValueError: Perplexity: argument 'vocab': VocabShard"), msg
        assert "no tp" in head if how == "none" else "2-d DeviceMesh" in head, msg
        assert 'pass tp=dist_context' in msg and 'tp=mesh["tp"]' in msg and "overlap" in msg, msg


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_partials_and_combine_path_equals_unsharded(monkeypatch, dtype):
    """Where the compiled passes cannot run (CUDA, no extension), the torch
    partials in row blocks (CHUNK_SCORES small: several blocks) and the torch
    combine write the unsharded state, dirty rows included."""
    from d9d_kernels.metrics import vocab_parallel as vp

    monkeypatch.setattr(vp, "vocab_partials", lambda *a: None)
    monkeypatch.setattr(vp, "vocab_class_stats", lambda *a: False)
    monkeypatch.setattr(vp, "CHUNK_SCORES", 7 * V)
    local = dk.VocabShard(0, V, dk.DistributedContext.local())
    a, b = _metrics(), _metrics()
    for seed in (1, 2):
        x, t, mask = _batch(seed, dtype, dirty=True)
        _feed(a, x, t, mask)
        _feed(b, x, t, mask, local)
    _assert_same_state(_states(b), _states(a))


def test_local_shard_and_argument_errors():
    x, t, mask = _batch(3, torch.float32)
    local = dk.VocabShard(0, V, dk.DistributedContext.local())
    a, b = _metrics(), _metrics()
    _feed(a, x, t, mask)
    _feed(b, x, t, mask, local)
    _assert_same_state(_states(b), _states(a))
    empty = (torch.zeros(0, V), torch.zeros(0, dtype=torch.long))
    for name in ("ppl_alone", "top2_nf"):
        a[name].update(*empty)
        b[name].update(*empty, vocab=local)
    _assert_same_state(_states(b), _states(a))
    with pytest.raises(ValueError, match="argument 'size' must be >= 1"):
        dk.VocabShard(0, 0)
    with pytest.raises(TypeError, match="argument 'start' must be an int"):
        dk.VocabShard(1.0, 3)
    with pytest.raises(ValueError, match="Perplexity: argument 'vocab' shards tile a vocabulary of 37 but num_classes=40"):
        dk.Perplexity(num_classes=40).update(x, t, vocab=local)
    with pytest.raises(ValueError, match="Perplexity: argument 'lse' must have target's shape"):
        dk.Perplexity().update(x, t, lse=torch.zeros(N + 1), vocab=local)
    with pytest.raises(ValueError, match="Accuracy: argument 'vocab' needs task='multiclass'"):
        dk.Accuracy(task="binary").update(x[:, 0], t.clamp(0, 1), vocab=local)
    with pytest.raises(ValueError, match="Accuracy: argument 'preds' must be this rank's scores"):
        dk.Accuracy(task="multiclass", num_classes=V).update(x.T, t, vocab=local)
    with pytest.raises(TypeError, match="Accuracy: argument 'vocab' must be a dk.VocabShard"):
        dk.Accuracy(task="multiclass", num_classes=V).update(x, t, vocab=(0, V))


def _partials(impl, monkeypatch, x, t, start, kmax, sumexp=True):
    """A shard's partials by the compiled op ("op") or the torch-ops specification ("torch:<BLOCK>")."""
    from d9d_kernels.metrics import vocab_parallel as vp
    op = importlib.import_module("d9d_kernels.ops.vocab_partials")

    if impl == "op":
        if not op.AVAILABLE:
            pytest.skip("d9d_kernels._C without vocab_partials")
        out = dk.ops.vocab_partials(x, t, start, kmax, sumexp)
        assert out is not None
        return out
    monkeypatch.setattr(vp, "BLOCK", int(impl.split(":")[1]))
    return vp._local_partials(x, t, start, kmax, sumexp)


IMPLS = ["op", "torch:1", "torch:4", "torch:64"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_shard_partials_match_stable_sort(monkeypatch, impl, dtype):
    g = torch.Generator().manual_seed(len(impl))
    for size in (1, 3, 4, 5, 9, 17, 130):
        x = torch.randint(-3, 3, (30, size), generator=g).double()
        x[torch.rand(30, size, generator=g) < 0.3] = float("-inf")
        x[0] = float("-inf")
        x[1] = -0.0
        x[2, ::2] = 0.0
        x = x.to(dtype)
        t = torch.randint(0, size, (30,), generator=g)
        t[3] = size + 5  # another rank's column
        want = torch.sort(x.double(), dim=1, descending=True, stable=True)
        for kmax in (0, 1, 2, 5, 7):
            out = _partials(impl, monkeypatch, x, t + 1000, 1000, kmax)
            kk = min(kmax, size)
            assert torch.equal(out[:, 0], x.double().amax(1))
            here = t < size
            assert torch.equal(out[here, 1], x.double()[torch.arange(30), t.clamp(max=size - 1)][here])
            assert (out[~here, 1] == float("-inf")).all()
            assert torch.equal(out[:, 3 + kmax : 3 + kmax + kk], want.indices[:, :kk].double() + 1000), (size, kmax)
            assert torch.equal(out[:, 3 : 3 + kk], want.values[:, :kk])
            assert (out[:, 3 + kk : 3 + kmax] == float("-inf")).all()
            assert (out[:, 3 + kmax + kk :] >= size + 1000).all()
            fin = torch.isfinite(out[:, 0])
            m = out[fin, 0]
            torch.testing.assert_close(m + out[fin, 2].log(), torch.logsumexp(x.double()[fin], 1), rtol=1e-6, atol=1e-6)
            assert (out[~fin, 2] == 0).all()  # rows of only -inf: nothing to add


@pytest.mark.parametrize("impl", ["op", "torch:64"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_shard_partials_of_wide_and_bad_rows(monkeypatch, impl, dtype):
    """Vocabulary-wide rows (odd widths, -inf masks, ties, values at ±1e4):
    max, top-k and Σ exp(x - max) within 1e-6 of float64; a row with a NaN (in
    its last column too) or +Inf has a non-finite max, so the combine counts it
    bad; a row of only -inf keeps max -inf and its first columns as top-k."""
    g = torch.Generator().manual_seed(5)
    for size in (33, 1000, 50257):
        x = (torch.randn(9, size, generator=g) * 4).double()
        x[1, ::2] = float("-inf")
        x[2] = float("-inf")
        x[3, -1] = float("nan")
        x[4, size // 2] = float("inf")
        x[5, :] = torch.randint(-1, 2, (size,), generator=g).double()  # ties everywhere
        x[6] = x[6] * 2500  # ±1e4
        x = x.to(dtype)
        t = torch.randint(0, size, (9,), generator=g)
        xd = x.double()
        for kmax in (0, 5, 64):
            out = _partials(impl, monkeypatch, x, t + 7, 7, kmax)
            good = torch.tensor([i not in (2, 3, 4) for i in range(9)])
            assert torch.isnan(out[3, 0]) and not torch.isfinite(out[4, 0]) and out[2, 0] == float("-inf")
            assert torch.equal(out[good, 0], xd[good].amax(1))
            torch.testing.assert_close(out[good, 0] + out[good, 2].log(), torch.logsumexp(xd[good], 1), rtol=1e-6,
                                       atol=0)
            want = torch.sort(xd, dim=1, descending=True, stable=True)
            rows, kk = good | (torch.arange(9) == 2), min(kmax, size)
            assert torch.equal(out[rows, 3 : 3 + kk], want.values[rows, :kk])
            assert torch.equal(out[rows, 3 + kmax : 3 + kmax + kk], want.indices[rows, :kk].double() + 7)


def _gathered(W, n=64, Vw=97):
    """Logits ``[n, Vw]`` float64 with ties, -inf masks and all -inf / NaN /
    +Inf rows (0, 1, 2), targets, and the vocabulary split into W uneven shards."""
    g = torch.Generator().manual_seed(W)
    x = torch.randint(-3, 4, (n, Vw), generator=g).double()
    x[torch.rand(n, Vw, generator=g) < 0.3] = float("-inf")
    x[32:] = torch.randn(n - 32, Vw, generator=g).double()
    x[0] = float("-inf")
    x[1, 5] = float("nan")
    x[2, -1] = float("inf")
    t = torch.randint(0, Vw, (n,), generator=g)
    cuts = sorted(torch.randperm(Vw - 1, generator=g)[: W - 1].add(1).tolist())
    return x, t, list(zip([0] + cuts, cuts + [Vw]))


@pytest.mark.parametrize("W", [1, 2, 3, 5])
def test_torch_combine_equals_float64_references(W):
    """The torch combine (two stable sorts; the specification) of gathered
    partials of uneven shards, some narrower than k: lse against float64
    ``logsumexp``, top-k against a stable sort of the whole row, bad rows flagged."""
    from d9d_kernels.metrics import vocab_parallel as vp

    x, t, bounds = _gathered(W)
    n = x.shape[0]
    for kmax in (1, 5, 7):
        parts = torch.stack([vp._local_partials(x[:, a:b].float(), t, a, kmax, True) for a, b in bounds])
        got = vp._combine(parts, n, W, kmax, True)
        ok = torch.isfinite(got.row_max)
        assert not ok[:3].any() and ok[3:].all()
        torch.testing.assert_close(got.lse[ok], torch.logsumexp(x[ok], 1), rtol=1e-6, atol=0)
        assert torch.equal(got.target_logit[ok], x[ok].gather(1, t[ok, None])[:, 0])
        assert torch.equal(got.top[ok], torch.sort(x[ok], dim=1, descending=True, stable=True).indices[:, :kmax])


@pytest.mark.parametrize("W", [1, 2, 3, 5])
def test_class_stats_op_equals_the_torch_combine_and_add(W):
    """The compiled combine-and-add of gathered partials (a W-way merge, rows
    added in C++) writes the state its torch specification (``_combine`` then
    ``_add_rows``) writes: counts exactly, the NLL sum to float64 rounding;
    every top_ks / confmat / nll / lse / rows_by_lse combination, mask,
    ignore_index, out-of-range targets, bad rows."""
    from d9d_kernels.metrics import vocab_parallel as vp

    op = importlib.import_module("d9d_kernels.ops.vocab_partials")
    if not op.COMBINE:
        pytest.skip("d9d_kernels._C without vocab_class_stats")
    x, t, bounds = _gathered(W)
    n, Vw = x.shape
    t[3], t[4], t[6], t[7] = -1, Vw, IGNORE, IGNORE  # out of range both sides, ignored
    mask = torch.rand(n, generator=torch.Generator().manual_seed(7)) < 0.8
    lse = torch.logsumexp(x, 1)
    lse[8] = float("inf")
    lse[9] = float("nan")
    cases = [(top_ks, confmat, nll, with_lse, by_lse, m)
             for top_ks in ((), (1,), (1, 5), (7,)) for confmat in (False, True) for nll in (False, True)
             for with_lse in (False, True) for by_lse in (False, True) for m in (None, mask)
             if (nll or not with_lse) and (with_lse or not by_lse) and (top_ks or confmat or nll)]
    for top_ks, confmat, nll, with_lse, by_lse, m in cases:
        kmax = max(max(top_ks, default=0), int(confmat))
        sumexp = nll and not with_lse
        parts = torch.stack([vp._local_partials(x[:, a:b].float(), t, a, kmax, sumexp) for a, b in bounds])
        l = lse if with_lse else None

        def fresh():
            return (torch.zeros(len(top_ks), 3, Vw, dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
                    torch.zeros(2, dtype=torch.float64), torch.zeros(Vw, Vw, dtype=torch.float64) if confmat else None)

        got, want = fresh(), fresh()
        assert op.vocab_class_stats(parts, t, m, IGNORE, l, Vw, top_ks, nll, by_lse, *got)
        vp._add_rows(vp._combine(parts, n, W, kmax, sumexp), t, m, IGNORE, Vw, top_ks, nll, l, by_lse, *want)
        case = (top_ks, confmat, nll, with_lse, by_lse, m is not None)
        assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]), case
        assert got[1][0] == want[1][0], case
        torch.testing.assert_close(got[1][1], want[1][1], rtol=1e-12, atol=0, msg=str(case))
        if confmat:
            assert torch.equal(got[3], want[3]), case
        assert want[2][0] > 0 and want[2][1] > 0 and want[1][0] > 0, case  # the case exercises every branch


def test_class_stats_op_argument_errors():
    op = importlib.import_module("d9d_kernels.ops.vocab_partials")
    if not op.COMBINE:
        pytest.skip("d9d_kernels._C without vocab_class_stats")
    f = torch.ops.d9d_kernels.vocab_class_stats
    n, C = 4, 10
    g = torch.zeros(2, n, 2 + 1 + 2 * 5, dtype=torch.float64)
    t = torch.zeros(n, dtype=torch.long)
    stats, extras, bad = torch.zeros(2, 3, C, dtype=torch.float64), torch.zeros(2, dtype=torch.float64), \
        torch.zeros(2, dtype=torch.float64)
    ok = (g, t, None, None, None, C, [1, 5], True, False, stats, extras, bad, None)
    for i, v, match in [(0, g[:, :, :-1], "argument 'g' must be a contiguous \\[W >= 1, N, 13\\]"),
                        (1, t[:3], "argument 'target' must be \\[N\\] = \\[4\\]"),
                        (2, torch.ones(3, dtype=torch.bool), "argument 'mask' must have shape"),
                        (4, torch.zeros(n), "argument 'g' must be a contiguous \\[W >= 1, N, 12\\]"),
                        (6, [1, 65], "argument 'top_ks' must be in \\[1, 64\\]"),
                        (9, stats[:1], "argument 'stats' must be float64 \\[2, 3, 10\\]"),
                        (12, torch.zeros(C, C + 1, dtype=torch.float64), "argument 'confmat' must be float64")]:
        args = list(ok)
        args[i] = v
        with pytest.raises((ValueError, TypeError), match="vocab_class_stats: " + match):
            f(*args)
    with pytest.raises(ValueError, match="argument 'rows_by_lse' needs lse"):
        f(*ok[:8], True, *ok[9:])
    with pytest.raises(TypeError, match="vocab_class_stats: argument 'lse' must be float64"):  # lse given: P = 12
        f(g[:, :, :-1].contiguous(), t, None, None, torch.zeros(n), *ok[5:])
    assert not stats.any() and not extras.any() and not bad.any()  # checks run before any write


def test_vocab_partials_op_argument_errors():
    op = importlib.import_module("d9d_kernels.ops.vocab_partials")

    if not op.AVAILABLE:
        pytest.skip("d9d_kernels._C without vocab_partials")
    x, t = torch.randn(4, 10), torch.zeros(4, dtype=torch.long)
    out = torch.empty(4, 2 + 1 + 2 * 3, dtype=torch.float64)
    f = torch.ops.d9d_kernels.vocab_partials
    before = out.clone()
    with pytest.raises(ValueError, match="vocab_partials: argument 'target' must be \\[N\\] = \\[4\\]"):
        f(x, t[:3], 0, 3, True, out)
    with pytest.raises(ValueError, match="vocab_partials: argument 'kmax' must be in \\[0, 64\\]"):
        f(x, t, 0, 65, True, out)
    with pytest.raises(ValueError, match="vocab_partials: argument 'out' must be float64 \\[4, 8\\]"):
        f(x, t, 0, 3, False, out)
    with pytest.raises(ValueError, match="vocab_partials: argument 'x' must be 2-D"):
        f(x.T, t, 0, 3, True, out)
    with pytest.raises(TypeError, match="vocab_partials: argument 'target' must be int64"):
        f(x, t.int(), 0, 3, True, out)
    assert torch.equal(out.nan_to_num(), before.nan_to_num())  # untouched: checks run before any write
    assert dk.ops.vocab_partials(x.T, t, 0, 3, True) is None  # not served: the caller's torch ops take it
    assert dk.ops.vocab_partials(x, t, 0, 65, True) is None


def test_docstring_examples_run():
    import doctest

    from d9d_kernels.metrics import vocab_parallel

    result = doctest.testmod(vocab_parallel, raise_on_error=False)
    assert result.attempted > 0 and result.failed == 0


class _Counting(dk.DistributedContext):
    """The world group, counting the collectives launched through it."""

    calls = 0

    def all_gather_into_tensor(self, output, input):
        type(self).calls += 1
        return super().all_gather_into_tensor(output, input)

    def all_reduce(self, tensor, op):
        type(self).calls += 1
        return super().all_reduce(tensor, op)


def _count_worker(rank, world):
    lo, hi = SPLITS[world][rank]
    ctx = _Counting()
    g = _metrics()["group"]  # Perplexity(num_classes=V) + accuracies + confusion matrix: one merged statistic
    counts = []
    for seed in (1, 2, 3):
        x, t, mask = _batch(seed, torch.float32)
        before = _Counting.calls
        g.update(preds=x[:, lo:hi], target=t, mask=mask, vocab=dk.VocabShard(lo, hi - lo, ctx))
        counts.append(_Counting.calls - before)
    before = _Counting.calls  # an empty batch: its new signature's metadata check, no gather
    g.update(preds=torch.zeros(0, hi - lo), target=torch.zeros(0, dtype=torch.long),
             vocab=dk.VocabShard(lo, hi - lo, ctx))
    counts.append(_Counting.calls - before)
    return counts


def test_one_collective_per_update_after_the_first():
    # the first update also checks the metadata (one small all-gather), cached for the signature
    assert run_distributed(_count_worker, 2, timeout=120.0) == [[2, 1, 1, 1], [2, 1, 1, 1]]
