"""d9d's DistributedContext as a ctx, with the real d9d package on CPU gloo ranks.

d9d's context is built with ``object.__new__`` (its ``__init__`` needs CUDA)
and the two attributes ``mesh_for`` / ``mesh_params`` read: ``_params`` and
``_meshes`` (every domain, built by d9d's own domain providers on CPU).
Layouts on 4 ranks (one spawn, module fixture):

* "dp_tp": dp_shard 2 x tp 2, each tp pair sees the same data;
* "pp_dp": pp 2 x dp_shard 2, only the last pp stage updates.

References come from plain torch / scikit-learn / torchmetrics on the
concatenated distinct data; d9d's built-in metrics are compared wherever they
are correct, and d9d's SumMetric is shown to count tp replicas twice.
"""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("d9d.metric")  # "d9d" alone could be this test folder (a namespace package)

import d9d_kernels as dk  # noqa: E402
from d9d_kernels.distributed import as_context  # noqa: E402
from tests.dist_utils import run_distributed, spy_collectives  # noqa: E402

C = 7  # classes
SHARD_SIZES = (41, 58)  # uneven data shards, two batches each
LAYOUTS = {
    "dp_tp": dict(data_parallel_shard=2, tensor_parallel=2),
    "pp_dp": dict(pipeline_parallel=2, data_parallel_shard=2),
}
NAMES = ("loss", "tokens", "top1", "top5", "f1", "auroc")


# ---------------------------------------------------------------- data and metrics
def _shard(i: int) -> dict:
    """Data shard ``i``: per-sequence losses and token counts, class logits, binary scores."""
    g = torch.Generator().manual_seed(100 + i)
    n = SHARD_SIZES[i]
    y = torch.arange(n) % C  # every class present
    logits = torch.randn(n, C, generator=g, dtype=torch.float64)
    logits[torch.arange(n), y] += 1.0  # better than chance, not perfect
    b = torch.randint(0, 2, (n,), generator=g)
    p = (torch.rand(n, generator=g, dtype=torch.float64) + 0.6 * b).clamp(max=0.9999) / 1.6
    return dict(loss=torch.rand(n, generator=g, dtype=torch.float64) * 4, tokens=torch.randint(1, 20, (n,), generator=g)
                .double(), logits=logits, y=y, p=p, b=b)


def _batches(i: int):
    d = _shard(i)
    half = SHARD_SIZES[i] // 2
    return [{k: v[:half] for k, v in d.items()}, {k: v[half:] for k, v in d.items()}]


def _dk_group():
    return dk.MetricGroup({
        "loss": dk.WeightedMeanMetric(),
        "tokens": dk.SumMetric(),
        "top1": dk.Accuracy(task="multiclass", num_classes=C),
        "top5": dk.Accuracy(task="multiclass", num_classes=C, top_k=5),
        "f1": dk.F1Score(task="multiclass", num_classes=C, average="macro"),
        "auroc": dk.AUROC(task="binary", num_bins=10_000),
    })


def _d9d_builtins():
    from d9d.metric.impl.aggregation import SumMetric, WeightedMeanMetric
    from d9d.metric.impl.classification import BinaryAUROCMetric, confusion_matrix_metric
    from d9d.metric.impl.container import ComposeMetric

    return ComposeMetric({
        "loss": WeightedMeanMetric(),
        "tokens": SumMetric(),
        "top1": confusion_matrix_metric().multiclass(C, top_k=1).with_accuracy().build(),
        "top5": confusion_matrix_metric().multiclass(C, top_k=5).with_accuracy().build(),
        "f1": confusion_matrix_metric().multiclass(C).with_f1().macro().build(),
        "auroc": BinaryAUROCMetric(num_bins=10_000),
    })


def _feed_dk(g, d):
    g["loss"].update(values=d["loss"], weights=d["tokens"])
    g["tokens"].update(d["tokens"])
    g["top1"].update(preds=d["logits"], target=d["y"])  # top1, top5, f1 share one state: fed once
    g["auroc"].update(preds=d["p"], target=d["b"])  # binary: its own inputs


def _feed_d9d(c, d):
    c["loss"].update(d["loss"].float(), d["tokens"].float())
    c["tokens"].update(d["tokens"].float())
    for name in ("top1", "top5", "f1"):
        c[name].update(d["logits"].float(), d["y"])
    c["auroc"].update(d["p"].float(), d["b"])


def _values(out: dict) -> dict:
    return {k: float(v) for k, v in out.items()}


def _reference() -> dict:
    """The global values over the distinct data, without d9d_kernels."""
    from sklearn.metrics import f1_score, roc_auc_score
    from torchmetrics.functional import accuracy

    d = {k: torch.cat([_shard(i)[k] for i in range(len(SHARD_SIZES))]) for k in _shard(0)}
    return {
        "loss": float((d["loss"] * d["tokens"]).sum() / d["tokens"].sum()),
        "tokens": float(d["tokens"].sum()),
        "top1": float(accuracy(d["logits"], d["y"], task="multiclass", num_classes=C, top_k=1, average="micro")),
        "top5": float(accuracy(d["logits"], d["y"], task="multiclass", num_classes=C, top_k=5, average="micro")),
        "f1": float(f1_score(d["y"].numpy(), d["logits"].argmax(1).numpy(), average="macro")),
        "auroc": float(roc_auc_score(d["b"].numpy(), d["p"].numpy())),
    }


def _check(got: dict, ref: dict, what: str) -> None:
    for k in NAMES:
        tol = 1e-3 if k == "auroc" else 1e-6  # AUROC from 10,000 score bins
        assert got[k] == pytest.approx(ref[k], rel=tol, abs=tol), (what, k, got[k], ref[k])


# ---------------------------------------------------------------- d9d's context on CPU
def _d9d_context(**degrees):
    """A real d9d DistributedContext whose meshes are CPU meshes (d9d's own domain builders)."""
    from d9d.core.dist_context import DeviceMeshParameters, DistributedContext, configured, device_mesh_domains
    from torch.distributed.device_mesh import init_device_mesh

    params = DeviceMeshParameters(**degrees)
    ctx = object.__new__(DistributedContext)
    ctx._params = params
    ctx._meshes = {}
    if params.is_distributed:
        build = device_mesh_domains.init_device_mesh
        device_mesh_domains.init_device_mesh = lambda device_type, **kw: init_device_mesh("cpu", **kw)
        try:
            ctx._meshes = configured._build_mesh_domains(params)
        finally:
            device_mesh_domains.init_device_mesh = build
    return ctx


def _layout_run(rank: int, layout: str, calls: list, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from d9d.metric.impl.container import ComposeMetric

    ctx = _d9d_context(**LAYOUTS[layout])
    regular = ctx.mesh_for("regular")
    if layout == "dp_tp":  # tp ranks of one dp_shard index see the same data
        data, updates = regular.get_local_rank("dp_shard"), True
    else:  # only the last pipeline stage computes the loss and updates metrics
        data, updates = regular.get_local_rank("dp_shard"), regular.get_local_rank("pp") == 1
    resolved = as_context(ctx)
    out = dict(ranks=resolved.ranks, cached=as_context(ctx) is resolved, updates=updates)

    g = _dk_group()
    ours = ComposeMetric({"train": g})
    theirs = _d9d_builtins()
    batches = _batches(data) if updates else [None, None]
    counts = []
    for step, batch in enumerate([*batches, None]):  # sync after each batch, and once more with nothing new
        if batch is not None:
            _feed_dk(g, batch)
            _feed_d9d(theirs, batch)
        before = len(calls)
        ours.sync(ctx)
        counts.append(len(calls) - before)
    out["counts"] = counts
    out["dk"] = _values(ours.compute()["train"])
    dcp.save({"metrics": g}, checkpoint_id=f"{path}/{layout}")  # resumed on 2 ranks below
    theirs.sync(ctx)
    out["d9d"] = _values(theirs.compute())

    # checkpoint round trip through d9d's container: local state back, the same global value
    state = ours.state_dict()
    restored = ComposeMetric({"train": _dk_group()})
    restored.load_state_dict(state)
    restored.sync(ctx)
    out["restored"] = _values(restored.compute()["train"])

    ours.reset()
    ours.sync(ctx)
    out["after_reset"] = float(ours.compute()["train"]["tokens"])

    # dk.functional and the explicit overrides take the d9d context too
    out["functional"] = dk.functional.reduce_sum({"n": torch.ones(())}, ctx=ctx)["n"].item()
    out["dp_only"] = dk.DistributedContext.from_d9d(ctx, dims=("dp_shard",)).ranks
    out["from_mesh_all"] = dk.DistributedContext.from_mesh(ctx, dims=("pp", "dp_shard", "tp")).world_size
    out["from_mesh_default"] = dk.DistributedContext.from_mesh(ctx).ranks

    # a vocabulary split over tp, named by the d9d context: the shard combines over tp, the sync over data
    if layout == "dp_tp":
        d, lo = _shard(data), (0, 4)[regular.get_local_rank("tp")]
        hi = 4 if lo == 0 else C
        shard = dk.VocabShard(lo, hi - lo, tp=ctx)
        ppl = dk.Perplexity()
        ppl.update(d["logits"][:, lo:hi], d["y"], vocab=shard)
        ppl.sync(ctx)
        out["vocab_ranks"], out["ppl"] = shard.ctx.ranks, float(ppl.compute())
    return out


def _worker(rank, world, path):
    calls: list = []
    spy_collectives(calls)
    return {layout: _layout_run(rank, layout, calls, path) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return str(tmp_path_factory.mktemp("d9d_layouts"))


@pytest.fixture(scope="module")
def run4(saved):
    return run_distributed(_worker, 4, saved, timeout=90, pg_timeout=20)


def _resume_worker(rank, world, path):
    import torch.distributed.checkpoint as dcp

    out = {}
    for layout in LAYOUTS:
        g = _dk_group()
        n = dk.checkpoint.saved_world_size(f"{path}/{layout}", key="metrics")
        dcp.load({"metrics": dk.checkpoint.for_resume(g, n)}, checkpoint_id=f"{path}/{layout}")
        out[layout] = _values(g.sync_and_compute())
    return out


@pytest.fixture(scope="module")
def reference():
    return _reference()


# ---------------------------------------------------------------- 4 ranks
def test_dp_tp_reduces_over_dp_only(run4, reference):
    """dp_shard 2 x tp 2: every rank's value is the global value over the distinct
    data; d9d's own SumMetric (world all-reduce) counts every token tp = 2 times."""
    for rank, out in enumerate(run4):
        o = out["dp_tp"]
        assert o["ranks"] == ([0, 2] if rank % 2 == 0 else [1, 3]) and o["cached"], o
        _check(o["dk"], reference, f"rank {rank}")
        assert o["d9d"]["tokens"] == pytest.approx(2 * reference["tokens"]), o["d9d"]
        # d9d's ratios are unchanged by the duplication: equal to ours
        _check({**o["d9d"], "tokens": o["d9d"]["tokens"] / 2}, o["dk"], f"rank {rank} vs d9d")


def test_vocab_shard_takes_the_tp_dim_of_a_d9d_context(run4):
    """``VocabShard(tp=d9d_ctx)`` combines the vocabulary over the tp pair (not the data
    dims a metric syncs over); the synced perplexity is plain torch's over all the data."""
    shards = [_shard(i) for i in range(2)]
    logits, y = torch.cat([d["logits"] for d in shards]), torch.cat([d["y"] for d in shards])
    want = torch.nn.functional.cross_entropy(logits, y).exp().item()
    for rank, out in enumerate(run4):
        o = out["dp_tp"]
        assert o["vocab_ranks"] == ([0, 1] if rank < 2 else [2, 3]), o["vocab_ranks"]
        assert o["ppl"] == pytest.approx(want, rel=1e-9), (rank, o["ppl"], want)


def test_pp_dp_every_stage_gets_the_global_value(run4, reference):
    """pp 2 x dp 2, only the last stage updates: every rank, rank 0 included, ends
    with the global value; d9d's built-ins (world all-reduce) are correct here and equal."""
    for rank, out in enumerate(run4):
        o = out["pp_dp"]
        assert o["updates"] == (rank >= 2)
        assert o["ranks"] == [0, 1, 2, 3] and o["cached"], o
        _check(o["dk"], reference, f"rank {rank}")
        _check(o["d9d"], o["dk"], f"rank {rank} vs d9d")


def test_one_collective_per_steady_sync(run4):
    """ComposeMetric.sync(d9d_ctx) of one group: every sync after the first is a
    single all_reduce (resolving the d9d context is cached). The first adds the
    schema handshake, and settles replica slots where some ranks (pp stage 0) hold no data."""
    for out in run4:
        for layout in LAYOUTS:
            first, *steady = out[layout]["counts"]
            assert steady == [1, 1] and first <= 4, (layout, out[layout]["counts"])


def test_state_dict_round_trip_and_reset(run4, reference):
    for out in run4:
        for layout in LAYOUTS:
            o = out[layout]
            _check(o["restored"], o["dk"], layout)
            assert o["after_reset"] == 0.0


def test_resume_on_2_ranks_counts_tp_replicas_once(run4, saved, reference):
    """The checkpoints saved on 4 ranks, resumed on 2 plain ranks with
    ``for_resume``: the entries of tp replicas (marked by the d9d context at
    their last sync) are skipped, so every value is the all-data reference."""
    for rank, out in enumerate(run_distributed(_resume_worker, 2, saved, timeout=90, pg_timeout=20)):
        for layout in LAYOUTS:
            _check(out[layout], reference, f"{layout} resumed on rank {rank} of 2")


def test_functional_and_overrides(run4):
    for rank, out in enumerate(run4):
        dp_tp, pp_dp = out["dp_tp"], out["pp_dp"]
        assert dp_tp["functional"] == 2 and pp_dp["functional"] == 4
        assert dp_tp["dp_only"] == dp_tp["ranks"]
        assert pp_dp["dp_only"] == ([0, 1] if rank < 2 else [2, 3])
        assert dp_tp["from_mesh_all"] == 4 and pp_dp["from_mesh_all"] == 4
        assert dp_tp["from_mesh_default"] == dp_tp["ranks"] and pp_dp["from_mesh_default"] == [0, 1, 2, 3]


# ---------------------------------------------------------------- one process
def test_not_distributed_is_local_and_equals_d9d_builtins(reference):
    """A d9d context that is not distributed is local; values equal d9d's
    built-ins (no sync: d9d's collector does not sync them either) and the reference."""
    from d9d.metric.impl.container import ComposeMetric

    ctx = _d9d_context()
    assert as_context(ctx).is_local and as_context(ctx) is as_context(ctx)
    g = _dk_group()
    ours, theirs = ComposeMetric({"train": g}), _d9d_builtins()
    for i in range(len(SHARD_SIZES)):
        for batch in _batches(i):
            _feed_dk(g, batch)
            _feed_d9d(theirs, batch)
    ours.sync(ctx)
    got = _values(ours.compute()["train"])
    _check(got, reference, "world 1")
    _check(_values(theirs.compute()), got, "world 1 vs d9d")
    ours.reset()
    assert float(ours.compute()["train"]["tokens"]) == 0.0


def test_from_d9d_dims_and_errors():
    """Replica-only layouts (only tp / cp_replicate > 1) are local; wrong dims or
    objects raise naming the argument."""
    from d9d.core.dist_context import DeviceMeshParameters, DistributedContext

    names = ("pp", "dp_replicate", "dp_shard", "cp_shard", "cp_replicate", "tp")
    for degrees, shape in ((dict(tensor_parallel=4), (1, 1, 1, 1, 1, 4)),
                           (dict(context_parallel_replicate=2, tensor_parallel=2), (1, 1, 1, 1, 2, 2))):
        ctx = object.__new__(DistributedContext)
        ctx._params = DeviceMeshParameters(**degrees)
        for last in (False, True):  # this rank's coordinate: first or last on every dim
            coord = tuple(n - 1 if last else 0 for n in shape)
            ctx._meshes = {"regular": types.SimpleNamespace(mesh_dim_names=names, shape=shape,
                                                            get_coordinate=lambda c=coord: c)}
            local = dk.DistributedContext.from_d9d(ctx)
            assert ctx.mesh_params.is_distributed and local.is_local
            assert local.duplicate is not last  # a replica's copy, unless it is the last of its replicas
        with pytest.raises(ValueError, match=r"from_d9d: dims \['dp'\] not in the 'regular' mesh"):
            dk.DistributedContext.from_d9d(ctx, dims=("dp",))
        with pytest.raises(ValueError, match="from_d9d: dims is empty"):
            dk.DistributedContext.from_d9d(ctx, dims=())
    with pytest.raises(TypeError, match="from_d9d: d9d_ctx must be a d9d DistributedContext"):
        dk.DistributedContext.from_d9d(object())
    with pytest.raises(TypeError, match="a d9d DistributedContext or None"):
        as_context(object())
