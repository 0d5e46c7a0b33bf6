"""Sync latency of a metric group with gloo on 127.0.0.1.

Question: what does a logging-step sync of K = 1 ... 64 metrics cost, with
d9d_kernels (trigger_sync + wait_sync: one coalesced all_reduce, max/min
states folded into it), torchmetrics (``Metric.compute()``, which all_gathers every
state), torcheval (``sync_and_compute_collection``) and one raw
``dist.all_reduce`` of the same number of bytes as our packed state (the
limit; timed after the same untimed group update as d9d)? World sizes 2
and 4 (spawned processes, one intra-op thread each, one core per rank).

Targets: ours <= 1.3x the raw all_reduce; flat in K (K=64 <= 1.5x
K=1); >= 10x faster than torchmetrics at K = 16.

Providers (the ``provider`` column):
    d9d             trigger_sync + wait_sync
    d9d_compute     trigger_sync + wait_sync + compute (to compare with the peers,
                    whose sync cannot be separated from compute)
    d9d_compute_part  the compute() part of those same d9d_compute calls,
                    timed inside them (the issue's compute / sync ratio)
    torchmetrics    compute() of each metric (sync, compute, unsync)
    torcheval       toolkit.sync_and_compute_collection
    raw_all_reduce  dist.all_reduce of a float64 buffer of our state's size

The metric mix cycles mean, sum, max, min, accuracy(C=10), macro F1(C=10)
(``providers.SYNC_MIX``). Before every timed call each group is updated
(untimed) so that no peer can return a cached result, then all ranks meet at
a barrier; providers take turns within each repeat. Times are rank 0's.

    python bench/bench_sync.py [--quick] [--worlds 2 4] [--ks 1 4 16 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import providers as pv  # noqa: E402

BENCH = "bench_sync"
PROVIDERS = ("d9d", "d9d_compute", "torchmetrics", "torcheval", "raw_all_reduce")
FULL_KS = (1, 2, 4, 8, 16, 32, 64)
QUICK_KS = (1, 4, 16, 64)
CHEAP = ("d9d", "d9d_compute", "raw_all_reduce")
CHEAP_SAMPLES = 8
PIN = bool(int(os.environ.get("BENCH_SYNC_PIN", "1")))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="smoke test: world 2, K in (1, 4), 2 repeats")
    p.add_argument("--worlds", type=int, nargs="*", default=None)
    p.add_argument("--ks", type=int, nargs="*", default=None)
    p.add_argument("--providers", nargs="*", default=list(PROVIDERS), choices=PROVIDERS)
    p.add_argument("--out", default=str(harness.RESULTS / f"{BENCH}.csv"))
    p.add_argument("--timeout", type=float, default=900.0, help="per world size, seconds")
    a = p.parse_args(argv)
    if a.tiny:
        a.worlds = a.worlds or [2]
        a.ks = a.ks or [1, 4]
    a.worlds = a.worlds or [2, 4]
    a.ks = a.ks or list(QUICK_KS if a.quick else FULL_KS)
    return a


def _state_bytes(group) -> int:
    """Bytes one sync of this d9d group moves (SUM + MAX packed buffers)."""
    st = group.g._storage
    return int(sum(st.local[k].numel() * st.local[k].element_size() for k in ("sum", "max") if k in st.local))


def _rank_main(rank: int, world: int, a, warmup: int, repeats: int):
    import torch.distributed as dist

    torch.set_num_threads(1)
    cpus = sorted(os.sched_getaffinity(0))
    if PIN and world <= len(cpus):  # one core per rank: no migrations mid-collective
        os.sched_setaffinity(0, {cpus[rank]})
    logits, target, loss, n = pv.update_inputs(64, pv.SYNC_C, seed=rank)
    out = []
    for K in a.ks:
        groups = {p: pv.make_sync_group(p, K) for p in ("d9d", "torchmetrics", "torcheval")}
        nbytes = _state_bytes(groups["d9d"])
        raw = torch.zeros(max(1, nbytes // 8), dtype=torch.float64)
        d9d = groups["d9d"]

        def sync_then_compute():  # returns when the sync ended: compute()'s own part of the call
            d9d.trigger()
            d9d.wait()
            mid = time.perf_counter()
            d9d.compute()
            return mid

        ops = {
            "d9d": ("d9d", lambda: (d9d.trigger(), d9d.wait())),
            "d9d_compute": ("d9d", sync_then_compute),
            "torchmetrics": ("torchmetrics", lambda: groups["torchmetrics"].sync_compute()),
            "torcheval": ("torcheval", lambda: groups["torcheval"].sync_compute()),
            # after the same untimed d9d update as "d9d": both start from the same
            # cache state (an update of 64 members before the barrier slowed the
            # sync that follows by ~40 us, and a raw all_reduce by 25-55 us)
            "raw_all_reduce": ("d9d", lambda: dist.all_reduce(raw)),
        }
        # providers interleaved within each repeat (not one block each): on a
        # shared machine, slow periods (scheduler time slices of ~4 ms were seen
        # hitting whole blocks) then hit every provider alike
        # The ~1 ms providers get CHEAP_SAMPLES timed calls per repeat (the
        # peers take 5-1200 ms each): one gloo collective varied 0.3-5 ms from
        # call to call here, and 21 samples left medians 2x apart run to run.
        times = {prov: [] for prov in a.providers}
        part = []  # d9d_compute_part
        for i in range(warmup + repeats):
            for prov in a.providers:
                gname, fn = ops[prov]
                for _ in range(CHEAP_SAMPLES if prov in CHEAP else 1):
                    if gname is not None:
                        groups[gname].update(logits, target, loss, n)
                    dist.barrier()
                    t = time.perf_counter()
                    mid = fn()
                    end = time.perf_counter()
                    if i >= warmup:
                        times[prov].append(end - t)
                        if prov == "d9d_compute":
                            part.append(end - mid)
        for prov in a.providers:
            out.append({"K": K, "provider": prov, "bytes": nbytes, "times": times[prov]})
        if part:
            out.append({"K": K, "provider": "d9d_compute_part", "bytes": nbytes, "times": part})
    return out


def _rank_result(rank: int, world: int, a, warmup: int, repeats: int):
    res = _rank_main(rank, world, a, warmup, repeats)
    return res if rank == 0 else None


def run_world(world: int, a, warmup: int, repeats: int):
    """Spawns ``world`` gloo ranks; returns rank 0's results. Never hangs."""
    from d9d_kernels.spawn import spawn_gloo

    out = spawn_gloo(_rank_result, world, a, warmup, repeats, timeout=a.timeout, pg_timeout=120, stop_on_error=True)
    errors = {r: m for r, (status, m) in out.items() if status == "error"}
    if errors or out[0][0] != "ok":
        msg = "\n".join(f"[rank {r}] {m}" for r, m in sorted(errors.items())) or f"timed out after {a.timeout}s"
        raise RuntimeError(f"bench_sync world={world} failed:\n{msg}")
    return out[0][1]


def main(argv=None) -> int:
    a = parse(argv)
    timing = harness.Timing.tiny() if a.tiny else (harness.Timing.quick() if a.quick else harness.Timing())
    # one collective per call is short and noisy on a shared machine: more repeats than the
    # harness default (each repeat is a single call, there is no inner loop here)
    timing = harness.Timing(warmup=timing.warmup + 2, repeats=timing.repeats * 3) if not a.tiny else timing
    rows = []
    for world in a.worlds:
        for r in run_world(world, a, timing.warmup, timing.repeats):
            st = harness.stats(r["times"])
            rows.append(harness.row(BENCH, op=f"sync_world{world}", provider=r["provider"],
                                    shape=f"K={r['K']},world={world},bytes={r['bytes']}",
                                    dtype="float64", device="cpu", stats=st))
            print(f"{BENCH}: world={world} K={r['K']:<3d} {r['provider']:<15s} {st.p50 * 1e6:>10.1f} us "
                  f"[p20 {st.p20 * 1e6:.1f}, p80 {st.p80 * 1e6:.1f}]  ({r['bytes']} B)", flush=True)
    harness.write_csv(a.out, rows)
    print(f"{BENCH}: wrote {a.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
