"""MoE router statistics: ExpertLoad.update against one torch.bincount and a per-layer torch loop.

Question: what does one fused update of every layer's expert histogram cost,
next to the floor of one ``torch.bincount`` over all layers' indices (each
layer's offset by ``layer * E``, the offset tensor made beforehand) and the
per-layer loop a training codebase writes (d9d's ``MoELayer`` counter:
``scatter_add_`` of ones into an int64 ``[E]`` per layer, then added into a
float64 ``[L, E]`` state)? A fourth row, ``read_floor`` (``idx.sum()``, one
vectorised pass over the same indices), is the floor of any update that
reads them: per-layer torch / read_floor bounds the speed-up an update can
show against the per-layer loop.

CPU rows run at 1 thread and at torch's default (``threads=`` in the shape):
the compiled update splits its slots over threads, the bincount's offset add
does too, and the per-layer loop's ``scatter_add_`` calls run on one.
Every contender adds the same random top-k routing ``[L, T, k]`` (no dropped
slots, so the bincount floor counts the same slots) into its own state.
Contenders take turns within each repeat (interleaved), medians over
repeats; CSV + PNG in bench/results/. GPU rows (when CUDA is available) run
the update under ``torch.cuda.set_sync_debug_mode("error")`` first, so a
host sync in it fails the run.

    python bench/bench_expert_load.py [--quick|--tiny] [--L 48] [--E 128] [--k 8] [--T 8192]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

BENCH = "bench_expert_load"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="smoke test: small shapes, few samples")
    p.add_argument("--L", type=int, default=48)
    p.add_argument("--E", type=int, default=128)
    p.add_argument("--k", type=int, default=8)
    p.add_argument("--T", type=int, nargs="*", default=None, help="tokens per layer (default 1024 8192)")
    p.add_argument("--devices", nargs="*", default=None)
    p.add_argument("--threads", type=int, nargs="*", default=None,
                   help="CPU thread counts (default: 1 and torch's default)")
    p.add_argument("--out", default=str(harness.RESULTS / f"{BENCH}.csv"))
    a = p.parse_args(argv)
    if a.tiny:
        a.L, a.E, a.k, a.T = 4, 16, 2, [64]
    a.T = a.T or [1024, 8192]
    a.repeats = 3 if a.tiny else (9 if a.quick else 21)
    a.min_repeat_s = 0.0 if a.tiny else (0.02 if a.quick else 0.05)
    a.devices = a.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    a.threads = a.threads or sorted({1, torch.get_num_threads()})
    return a


def routing(L: int, T: int, k: int, E: int, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.rand(L, T, E, generator=g).topk(k, -1).indices.to(device)


def contenders(idx: torch.Tensor, E: int) -> dict:
    import d9d_kernels as dk

    L = idx.shape[0]
    m = dk.ExpertLoad(E, num_layers=L, top_k=idx.shape[2]).to(idx.device)
    offsets = (torch.arange(L, device=idx.device) * E)[:, None, None]
    state = torch.zeros(L, E, dtype=torch.float64, device=idx.device)
    tpe = torch.zeros(L, E, dtype=torch.int64, device=idx.device)
    ones = torch.ones(idx.shape[1] * idx.shape[2], dtype=torch.int64, device=idx.device)

    def bincount():
        return torch.bincount((idx + offsets).view(-1), minlength=L * E)

    def per_layer():
        tpe.zero_()
        for layer in range(L):
            tpe[layer].scatter_add_(0, idx[layer].view(-1), ones)
        state.add_(tpe)

    return {"ExpertLoad.update": lambda: m.update(idx), "bincount_offset": bincount, "per_layer_torch": per_layer,
            "read_floor": lambda: idx.sum()}


def interleaved(fns: dict, repeats: int, min_repeat_s: float, sync) -> dict:
    """Per-call seconds of each contender: every repeat times each in turn."""
    number = {}
    for name, fn in fns.items():  # warm up, then pick a loop count per contender
        for _ in range(3):
            fn()
        sync()
        n, t = 1, 0.0
        while True:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            t = time.perf_counter() - t0
            if t >= min_repeat_s or n >= 1 << 16:
                break
            n *= 2
        number[name] = n
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(number[name]):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) / number[name])
    return times


def main(argv=None) -> int:
    a = parse(argv)
    rows = []
    default_threads = torch.get_num_threads()
    runs = [(d, n) for d in a.devices for n in (a.threads if d == "cpu" else [default_threads])]
    for device, threads in runs:
        torch.set_num_threads(threads)
        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        for T in a.T:
            idx = routing(a.L, T, a.k, a.E, device)
            fns = contenders(idx, a.E)
            if device == "cuda":  # a host sync inside the update raises here
                fns["ExpertLoad.update"]()
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    fns["ExpertLoad.update"]()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            times = interleaved(fns, a.repeats, a.min_repeat_s, sync)
            shape = f"L={a.L},E={a.E},k={a.k},T={T}" + (f",threads={threads}" if device == "cpu" else "")
            p50 = {}
            for name, ts in times.items():
                st = harness.stats(ts)
                p50[name] = st.p50
                rows.append(harness.row(BENCH, op="expert_load_update", provider=name, shape=shape, dtype="int64",
                                        device=device, stats=st))
                print(f"{BENCH}: {device} {shape} {name:<18s} {st.p50 * 1e6:>10.1f} us "
                      f"[p20 {st.p20 * 1e6:.1f}, p80 {st.p80 * 1e6:.1f}]", flush=True)
            ours = p50["ExpertLoad.update"]
            print(f"{BENCH}: {device} {shape} update / bincount = {ours / p50['bincount_offset']:.2f}x, "
                  f"per-layer torch / update = {p50['per_layer_torch'] / ours:.2f}x "
                  f"(/ read_floor = {p50['per_layer_torch'] / p50['read_floor']:.2f}x)", flush=True)
    torch.set_num_threads(default_threads)
    path = harness.write_csv(a.out, rows)
    harness.plot(path, Path(path).with_suffix(".png"), x="T", panels="device",
                 title=f"expert load update, L={a.L}, E={a.E}, k={a.k}")
    print(f"{BENCH}: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
