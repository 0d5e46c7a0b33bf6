"""What a metric sync costs a rank as the world grows to 131,072 ranks.

Question: does anything in our sync path grow with the world size W? And
what would one sync cost on a real network at large W, ours against the
torchmetrics pattern?

1. Measured (``op`` = ``fake_*``): the library on torch's fake process group
   (``tests/scale/fake_world.py``: one rank in the middle of a world of W in
   this process; collectives return immediately, so what is timed is the
   per-rank host cost of our code) at W = 8 ... 131,072, over a store that
   counts operations and keys:
     fake_first_sync   first trigger_sync + wait_sync (fixed-shape handshake + data)
     fake_steady_sync  trigger_sync + wait_sync afterwards (median of repeats)
     fake_from_mesh    DistributedContext.from_mesh on a (W/8, 8) mesh
     fake_store_exchange  ``ctx.exchange`` (the store helper the first sync
                       used before: every rank reads W keys), the other W - 1
                       keys pre-posted in a HashStore
   The group is the bench_sync mix (providers.SYNC_MIX) with K = 16 members on
   the world context. Store operations per rank go in the ``shape`` column
   (``store_ops``, ``store_keys``).
2. Model (``op`` = ``model_sync``; p20 = p50 = p80 = the modelled time): an
   alpha-beta model of one sync on a stated network, NCCL's algorithms:
     all_reduce ring  2 (W-1) a + 2 (W-1)/W n b
     all_reduce tree  2 log2(W) a + 2 n b   (double binary tree; NCCL picks the cheaper)
     all_gather ring  (W-1) a + (W-1) n b   (n = bytes per rank; no tree)
     all_gather log   log2(W) a + (W-1) n b (NCCL's PAT, one GPU per node: a lower bound)
   with a = 5 us per hop and b = 1 / (400 Gb/s). Ours: one all_reduce of
   the packed SUM buffer, plus one of the MAX buffer when max/min members
   exist (folded into the sum only while MAX x W <= 8192 doubles). The
   torchmetrics pattern: per state, an all_gather of its shape then one of
   its data (2 collectives; 3 when shapes differ), bytes from the real
   torchmetrics metrics of the same mix. K = 16 and 64.

    python bench/bench_scale.py [--quick | --tiny] [--out bench/results/bench_scale.csv]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import harness  # noqa: E402
import providers as pv  # noqa: E402

BENCH = "bench_scale"
FULL_WORLDS = (8, 64, 1024, 8192, 16384, 131072)
QUICK_WORLDS = (8, 1024, 16384, 131072)
MODEL_WORLDS = tuple(2**k for k in range(3, 18))  # 8 ... 131,072
ALPHA = 5e-6  # s per hop
LINK_GBPS = 400.0
BETA = 8.0 / (LINK_GBPS * 1e9)  # s per byte
K_MEASURED = 16
FOLD_MAX_ELEMS = 8192


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="smoke test: W = 8 and 1,024, few repeats")
    p.add_argument("--out", default=str(harness.RESULTS / f"{BENCH}.csv"))
    return p.parse_args(argv)


# ------------------------------------------------------------------ measured on the fake group
class _CountKeys:
    """Counts the keys a store operation touches (multi_get of W keys = W)."""

    def __init__(self, store):
        self.store = store
        self.mark()

    def mark(self):
        self.ops0 = len(self.store.ops)
        self.keys0 = getattr(self.store, "keys_touched", 0)

    def delta(self) -> tuple[int, int]:
        return len(self.store.ops) - self.ops0, getattr(self.store, "keys_touched", 0) - self.keys0


def _counting(inner):
    from tests.scale.fake_world import CountingStore

    class KeyCountingStore(CountingStore):
        keys_touched = 0

        def _op(self, name, fn, *args):
            keys = args[0] if args and isinstance(args[0], (list, tuple)) else [args[0]] if args else []
            self.keys_touched += len(keys)
            return super()._op(name, fn, *args)

    return KeyCountingStore(inner)


def measure_world(W: int, timing: harness.Timing) -> list[dict]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import d9d_kernels as dk

    rows = []
    shape = lambda **kv: ",".join(f"{k}={v}" for k, v in {"world": W, **kv}.items())  # noqa: E731

    def add(op, st, **kv):
        rows.append(harness.row(BENCH, op=op, provider="d9d", shape=shape(**kv), dtype="float64", device="cpu",
                                stats=st))

    # ours: the fake group over a counting FakeStore
    from torch.testing._internal.distributed.fake_pg import FakeStore

    store = _counting(FakeStore())
    dist.init_process_group("fake", store=store, rank=W // 2 + 3 if W > 8 else 3, world_size=W)
    try:
        c = _CountKeys(store)
        t_mesh, t_from = [], []
        for _ in range(3):  # a new mesh each time: from_mesh creates (or finds) its dp group
            t0 = time.perf_counter()
            mesh = init_device_mesh("cpu", (max(W // 8, 1), 8), mesh_dim_names=("dp", "tp"))
            t_mesh.append(time.perf_counter() - t0)
            c.mark()
            t0 = time.perf_counter()
            dk.DistributedContext.from_mesh(mesh, dims="dp")
            t_from.append(time.perf_counter() - t0)
            ops, keys = c.delta()
        add("fake_device_mesh", harness.stats(t_mesh), note="torch")
        add("fake_from_mesh", harness.stats(t_from), store_ops=ops, store_keys=keys)
        ctx = dk.DistributedContext()
        firsts = []
        for _ in range(5):  # a fresh group each time: every first sync does the handshake
            g = pv.D9DSyncGroup(K_MEASURED).g
            for name in g:
                if name.endswith(("mean", "sum", "max", "min")):
                    g[name].update(1.5)
            c.mark()
            t0 = time.perf_counter()
            g.trigger_sync(ctx)
            g.wait_sync()
            firsts.append(time.perf_counter() - t0)
            ops, keys = c.delta()
        add("fake_first_sync", harness.stats(firsts), K=K_MEASURED, store_ops=ops, store_keys=keys)
        c.mark()
        st = harness.measure(lambda: (g.trigger_sync(ctx), g.wait_sync()), timing)
        ops, keys = c.delta()
        add("fake_steady_sync", st, K=K_MEASURED, store_ops=ops, store_keys=keys)
    finally:
        dist.destroy_process_group()

    # the store exchange (small-world helper): the other W - 1 ranks' keys pre-posted
    if W <= 16384 or not timing.repeats < 10:
        hs = _counting(dist.HashStore())
        me = W // 2 + 3 if W > 8 else 3
        dist.init_process_group("fake", store=hs, rank=me, world_size=W)
        try:
            import d9d_kernels.distributed as D

            ctx = dk.DistributedContext(timeout=10)
            times, seq = [], 0
            for _ in range(3):
                name = D._state(ctx.group).group.group_name
                pre = dist.PrefixStore(f"{D._STORE_PREFIX}{name}/", dist.distributed_c10d._get_default_store())
                for r in range(W):
                    if r != me:
                        pre.set(f"{seq}/{r}", b"6:schema" + b"x" * 300)
                c = _CountKeys(hs)
                t0 = time.perf_counter()
                ctx.exchange("schema", "x" * 300)
                times.append(time.perf_counter() - t0)
                seq += 1
            ops, keys = c.delta()
            add("fake_store_exchange", harness.stats(times), store_ops=ops, store_keys=keys)
        finally:
            dist.destroy_process_group()
    return rows


# ------------------------------------------------------------------ alpha-beta model
def all_reduce_s(W: int, n: float) -> float:
    ring = 2 * (W - 1) * ALPHA + 2 * (W - 1) / W * n * BETA
    tree = 2 * math.ceil(math.log2(W)) * ALPHA + 2 * n * BETA
    return min(ring, tree)


def all_gather_s(W: int, n: float) -> float:
    return (W - 1) * ALPHA + (W - 1) * n * BETA


def ours_s(W: int, sum_bytes: int, max_bytes: int) -> float:
    if max_bytes and (max_bytes // 8) * W <= FOLD_MAX_ELEMS:  # MAX rides in the sum, one row per rank
        return all_reduce_s(W, sum_bytes + W * max_bytes)
    return all_reduce_s(W, sum_bytes) + (all_reduce_s(W, max_bytes) if max_bytes else 0.0)


def all_gather_log_s(W: int, n: float) -> float:
    """An all_gather with logarithmic latency (NCCL's PAT algorithm, one GPU per node)."""
    return math.ceil(math.log2(W)) * ALPHA + (W - 1) * n * BETA


def torchmetrics_s(W: int, state_bytes: list[int], gather=all_gather_s) -> float:
    # per state: all_gather of its shape (one int64 per dim, ~8 bytes), then of its data
    return sum(gather(W, 8) + gather(W, b) for b in state_bytes)


def mix_sizes(K: int) -> tuple[int, int, list[int]]:
    """(our SUM bytes, our MAX bytes, torchmetrics' per-state bytes) of the bench_sync mix."""
    g = pv.D9DSyncGroup(K).g
    sizes = g._storage.layout.sizes
    tm = pv.TorchmetricsSyncGroup(K)
    states = []
    for m in tm.m.values():
        for name in m._defaults:
            v = getattr(m, name)
            states.append(v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 8)
    return sizes["sum"] * 8, sizes["max"] * 8, states


def model_rows() -> list[dict]:
    rows = []
    for K in (16, 64):
        sum_b, max_b, states = mix_sizes(K)
        for W in MODEL_WORLDS:
            for prov, t, n_coll in (("d9d_model", ours_s(W, sum_b, max_b),
                                     1 + (max_b and (max_b // 8) * W > FOLD_MAX_ELEMS)),
                                    ("torchmetrics_model", torchmetrics_s(W, states), 2 * len(states)),
                                    ("torchmetrics_model_log", torchmetrics_s(W, states, all_gather_log_s),
                                     2 * len(states))):
                rows.append(harness.row(
                    BENCH, op="model_sync", provider=prov, dtype="float64", device="model",
                    shape=f"K={K},world={W},bytes={sum_b + max_b if prov == 'd9d_model' else sum(states)},"
                          f"collectives={int(n_coll)}",
                    stats=harness.stats([t])))
    return rows


def main(argv=None) -> int:
    a = parse(argv)
    from torch.distributed.device_mesh import DeviceMesh  # noqa: F401 (imported once, not timed)
    import torch._dynamo  # noqa: F401 (DeviceMesh slicing imports it on first use)

    timing = harness.Timing.tiny() if a.tiny else harness.Timing.quick() if a.quick else harness.Timing()
    rows = []
    for W in ((8, 1024) if a.tiny else QUICK_WORLDS if a.quick else FULL_WORLDS):
        t0 = time.perf_counter()
        rows += measure_world(W, timing)
        print(f"world {W}: {time.perf_counter() - t0:.1f} s", flush=True)
    rows += model_rows()
    out = harness.write_csv(a.out, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
