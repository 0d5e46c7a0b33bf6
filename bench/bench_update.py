"""Per-step update latency of a typical metric group (CPU).

Question: what does updating loss mean + accuracy + top-5 + macro F1 + macro
precision + macro recall + confusion matrix cost per training step, for
C = 10 and 1000 classes and batch 32 ... 65536, with d9d_kernels versus
torchmetrics (defaults; fastest settings), torcheval and a hand-written
plain-torch update (bench/providers.py)?

Targets (issue 5): >= 20x faster than torchmetrics default, >= 3x faster than
torcheval, no slower than plain torch.

    python bench/bench_update.py [--quick] [--out bench/results/update.csv]

One CSV row per (provider, C, batch): median/p20/p80 of the update call.
Plot + table: ``python bench/report.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import providers as pv  # noqa: E402

BENCH = "bench_update"
FULL_BATCHES = (32, 128, 512, 2048, 8192, 32768, 65536)
QUICK_BATCHES = (32, 1024, 16384)
CLASSES = (10, 1000)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batch sizes and repeats (CI, run_all --quick)")
    p.add_argument("--tiny", action="store_true", help="smoke test: 2 tiny shapes, 2 repeats (tests only)")
    p.add_argument("--classes", type=int, nargs="*", default=None)
    p.add_argument("--batches", type=int, nargs="*", default=None)
    p.add_argument("--providers", nargs="*", default=list(pv.UPDATE_PROVIDERS), choices=pv.UPDATE_PROVIDERS)
    p.add_argument("--out", default=str(harness.RESULTS / f"{BENCH}.csv"))
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: on cuda the d9d update is also "
                   "run under torch.cuda.set_sync_debug_mode('error') and its host syncs per step recorded")
    a = p.parse_args(argv)
    if a.tiny:
        a.classes = a.classes or [10, 50]
        a.batches = a.batches or [32, 256]
    a.classes = a.classes or list(CLASSES)
    a.batches = a.batches or list(QUICK_BATCHES if a.quick else FULL_BATCHES)
    return a


def host_sync_check(g, inputs, out_csv, C, N) -> None:
    """GPU only: the d9d update + trigger_sync must not synchronise with the host.

    Runs 3 steps under ``torch.cuda.set_sync_debug_mode("error")`` (any
    host-device sync raises) and appends the verdict to
    ``<results>/update_host_syncs.jsonl`` (syncs_per_step = 0, or the error).
    """
    import json

    rec = {"C": C, "N": N, "device": torch.cuda.get_device_name(0)}
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            g.update(*inputs)
        rec["syncs_per_step"] = 0
    except RuntimeError as e:
        rec["syncs_per_step"] = ">= 1"
        rec["error"] = str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    with open(Path(out_csv).with_name("update_host_syncs.jsonl"), "a") as f:
        f.write(json.dumps(rec) + "\n")
    print(f"{BENCH}: d9d host syncs per step on GPU (C={C}, N={N}): {rec['syncs_per_step']}", flush=True)


def main(argv=None) -> int:
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    timing = harness.Timing.tiny() if a.tiny else (harness.Timing.quick() if a.quick else harness.Timing())
    rows, dev = [], torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    for C in a.classes:
        for N in a.batches:
            inputs = pv.update_inputs(N, C, device=dev)
            for prov in a.providers:
                g = pv.make_update_group(prov, C, device=dev)
                g.update(*inputs)  # first call: allocation, torchmetrics compute-group detection
                if prov == "d9d" and dev.type == "cuda":
                    host_sync_check(g, inputs, a.out, C, N)
                st = harness.measure(lambda: g.update(*inputs), timing, sync=sync)
                rows.append(harness.row(BENCH, op="group_update", provider=prov, shape=f"C={C},N={N}",
                                        dtype="float32", device=dev.type, stats=st))
                print(f"{BENCH}: C={C:<5d} N={N:<6d} {prov:<18s} {st.p50 * 1e6:>12.1f} us  "
                      f"[p20 {st.p20 * 1e6:.1f}, p80 {st.p80 * 1e6:.1f}]", flush=True)
                del g
    harness.write_csv(a.out, rows)
    print(f"{BENCH}: wrote {a.out} ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
