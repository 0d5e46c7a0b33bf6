"""dk.functional: results equal plain torch on the concatenated per-rank data,
and a dict of 50 keys costs one collective per reduction kind (spied)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed

import d9d_kernels as dk
from d9d_kernels import functional as F

N_KEYS = 50
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.bool, torch.uint8]
SHAPES = [(), (3,), (2, 3), (4, 1, 2), (1,)]
FNS = ["mean", "sum", "max", "min", None]
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object",
    "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "all_to_all",
    "all_to_all_single", "barrier",
)


def _spy() -> list[str]:
    """Wraps every torch.distributed collective of this process; returns the call log."""
    calls: list[str] = []
    for name in COLLECTIVES:
        orig = getattr(dist, name, None)
        if orig is None:
            continue

        def wrapped(*args, _orig=orig, _name=name, **kwargs):
            calls.append(_name)
            return _orig(*args, **kwargs)

        setattr(dist, name, wrapped)
    return calls


def _value(rank: int, i: int) -> torch.Tensor:
    """Key i of rank `rank`: deterministic, dtype/shape cycle through DTYPES/SHAPES."""
    g = torch.Generator().manual_seed(1000 * rank + i)
    dtype, shape = DTYPES[i % len(DTYPES)], SHAPES[i % len(SHAPES)]
    x = torch.randn(shape, generator=g) * 10
    if dtype == torch.bool:
        return x > 0
    if dtype == torch.uint8:
        return x.abs().to(dtype)
    if not dtype.is_floating_point:
        return x.round().to(dtype) + (2**40 if dtype == torch.int64 else 0)
    return x.to(dtype)


def _data(rank: int) -> dict[str, torch.Tensor]:
    return {f"k{i:02d}": _value(rank, i) for i in range(N_KEYS)}


def _fns() -> dict:
    return {f"k{i:02d}": FNS[(i // 3) % len(FNS)] for i in range(N_KEYS)}


def _shuffled_keys(rank: int) -> list[str]:
    keys = list(_fns())
    random.Random(rank).shuffle(keys)
    return keys


def _pack(d: dict) -> dict:
    return {k: (str(v.dtype), tuple(v.shape), v.tolist()) for k, v in d.items()}


def _unpack(d: dict) -> dict:
    return {k: torch.tensor(v, dtype=getattr(torch, dt.split(".")[1])).reshape(shape) for k, (dt, shape, v) in d.items()}


def _reference(per_rank: list[torch.Tensor], how) -> torch.Tensor:
    """Plain torch on the stacked per-rank data, dtype as torch.stack(...).<op>(0) gives."""
    stacked = torch.stack(per_rank)
    wide = stacked.double()
    if how is None:
        return per_rank[0]
    if how == "mean":
        dtype = stacked.dtype if stacked.dtype.is_floating_point else torch.get_default_dtype()
        return wide.mean(0).to(dtype)
    if how == "sum":
        return wide.sum(0).to(stacked.sum(0).dtype)
    if how == "max":
        return wide.amax(0).to(stacked.dtype)
    return wide.amin(0).to(stacked.dtype)


def _check(got: torch.Tensor, ref: torch.Tensor, key: str, rank: int) -> None:
    assert got.dtype == ref.dtype, (key, rank, got.dtype, ref.dtype)
    assert got.shape == ref.shape, (key, rank, got.shape, ref.shape)
    if ref.dtype.is_floating_point:
        torch.testing.assert_close(got.double(), ref.double(), rtol=1e-6, atol=1e-9, msg=f"{key} on rank {rank}")
    else:
        assert torch.equal(got, ref), (key, rank, got, ref)


# ---------------------------------------------------------------- distributed scenarios
# One spawn per world size runs every scenario (spawning ranks dominates the cost).


def _rows(rank: int) -> int:
    return [3, 0, 5, 1][rank]  # uneven, including an empty rank


def _gather_data(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    n = _rows(rank)
    out = {
        "f32": torch.randn(n, 3, generator=g),
        "bf16": torch.randn(n, generator=g).to(torch.bfloat16),
        "i64_big": torch.randint(0, 1000, (n, 2), generator=g) + (2**60 + 1),  # not exact in float64
        "mask": torch.rand(n, 2, 2, generator=g) > 0.5,
        "scalar": torch.tensor(float(rank) + 0.5, dtype=torch.float64),
        "u8": torch.randint(0, 255, (n,), generator=g).to(torch.uint8),
    }
    for i in range(N_KEYS - len(out)):
        out[f"pad{i:02d}"] = torch.full((n, 1 + i % 3), float(rank * 100 + i), dtype=torch.float16)
    return out


def _expect_value_error(fn, *args):
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return "no error"


def _worker(rank, world_size):
    data = _data(rank)
    calls = _spy()
    out = {}

    def run(name, fn, *args, **kwargs):
        before = len(calls)
        out[name] = (_pack(fn(*args, **kwargs)), calls[before:])

    for name in ("reduce_mean", "reduce_sum", "reduce_max", "reduce_min"):
        run(name, getattr(F, name), data)
    # each rank builds its dict in another order: packing must not depend on it
    shuffled = {k: data[k] for k in _shuffled_keys(rank)}
    run("reduce_custom", F.reduce_custom, shuffled, _fns(), ctx=dk.DistributedContext())
    only_min = {k: v for k, v in data.items() if _fns()[k] == "min"}
    run("reduce_custom_min_only", F.reduce_custom, only_min, {k: "min" for k in only_min})
    gdata = _gather_data(rank)
    run("all_gather", F.all_gather, dict(reversed(gdata.items())) if rank % 2 else gdata)
    # same total numel, different shapes on rank 1: must not silently mix numbers
    shape = (2, 3) if rank != 1 else (3, 2)
    out["reduce_mismatch"] = _expect_value_error(F.reduce_sum, {"a": torch.ones(shape), "b": torch.tensor(1.0)})
    bad = torch.zeros(2, 3 if rank != 1 else 4)
    out["gather_mismatch"] = _expect_value_error(F.all_gather, {"ok": torch.ones(rank + 1), "bad": bad})
    # the group still works after the mismatch errors
    run("after_errors", F.reduce_max, {"r": torch.tensor(rank)})
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def dist_results(request):
    world_size = request.param
    return world_size, run_distributed(_worker, world_size, timeout=120)


def test_reductions_match_torch_and_use_one_collective_per_kind(dist_results):
    world_size, results = dist_results
    per_rank = [_data(r) for r in range(world_size)]
    fns = _fns()
    assert len(set(fns.values())) == len(FNS)  # the custom call really mixes all kinds
    expected_calls = {
        "reduce_mean": ["all_reduce"],
        "reduce_sum": ["all_reduce"],
        "reduce_max": ["all_reduce"],
        "reduce_min": ["all_reduce"],
        "reduce_custom": ["all_reduce", "all_reduce"],
        "reduce_custom_min_only": ["all_reduce"],
    }
    for rank, res in enumerate(results):
        for name, calls_expected in expected_calls.items():
            packed, calls = res[name]
            assert calls == calls_expected, (name, rank, calls)
            got = _unpack(packed)
            custom = name.startswith("reduce_custom")
            expected_keys = [k for k in fns if fns[k] == "min"] if name == "reduce_custom_min_only" else list(fns)
            if name == "reduce_custom":
                assert list(got) == _shuffled_keys(rank), name  # the caller's order
            else:
                assert list(got) == expected_keys, (name, list(got))
            for key, value in got.items():
                how = fns[key] if custom else name.split("_")[1]
                ref = _reference([d[key] for d in per_rank], how)
                if how is None:  # left local: this rank's own value
                    ref = per_rank[rank][key]
                _check(value, ref, key, rank)


def test_all_gather_uneven_first_dims_matches_cat(dist_results):
    world_size, results = dist_results
    per_rank = [_gather_data(r) for r in range(world_size)]
    for rank, res in enumerate(results):
        packed, calls = res["all_gather"]
        assert calls in (["all_gather_single"] * 2, ["all_gather_into_tensor"] * 2), calls
        got = _unpack(packed)
        assert list(got) == (list(reversed(per_rank[0])) if rank % 2 else list(per_rank[0]))  # caller's order
        for key, value in got.items():
            parts = [d[key] for d in per_rank]
            ref = torch.stack(parts) if parts[0].dim() == 0 else torch.cat(parts)
            assert value.dtype == ref.dtype and value.shape == ref.shape, (key, value.shape, ref.shape)
            assert torch.equal(value, ref), (key, rank)


def test_different_shapes_across_ranks_raise_on_every_rank(dist_results):
    world_size, results = dist_results
    for rank, res in enumerate(results):
        assert "different keys, shapes or reductions" in res["reduce_mismatch"], res["reduce_mismatch"]
        msg = res["gather_mismatch"]
        differing = [1] if rank != 1 else [r for r in range(world_size) if r != 1]
        assert "metrics['bad']" in msg and f"ranks {differing}" in msg, msg
        packed, calls = res["after_errors"]
        assert _unpack(packed)["r"].item() == world_size - 1 and calls == ["all_reduce"]


# ---------------------------------------------------------------- local, validation
def test_local_context_returns_local_values_with_torch_dtypes():
    ctx = dk.DistributedContext.local()
    data = _data(0)
    for how in ("mean", "sum", "max", "min"):
        out = F.reduce_custom(data, {k: how for k in data}, ctx=ctx)
        for k, v in out.items():
            _check(v, _reference([data[k]], how), k, 0)
    out = F.reduce_sum({"x": 2, "y": 1.5}, ctx=ctx)
    assert out["x"].dtype == torch.int64 and out["x"].item() == 2
    assert out["y"].dtype == torch.get_default_dtype() and out["y"].item() == 1.5


def test_no_process_group_means_local():
    assert not dist.is_initialized()
    out = F.reduce_mean({"a": torch.tensor([1.0, 3.0])})
    assert torch.equal(out["a"], torch.tensor([1.0, 3.0]))
    g = F.all_gather({"a": torch.arange(3), "s": torch.tensor(7)})
    assert torch.equal(g["a"], torch.arange(3)) and torch.equal(g["s"], torch.tensor([7]))


def test_reduce_custom_validates_arguments():
    x = {"a": torch.ones(2), "b": torch.ones(())}
    with pytest.raises(ValueError, match=r"missing \['b'\]"):
        F.reduce_custom(x, {"a": "sum"})
    with pytest.raises(ValueError, match=r"unknown \['c'\]"):
        F.reduce_custom(x, {"a": "sum", "b": None, "c": "max"})
    with pytest.raises(ValueError, match="must be one of"):
        F.reduce_custom(x, {"a": "median", "b": None})
    with pytest.raises(TypeError, match="complex"):
        F.reduce_sum({"z": torch.ones(2, dtype=torch.complex64)})
    with pytest.raises(TypeError, match="tensor or a Python number"):
        F.reduce_sum({"s": "text"})
    out = F.reduce_custom(x, {"a": None, "b": None})
    assert out["a"] is not x["a"] and torch.equal(out["a"], x["a"])


def test_collect_from_devices_splits_leading_axis():
    t = torch.arange(12.0).view(3, 4)
    out = F.collect_from_devices({"loss": t, "n": torch.tensor([1, 2]), "lst": [torch.ones(1), torch.zeros(1)]})
    assert len(out["loss"]) == 3 and all(torch.equal(out["loss"][i], t[i]) for i in range(3))
    assert [v.item() for v in out["n"]] == [1, 2]
    assert len(out["lst"]) == 2
    with pytest.raises(ValueError, match="leading device axis"):
        F.collect_from_devices({"s": torch.tensor(1.0)})


def test_functional_is_exported():
    assert dk.functional is F and dk.DistributedContext is dk.distributed.DistributedContext


def test_docs_examples_run():
    """Every ```python block of docs/distributed.md runs (in order, one namespace)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 3
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/distributed.md", "exec"), namespace)


def test_docstring_examples_run():
    import doctest

    from d9d_kernels import distributed

    for module in (F, distributed):
        result = doctest.testmod(module, raise_on_error=False)
        assert result.attempted > 0 and result.failed == 0, (module.__name__, result)


def _ctx_kinds_worker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    x = {"loss": torch.tensor(float(rank + 1)), "n": torch.tensor(rank + 1)}
    out = {}
    for name, ctx in (("group", dist.group.WORLD), ("mesh", mesh), ("context", dk.DistributedContext())):
        r = F.reduce_custom(x, {"loss": "mean", "n": "max"}, ctx=ctx)
        out[name] = [r["loss"].item(), r["n"].item(), F.all_gather({"r": torch.tensor([rank])}, ctx=ctx)["r"].tolist()]
    try:
        F.reduce_sum(x, ctx="world")
    except TypeError as e:
        out["bad"] = str(e)
    return out


def test_ctx_may_be_a_process_group_or_a_device_mesh():
    for res in run_distributed(_ctx_kinds_worker, 2, timeout=90):
        assert res["group"] == res["mesh"] == res["context"] == [1.5, 2, [0, 1]]
        assert "ProcessGroup" in res["bad"] and "DeviceMesh" in res["bad"]
