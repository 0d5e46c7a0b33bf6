"""Latency of one raw gloo all_reduce against its element count (the sync limit's own shape).

Question: bench_sync's limit, one ``dist.all_reduce`` of our packed state,
is itself not flat in K at world 4 on this machine (K=64 / K=1 ≈ 1.5× for
80 → 2552 bytes), while it is flat at world 2. Is that bytes or messages?

gloo's ring all_reduce (``gloo/allreduce.cc``) cuts the buffer into
``2P`` segments (P = world size) of ``ceil(E / 2P)`` elements, rounded to
whole elements, and skips the empty ones. Small buffers therefore have fewer
non-empty segments, i.e. fewer ring hops: E = 10 float64 at P = 4 gives 5 of
8, E ≥ 50 gives all 8; at P = 2 every E ≥ 4 fills all 4. When ranks share
cores, each hop costs a context switch on every rank (hundreds of µs here),
so latency follows the segment count, not the bytes. The ``segments`` in the
shape column is that count, computed from gloo's rule.

E includes bench_sync's state sizes (10, 26, 111, 319 float64 = K 1/4/16/64).
Every sample follows a barrier; element counts take turns within a repeat.

    python bench/bench_ring.py [--quick] [--worlds 2 4] [--elems 1 10 319 ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

BENCH = "bench_ring"
ELEMS = (1, 2, 4, 8, 10, 16, 26, 32, 64, 111, 319, 1024, 4096)


def ring_segments(elems: int, world: int) -> int:
    """Non-empty segments of gloo's ring all_reduce for ``elems`` elements on ``world`` ranks."""
    per_segment = -(-elems // (2 * world))  # ceil(E / 2P) elements (below gloo's max segment size here)
    return -(-elems // per_segment)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="smoke test: world 2, two sizes, few samples")
    p.add_argument("--worlds", type=int, nargs="*", default=None)
    p.add_argument("--elems", type=int, nargs="*", default=None)
    p.add_argument("--out", default=str(harness.RESULTS / f"{BENCH}.csv"))
    p.add_argument("--timeout", type=float, default=600.0, help="per world size, seconds")
    a = p.parse_args(argv)
    a.worlds = a.worlds or ([2] if a.tiny else [2, 4])
    a.elems = a.elems or ([10, 319] if a.tiny else list(ELEMS))
    a.samples = 4 if a.tiny else (120 if a.quick else 400)
    return a


def _rank_main(rank: int, world: int, elems: list[int], samples: int):
    import torch.distributed as dist

    torch.set_num_threads(1)
    bufs = {e: torch.zeros(e, dtype=torch.float64) for e in elems}
    times = {e: [] for e in elems}
    for i in range(samples + 3):
        for e, buf in bufs.items():
            dist.barrier()
            t = time.perf_counter()
            dist.all_reduce(buf)
            if i >= 3:  # warmup
                times[e].append(time.perf_counter() - t)
    return times if rank == 0 else None


def main(argv=None) -> int:
    from d9d_kernels.spawn import spawn_gloo

    a = parse(argv)
    rows = []
    for world in a.worlds:
        out = spawn_gloo(_rank_main, world, a.elems, a.samples, timeout=a.timeout, pg_timeout=120, stop_on_error=True)
        if out[0][0] != "ok":
            raise RuntimeError(f"{BENCH} world={world} failed: {out}")
        for e, times in out[0][1].items():
            st = harness.stats(times)
            seg = ring_segments(e, world)
            rows.append(harness.row(BENCH, op=f"all_reduce_world{world}", provider="raw_all_reduce",
                                    shape=f"E={e},segments={seg}", dtype="float64", device="cpu", stats=st))
            print(f"{BENCH}: world={world} E={e:<5d} segments={seg}/{2 * world}  {st.p50 * 1e6:>9.1f} us "
                  f"[p20 {st.p20 * 1e6:.1f}, p80 {st.p80 * 1e6:.1f}]", flush=True)
    path = harness.write_csv(a.out, rows)
    harness.plot(path, Path(path).with_suffix(".png"), x="E", title="raw gloo all_reduce vs float64 elements (colour: non-empty ring segments)")
    print(f"{BENCH}: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
