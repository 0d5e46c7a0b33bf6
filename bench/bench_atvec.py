"""Is ATen's at::vec a replacement for the hand-written CPU lanes (#13)?

Question: the class_stats CPU kernel converts float16/bfloat16 scores with
its own 16-byte vector code (csrc/cpu/half_bits.h, lanes-inl.h) and, on AVX2
machines, a 32-byte build of the same loop (target_region.h). Would
``at::vec::Vectorized`` do as well from inside this extension? One row-max
pass over bfloat16 ``[2048, 32000]`` (the LM logits of bench_lm), one
thread, both written the same way (bench/csrc/atvec_rowmax.cpp, built here
with torch's cpp_extension and the extension's default flags), beside
torch's own ``amax(-1)`` (ATen's CPU-capability dispatched kernel). Results
equal ``x.float().amax(-1)``. Writes ``bench/results/bench_atvec.csv``.

    python bench/bench_atvec.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

BENCH = "bench_atvec"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(harness.RESULTS / f"{BENCH}.csv"))
    a = p.parse_args(argv)
    from torch.utils.cpp_extension import load

    src = Path(__file__).resolve().parent / "csrc" / "atvec_rowmax.cpp"
    with tempfile.TemporaryDirectory() as build:
        ext = load("d9d_bench_atvec", [str(src)], extra_cflags=["-O3"], build_directory=build, verbose=False)
    N, V = (512, 32000) if a.quick else (2048, 32000)
    x = torch.randn(N, V, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    want = x.float().amax(-1)
    outs = {"at_vec": torch.empty(N), "d9d_lanes": torch.empty(N)}
    fns = {"at_vec": ext.rowmax_atvec, "d9d_lanes": ext.rowmax_lanes}
    times = {k: [] for k in (*fns, "torch_amax")}
    threads = torch.get_num_threads()
    for _ in range(5 if a.quick else 15):  # interleaved rounds
        for k, f in fns.items():
            times[k].append(f(x, outs[k]))
        torch.set_num_threads(1)
        t0 = time.perf_counter()
        x.amax(-1)
        times["torch_amax"].append(time.perf_counter() - t0)
        torch.set_num_threads(threads)
    for k, o in outs.items():
        assert torch.equal(o, want), f"{k}: wrong row max"
    rows = []
    for k, ts in times.items():
        st = harness.stats(ts)
        rows.append(harness.row(BENCH, op="row_max", provider=k, shape=f"N={N},V={V}", dtype="bfloat16", device="cpu",
                                stats=st))
        print(f"{BENCH}: bfloat16 [{N}, {V}] row max, 1 thread: {k:10s} {st.p50 * 1e3:8.2f} ms "
              f"[p20 {st.p20 * 1e3:.2f}, p80 {st.p80 * 1e3:.2f}]", flush=True)
    harness.write_csv(a.out, rows)
    print(f"{BENCH}: wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
