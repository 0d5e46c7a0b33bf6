"""DistributedContext: mesh sub-groups, default/local contexts, device routing,
store-based exchange/check_same, and timeouts that raise instead of hanging."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from dist_utils import free_port, run_distributed, run_distributed_expect_errors

import d9d_kernels as dk
from d9d_kernels import distributed as D
from d9d_kernels import functional as F


def _value(rank: int) -> torch.Tensor:
    """What a rank holds: 'counts' that are identical on tp replicas of one dp rank (rank = dp * 2 + tp)."""
    dp = rank // 2
    return torch.tensor([1.0, 10.0 * dp + 1, float(2**53 - 1 - dp)], dtype=torch.float64)


def _spy_all_reduce(calls: list):
    orig = dist.all_reduce

    def wrapped(tensor, *args, group=None, **kwargs):
        calls.append(group)
        return orig(tensor, *args, group=group, **kwargs)

    dist.all_reduce = wrapped


# ---------------------------------------------------------------- 4 ranks, 2x2 mesh
def _mesh_worker(rank, world_size):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    out = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = dk.DistributedContext.from_mesh(mesh, dims=("dp",), timeout=20)
    t = _value(rank)
    h = dp.all_reduce(t, "sum")
    h.wait()
    h.wait()  # waiting twice is harmless
    m = _value(rank)
    dp.all_reduce(m, "max").wait()
    out["dp"] = dict(ranks=dp.ranks, rank=dp.rank, world=dp.world_size, local=dp.is_local, sum=t.tolist(), max=m.tolist())

    both = dk.DistributedContext.from_mesh(mesh, dims=("tp", "dp"))  # any order: flattened in mesh order
    t = _value(rank)
    both.all_reduce(t, "sum").wait()
    out["both"] = dict(ranks=both.ranks, world=both.world_size, sum=t.tolist())

    # default dims ("dp_replicate", "dp_shard"): both present -> flattened; only one present -> that one
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    fsdp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    out["default_dims"] = [
        dk.DistributedContext.from_mesh(hsdp).ranks,
        dk.DistributedContext.from_mesh(fsdp_tp).ranks,
    ]
    # fallback when DeviceMesh._flatten is unavailable: same ranks, same sums
    orig_flatten = DeviceMesh._flatten
    DeviceMesh._flatten = lambda *a, **k: (_ for _ in ()).throw(AttributeError("no _flatten"))
    try:
        fb = dk.DistributedContext.from_mesh(hsdp)
    finally:
        DeviceMesh._flatten = orig_flatten
    t = _value(rank)
    fb.all_reduce(t, "sum").wait()
    out["fallback"] = dict(ranks=fb.ranks, sum=t.tolist())

    world = dk.DistributedContext()
    t = _value(rank)
    world.all_reduce(t, "sum").wait()
    out["world"] = dict(ranks=world.ranks, rank=world.rank, world=world.world_size, sum=t.tolist(), local=world.is_local)

    loc = dk.DistributedContext.local()
    t = _value(rank)
    loc.all_reduce(t, "sum").wait()
    out["local"] = dict(sum=t.tolist(), local=loc.is_local, ex=loc.exchange("x", "mine"), world=loc.world_size)

    # exchange: interleaved contexts/groups, two contexts over the same group, str and bytes
    out["exchange"] = [
        dp.exchange("a", f"dp{rank}"),
        world.exchange("a", f"w{rank}"),
        dk.DistributedContext().exchange("a", b"b%d" % rank),
        dp.exchange("a/b", f"again{rank}"),
    ]
    world.check_same("same", "schema-v1", "test schema")  # equal: no error
    try:  # rank 2 reached another exchange than the others: all raise, nobody waits for the timeout
        world.exchange("schema" if rank != 2 else "replica", "x")
        out["tag_mismatch"] = "no error"
    except RuntimeError as e:
        out["tag_mismatch"] = str(e)
    out["after_mismatch"] = world.exchange("b", str(rank))
    # a non-contiguous tensor is reduced in place too
    nc = torch.stack([_value(rank), 2 * _value(rank)], dim=1).t()
    assert not nc.is_contiguous()
    dp.all_reduce(nc, "sum").wait()
    out["non_contiguous"] = nc.tolist()
    try:
        world.check_same("fp", "members=a,b;shape=3" if rank != 3 else "members=a,c;shape=3", "MetricGroup schema")
        out["check_same"] = "no error"
    except ValueError as e:
        out["check_same"] = str(e)
    return out


@pytest.fixture(scope="module")
def mesh_results():
    return run_distributed(_mesh_worker, 4, timeout=120)


def test_from_mesh_reduces_over_dp_only(mesh_results):
    for rank, res in enumerate(mesh_results):
        dp = res["dp"]
        peers = [rank % 2, rank % 2 + 2]  # mesh [[0, 1], [2, 3]]: dp column of this rank
        assert dp["ranks"] == peers and dp["world"] == 2 and dp["rank"] == rank // 2 and not dp["local"]
        expected = [float(x) for x in torch.stack([_value(r) for r in peers]).sum(0).tolist()]
        assert dp["sum"] == expected  # count 1 per dp rank: 2, not 4 (tp replicas not multiplied)
        assert dp["sum"][0] == 2.0
        assert dp["max"] == torch.stack([_value(r) for r in peers]).amax(0).tolist()


def test_from_mesh_several_dims_and_defaults(mesh_results):
    total = torch.stack([_value(r) for r in range(4)]).sum(0).tolist()
    for rank, res in enumerate(mesh_results):
        assert res["both"]["ranks"] == [0, 1, 2, 3] and res["both"]["world"] == 4
        assert res["both"]["sum"] == total
        assert res["default_dims"][0] == [0, 1, 2, 3]
        assert res["default_dims"][1] == [rank % 2, rank % 2 + 2]
        assert sorted(res["fallback"]["ranks"]) == [0, 1, 2, 3] and res["fallback"]["sum"] == total


def test_default_context_is_world_and_local_does_nothing(mesh_results):
    total = torch.stack([_value(r) for r in range(4)]).sum(0).tolist()
    for rank, res in enumerate(mesh_results):
        w = res["world"]
        assert w["ranks"] == [0, 1, 2, 3] and w["rank"] == rank and w["world"] == 4 and not w["local"]
        assert w["sum"] == total
        loc = res["local"]
        assert loc["sum"] == _value(rank).tolist() and loc["local"] and loc["world"] == 1 and loc["ex"] == ["mine"]


def test_exchange_returns_every_rank_in_group_order(mesh_results):
    for rank, res in enumerate(mesh_results):
        peers = [rank % 2, rank % 2 + 2]
        ex = res["exchange"]
        assert ex[0] == [f"dp{r}" for r in peers]
        assert ex[1] == [f"w{r}" for r in range(4)]
        assert ex[2] == [b"b%d" % r for r in range(4)]
        assert ex[3] == [f"again{r}" for r in peers]


def test_exchange_at_different_points_raises_on_every_rank(mesh_results):
    for res in mesh_results:
        msg = res["tag_mismatch"]
        assert "reached different exchanges" in msg and "ranks [0, 1, 3]: 'schema'" in msg, msg
        assert "ranks [2]: 'replica'" in msg, msg
        assert res["after_mismatch"] == ["0", "1", "2", "3"]


def test_non_contiguous_all_reduce(mesh_results):
    for rank, res in enumerate(mesh_results):
        s = torch.stack([_value(r) for r in (rank % 2, rank % 2 + 2)]).sum(0)
        assert res["non_contiguous"] == torch.stack([s, 2 * s]).tolist()


def test_check_same_raises_on_every_rank_naming_ranks(mesh_results):
    for res in mesh_results:
        msg = res["check_same"]
        assert msg.startswith("d9d_kernels: MetricGroup schema differs across ranks"), msg
        assert "ranks [0, 1, 2]" in msg and "ranks [3]" in msg and "members=a,c" in msg, msg


# ---------------------------------------------------------------- routing (fake NCCL-only group)
def _routing_worker(rank, world_size):
    D._backend_config = lambda group: "cuda:nccl"  # pretend: NCCL-only groups, CPU tensors
    torch.cuda.is_available = lambda: False  # ... on a machine without a CUDA device (the gloo route)
    calls: list = []
    _spy_all_reduce(calls)
    out = {}
    world = dk.DistributedContext(timeout=20)
    pg = dist.new_group([0, 2])  # called on every rank; 1 and 3 are not members
    if rank in (0, 2):
        sub = dk.DistributedContext(group=pg)
    else:
        try:
            dk.DistributedContext(group=pg)
            out["non_member"] = "no error"
        except ValueError as e:
            out["non_member"] = str(e)
        sub = None
    group_count = dist.distributed_c10d._world.group_count
    for name, ctx in (("world", world), ("sub", sub), ("world2", world)):
        if ctx is None:
            continue
        t = _value(rank)
        ctx.all_reduce(t, "sum").wait()
        out[name] = t.tolist()
    out["backends"] = {key: (st.gloo.rank(), st.gloo.size()) for key, st in D._group_states.items() if st.gloo}
    out["names"] = [world.group.group_name, None if sub is None else sub.group.group_name]
    red = F.reduce_custom({"a": torch.tensor([float(rank)]), "b": torch.tensor(rank)}, {"a": "mean", "b": "min"}, ctx=world)
    out["functional"] = dict(a=red["a"].tolist(), b=red["b"].item())
    out["gather"] = F.all_gather({"x": torch.arange(rank + 1)}, ctx=world)["x"].tolist()
    out["group_count_unchanged"] = dist.distributed_c10d._world.group_count == group_count
    out["through_group"] = len(calls)  # nothing went through the (pretend NCCL-only) c10d groups
    # a re-initialised world reuses group names: cached per-group state must not be reused
    old = D._group_states[world.group.group_name].gloo
    port = int(world.exchange("port", str(free_port()))[0])
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=30),
    )
    t = _value(rank)
    again = dk.DistributedContext(timeout=20)
    again.all_reduce(t, "sum").wait()
    out["reinit"] = dict(
        sum=t.tolist(),
        new_backend=D._group_states[again.group.group_name].gloo is not old,
        exchange=again.exchange("x", str(rank)),
    )
    return out


def test_routing_through_gloo_backend_gives_right_numbers():
    results = run_distributed(_routing_worker, 4, timeout=120)
    total = torch.stack([_value(r) for r in range(4)]).sum(0).tolist()
    sub_total = torch.stack([_value(r) for r in (0, 2)]).sum(0).tolist()
    for rank, res in enumerate(results):
        assert res["world"] == total and res["world2"] == total
        world_name, sub_name = res["names"]
        expected = {world_name: (rank, 4)}
        if rank in (0, 2):
            assert res["sub"] == sub_total
            expected[sub_name] = (rank // 2, 2)
        else:
            assert "not a member" in res["non_member"]
        assert res["backends"] == expected  # one private gloo backend per group, cached
        assert res["functional"] == dict(a=[1.5], b=0)
        assert res["gather"] == [0, 0, 1, 0, 1, 2, 0, 1, 2, 3]
        assert res["group_count_unchanged"] and res["through_group"] == 0
        assert res["reinit"] == dict(sum=total, new_backend=True, exchange=["0", "1", "2", "3"])


@pytest.mark.parametrize(
    "config, device, route",
    [
        ("cuda:nccl", "cpu", "gloo"),  # NCCL-only group, CPU metric state (torchmetrics crashes here)
        ("cuda:nccl", "cuda", "direct"),
        ("nccl", "cpu", "gloo"),  # bare backend name: capabilities from torch
        ("cpu:gloo,cuda:nccl", "cpu", "direct"),
        ("cpu:gloo,cuda:nccl", "cuda", "direct"),
        ("cpu:gloo", "cuda", "stage"),  # CPU-only backend, device state: stage through host memory
        ("gloo", "cuda", "direct"),  # gloo implements CUDA all_reduce itself
        ("cpu:gloo,cuda:gloo", "cpu", "direct"),
        ("xpu:xccl", "cuda", "gloo_stage"),
    ],
)
def test_route_decision(config, device, route):
    assert D._route(config, device, cuda=False) == route


@pytest.mark.parametrize(
    "config, cuda, route",
    [
        ("cuda:nccl", True, "cuda_stage"),  # NCCL-only + CPU state + a CUDA device: through the device
        ("nccl", True, "cuda_stage"),
        ("cuda:nccl", False, "gloo"),  # no CUDA device: the private gloo backend (small worlds)
        ("xpu:xccl", True, "gloo"),  # no CUDA backend to stage through
        ("cpu:gloo,cuda:nccl", True, "direct"),
    ],
)
def test_cpu_state_route_with_and_without_a_cuda_device(config, cuda, route):
    assert D._route(config, "cpu", cuda=cuda) == route


class _CpuCuda:
    """A stand-in for torch.cuda on CPU: records what the staging does, in order."""

    def __init__(self, log, done_after=0):
        self.log, self.done_after = log, done_after

    def current_device(self):
        return 0

    def Stream(self, dev):  # noqa: N802 (torch.cuda's name)
        self.log.append("stream created")
        return "side"

    def stream(self, s):
        log = self.log

        class _Ctx:
            def __enter__(self):
                log.append(f"enter {s}")

            def __exit__(self, *a):
                log.append(f"exit {s}")

        return _Ctx()

    def Event(self):  # noqa: N802
        log, left = self.log, [self.done_after]

        class _Event:
            def record(self, s):
                log.append(f"event recorded on {s}")

            def query(self):
                left[0] -= 1
                return left[0] < 0

        return _Event()


def _staged_worker(rank, world_size):
    log = []
    torch.cuda.is_available = lambda: True  # pretend: this process has a CUDA device
    D._backend_config = lambda group: "cuda:nccl"  # pretend: the group is NCCL-only
    D._STAGING.update(cuda=_CpuCuda(log, done_after=3), device="cpu", pin=False)
    launched = []
    orig = dist.all_reduce

    def spy(t, *a, **k):
        launched.append((len(log), t.device.type, k.get("async_op")))
        return orig(t, *a, **k)

    dist.all_reduce = spy
    ctx = dk.DistributedContext(timeout=20)
    t = _value(rank)
    h = ctx.all_reduce(t, "sum")
    before_wait = t.tolist()  # not written back before wait()
    h.wait()
    g = dk.MetricGroup({"n": dk.SumMetric(), "peak": dk.MaxMetric()})
    g["n"].update(float(rank + 1))
    g["peak"].update(torch.tensor([float(rank)]))
    g.trigger_sync(ctx)
    g.wait_sync(ctx)
    gathered = F.all_gather({"x": torch.arange(rank + 1)}, ctx=ctx)["x"].tolist()
    return dict(before=before_wait, after=t.tolist(), log=log[:5], launched=launched[0],
                group=g.compute_to_host().result(), gathered=gathered,
                gloo=any(st.gloo is not None for st in D._group_states.values()))


def test_cpu_state_under_nccl_is_staged_through_the_device():
    """The staging sequence with a CPU stand-in for torch.cuda on 2 gloo ranks:
    one side stream, the collective launched inside it, an event recorded
    after, the result copied back only in wait(); no private gloo backend."""
    for rank, res in enumerate(run_distributed(_staged_worker, 2, timeout=90)):
        assert res["before"] == _value(rank).tolist()
        assert res["after"] == (_value(0) + _value(1)).tolist()
        assert res["log"] == ["stream created", "enter side", "event recorded on side", "exit side", "enter side"]
        assert res["launched"] == (2, "cpu", True)  # after "stream created", "enter side"
        assert res["group"] == {"n": 3.0, "peak": 1.0}
        assert res["gathered"] == [0, 0, 1]
        assert not res["gloo"]


def test_staged_work_polls_its_event_and_times_out():
    class _Never:
        def query(self):
            return False

    w = D._EventWork(_Never(), keep=None)
    h = D.CollectiveHandle(w, what="all_reduce(sum) of (3,)", timeout=datetime.timedelta(seconds=0.05))
    assert not h.is_completed()
    with pytest.raises(RuntimeError, match=r"all_reduce\(sum\) of \(3,\) did not complete within the timeout"):
        h.wait()
    done = D._EventWork(_CpuCuda([], done_after=2).Event(), keep=None)
    assert done.wait(datetime.timedelta(seconds=5)) is True


def _real_staged_worker(rank, world_size):
    # gloo reduces CUDA tensors too, so "pretend NCCL-only" runs the real CUDA
    # staging (pinned buffers, side stream, event) on one GPU shared by both ranks
    D._backend_config = lambda group: "cuda:nccl"
    ctx = dk.DistributedContext(timeout=30)
    t = _value(rank)
    h = ctx.all_reduce(t, "max")
    h.wait()
    g = dk.MetricGroup({"n": dk.SumMetric(), "peak": dk.MaxMetric()})
    g["n"].update(float(rank + 1))
    g["peak"].update(torch.tensor([float(rank)]))
    g.trigger_sync(ctx)
    g.wait_sync(ctx)
    return t.tolist(), g.compute_to_host().result(), [st.routes for st in D._group_states.values()]


@pytest.mark.gpu
def test_cpu_state_staged_through_a_real_cuda_device():
    for t, group, routes in run_distributed(_real_staged_worker, 2, timeout=120):
        assert t == torch.stack([_value(r) for r in range(2)]).amax(0).tolist()
        assert group == {"n": 3.0, "peak": 1.0}
        assert {"cpu": "cuda_stage"} in routes


# ---------------------------------------------------------------- a rank that never joins
def _never_joins_worker(rank, world_size):
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # never calls exchange / all_reduce; stays alive until rank 0 is done
        store.wait(["test/rank0_done"], datetime.timedelta(seconds=40))
        return {}
    ctx = dk.DistributedContext(timeout=datetime.timedelta(seconds=3))
    out = {}
    for name, fn in (
        ("exchange", lambda: ctx.exchange("fingerprint", "abc")),
        ("check_same", lambda: ctx.check_same("schema", "abc", "MetricGroup schema")),
    ):
        try:
            fn()
            out[name] = "no error"
        except RuntimeError as e:
            out[name] = str(e)
    t = torch.ones(3)
    handle = ctx.all_reduce(t, "sum")  # launching never blocks
    try:
        handle.wait()
        out["wait"] = "no error"
    except RuntimeError as e:
        out["wait"] = str(e)
    store.set("test/rank0_done", b"1")
    return out


def test_missing_rank_raises_instead_of_hanging():
    results = run_distributed_expect_errors(_never_joins_worker, 2, timeout=60, pg_timeout=30)
    status, out = results[0]
    assert status == "ok", results[0]
    assert "ranks [1] did not arrive" in out["exchange"] and "'fingerprint'" in out["exchange"], out["exchange"]
    assert "ranks [1] did not arrive" in out["check_same"], out["check_same"]
    assert "all_reduce(sum)" in out["wait"] and "timeout of 3 s" in out["wait"], out["wait"]


# ---------------------------------------------------------------- in-process
def test_uninitialised_default_context_is_local():
    assert not dist.is_initialized()
    ctx = dk.DistributedContext()
    assert ctx.is_local and ctx.world_size == 1 and ctx.rank == 0 and ctx.group is None
    assert ctx.timeout == datetime.timedelta(seconds=60) and ctx.cache_key == ("local",)
    t = torch.arange(3.0)
    h = ctx.all_reduce(t, "max")
    assert h.is_completed()
    h.wait()
    assert torch.equal(t, torch.arange(3.0))
    assert ctx.exchange("t", b"v") == [b"v"]
    ctx.check_same("t", "anything", "schema")
    assert "local" in repr(ctx)


def test_argument_validation():
    ctx = dk.DistributedContext.local()
    with pytest.raises(ValueError, match="op must be one of"):
        ctx.all_reduce(torch.ones(1), "min")
    with pytest.raises(TypeError, match="expected a tensor"):
        ctx.all_reduce([1.0], "sum")
    with pytest.raises(TypeError, match="bytes or str"):
        ctx.exchange("t", 3)
    with pytest.raises(ValueError, match="positive"):
        dk.DistributedContext(timeout=0)
    assert dk.DistributedContext(timeout=2.5).timeout == datetime.timedelta(seconds=2.5)

    class FakeMesh:
        def __init__(self, names):
            self.mesh_dim_names = names

    with pytest.raises(ValueError, match="no mesh_dim_names"):
        dk.DistributedContext.from_mesh(FakeMesh(None))
    with pytest.raises(ValueError, match=r"dims \['pp'\] not in the mesh dims \['dp', 'tp'\]"):
        dk.DistributedContext.from_mesh(FakeMesh(("dp", "tp")), dims=("dp", "pp"))
    with pytest.raises(ValueError, match=r"dims \['dp_replicate', 'dp_shard'\] not in"):
        dk.DistributedContext.from_mesh(FakeMesh(("dp", "tp")))


class _FakeWork:
    def __init__(self, result=None, exc=None):
        self.result, self.exc, self.timeouts = result, exc, []

    def wait(self, timeout=None):
        self.timeouts.append(timeout)
        if self.exc:
            raise self.exc
        return self.result

    def is_completed(self):
        return False


def test_handle_wait_passes_timeout_and_raises():
    td = datetime.timedelta(seconds=4)
    w = _FakeWork(result=True)
    finished = []
    h = D.CollectiveHandle(w, what="all_reduce(max) of x", timeout=td, finish=lambda: finished.append(1))
    assert not h.is_completed()
    h.wait()
    h.wait()
    assert w.timeouts == [td] and finished == [1] and h.is_completed()
    with pytest.raises(RuntimeError, match=r"all_reduce\(max\) of x did not complete within the timeout of 4 s"):
        D.CollectiveHandle(_FakeWork(result=False), what="all_reduce(max) of x", timeout=td).wait()
    with pytest.raises(RuntimeError, match=r"all_reduce\(sum\).*timeout of 4 s.*Operation timed out"):
        D.CollectiveHandle(_FakeWork(exc=RuntimeError("Operation timed out!")), what="all_reduce(sum)", timeout=td).wait()


# ---------------------------------------------------------------- CUDA tensors (needs a GPU)
def _cuda_worker(rank, world_size):
    out = {}
    ctx = dk.DistributedContext(timeout=30)
    t = _value(rank).cuda()
    ctx.all_reduce(t, "sum").wait()  # gloo implements CUDA all_reduce: direct
    out["direct"] = t.cpu().tolist()
    D._backend_config = lambda group: "cpu:gloo"  # pretend a CPU-only backend: staged through host memory
    t = _value(rank).cuda()
    ctx.all_reduce(t, "max").wait()
    out["staged"] = t.cpu().tolist()
    red = F.reduce_custom({"a": torch.tensor([float(rank)], device="cuda"), "b": torch.tensor(rank)}, {"a": "mean", "b": "min"}, ctx=ctx)
    out["functional"] = [red["a"].device.type, red["a"].tolist(), red["b"].device.type, red["b"].item()]
    out["gather"] = F.all_gather({"x": torch.arange(rank + 1, device="cuda")}, ctx=ctx)["x"].cpu().tolist()
    return out


@pytest.mark.gpu
def test_cuda_tensors_direct_and_staged():
    results = run_distributed(_cuda_worker, 2, timeout=120)
    for res in results:
        assert res["direct"] == torch.stack([_value(r) for r in range(2)]).sum(0).tolist()
        assert res["staged"] == torch.stack([_value(r) for r in range(2)]).amax(0).tolist()
        assert res["functional"] == ["cuda", [0.5], "cpu", 0]
        assert res["gather"] == [0, 0, 1]


def test_default_context_resolves_the_world_lazily(tmp_path):
    ctx = dk.DistributedContext()  # built before init_process_group
    assert ctx.is_local and ctx.group is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert ctx.group is dist.group.WORLD and ctx.ranks == [0] and ctx.world_size == 1
        assert ctx.is_local and ctx.cache_key == ("local",)  # a group of one needs no communication
        assert dk.DistributedContext.local().cache_key == ("local",)
    finally:
        dist.destroy_process_group()
    assert ctx.group is None
