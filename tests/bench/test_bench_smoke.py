"""Smoke tests of bench/: every script runs in its tiny mode and writes well-formed
CSV/PNG/markdown, and every provider computes the same values as torchmetrics.

Nothing here asserts a timing (the figures of a tiny run are meaningless).
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
sys.path.insert(0, str(BENCH))

import providers as pv  # noqa: E402


def _env():
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    doc = out / "performance.md"
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run_all.py"), "--tiny", "--results", str(out), "--doc", str(doc),
         "--only", "update", "sync", "ring", "training"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"run_all --tiny failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return out, doc


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,providers", [
    ("update", set(pv.UPDATE_PROVIDERS)),
    ("update_segmentation", {"d9d", "d9d_movedim_copy", "torchmetrics", "torchmetrics_fast", "plain_torch"}),
    ("sync", {"d9d", "d9d_compute", "d9d_compute_part", "torchmetrics", "torcheval", "raw_all_reduce"}),
    ("training", {"none", "d9d", "torchmetrics", "torchmetrics_fast"}),
    ("ring", {"raw_all_reduce"}),
])
def test_csv_well_formed(tiny_run, name, providers):
    out, _ = tiny_run
    rows = _rows(out / f"bench_{name}.csv")
    assert rows, name
    assert {r["provider"] for r in rows} == providers
    cols = set(rows[0])
    assert {"provider", "shape"} <= cols
    # the report reads every row's quantiles (whatever the unit); they are ordered
    sys.path.insert(0, str(BENCH))
    import report

    for r in report.load(out / f"bench_{name}.csv"):
        assert 0 < r["_p20"] <= r["_p50"] <= r["_p80"], r
    if name != "update_segmentation":  # a table in the report, no plot
        assert (out / f"bench_{name}.png").stat().st_size > 1000


@pytest.mark.timeout(900)
def test_report_table(tiny_run):
    _, doc = tiny_run
    text = doc.read_text()
    assert "## Targets" in text and "| benchmark |" in text
    sys.path.insert(0, str(BENCH))
    import report

    training_target = f"≤ {report.TRAINING_TARGET_PCT:g} %"
    for what in ("torchmetrics (default)", "torcheval", "plain torch", "raw all_reduce", training_target):
        assert what in text, what
    if not torch.cuda.is_available():
        assert "CPU-only" in text
    assert "cores" in text  # machine description


@pytest.mark.parametrize("C,N", [(10, 257), (37, 64)])
def test_update_providers_agree_with_torchmetrics(C, N):
    """Every bench_update provider computes what torchmetrics computes on the same data."""
    ref = pv.TorchmetricsUpdateGroup(C, compute_groups=False)
    groups = {p: pv.make_update_group(p, C) for p in pv.UPDATE_PROVIDERS}
    for step in range(3):
        inp = pv.update_inputs(N + step, C, seed=step)
        ref.update(*inp)
        for g in groups.values():
            g.update(*inp)
    want = ref.compute()
    for p, g in groups.items():
        got = g.compute()
        assert set(got) >= set(pv.UPDATE_KEYS), p
        for k in pv.UPDATE_KEYS:
            if p == "torchmetrics" and k == "top5":
                continue  # automatic compute groups may merge top5 into top-1 (see demo._TM)
            torch.testing.assert_close(got[k].double().cpu(), want[k].double(), rtol=1e-6, atol=1e-6,
                                       msg=lambda m: f"{p}/{k}: {m}")


def _sync_fn(rank, world):
    import providers as pv  # noqa: F811

    K = 7
    logits, target, loss, n = pv.update_inputs(40 + 9 * rank, pv.SYNC_C, seed=rank)
    out = {}
    for p in ("d9d", "torchmetrics", "torcheval"):
        g = pv.make_sync_group(p, K)
        g.update(logits, target, loss, n)
        out[p] = {k: float(v) for k, v in g.sync_compute().items()}
    return out


@pytest.mark.timeout(300)
def test_sync_providers_agree():
    """bench_sync's groups compute the same global values with every provider (2 gloo ranks)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from dist_utils import run_distributed

    res = run_distributed(_sync_fn, 2, timeout=240)
    for r in res:
        for p in ("d9d", "torcheval"):
            for k, v in r["torchmetrics"].items():
                assert abs(r[p][k] - v) <= 1e-5 * max(1, abs(v)), (p, k, r[p][k], v)


def _gloo_ring_segments(elems: int, world: int, elem_size: int = 8) -> int:
    """gloo/allreduce.cc's segment arithmetic in bytes, transcribed: segments with a positive length."""
    def round_up(v, m):
        return (v + m - 1) // m * m

    total = elems * elem_size
    seg_bytes = round_up((total + 2 * world - 1) // (2 * world), elem_size)
    num = round_up(max((total + seg_bytes - 1) // seg_bytes, 2 * world), world)
    return sum(1 for i in range(num) if total - i * seg_bytes > 0)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ring_segments_follow_gloo(world):
    """bench_ring's element-level segment count equals gloo's byte-level rule."""
    import bench_ring

    for e in list(range(1, 300)) + [319, 1024, 4096]:
        assert bench_ring.ring_segments(e, world) == _gloo_ring_segments(e, world), (e, world)


def test_lm_tp_mode_runs_and_agrees(tmp_path):
    """bench_lm.py --tp 2 --tiny: the sharded groups' values equal the unsharded one's (it prints RESULTS DIFFER
    otherwise) and the CSV holds wall and CPU rows of every provider, and the tp providers' times from
    each rank's own start (incl. barrier skew)."""
    out = tmp_path / "bench_lm_tp.csv"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_lm.py"), "--tp", "2", "--tiny", "--out", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tp / unsharded" in proc.stdout and "RESULTS DIFFER" not in proc.stdout, proc.stdout
    rows = _rows(out)
    assert {(r["op"], r["provider"]) for r in rows} == {
        (op, p) for op in ("ppl+acc+top5", "ppl+acc+top5 cpu-seconds") for p in ("d9d_unsharded", "d9d_tp", "d9d_tp_lse")
    } | {("ppl+acc+top5 incl. barrier skew", p) for p in ("d9d_tp", "d9d_tp_lse")}


def test_report_gpu_sections(tmp_path):
    """The committed GPU results (bench/device_run.sh) render: the GPU is named,
    each GPU section is there, and the kernel targets hold the fractions the
    CSV gives (read floor / op, recomputed here)."""
    import shutil

    import report

    names = ("bench_kernels_cuda.csv", "bench_update_cuda.csv", "bench_update_hostcost_cuda.csv",
             "class_stats_variants_cuda.csv", "gpu_machine.json", "update_host_syncs.jsonl")
    for name in names:
        shutil.copy(BENCH / "results" / name, tmp_path / name)
    text, block = report.build(tmp_path, tmp_path / "performance.md", plots=False)
    assert "CPU-only" not in text and "H200" in text.split("## Targets")[0]
    for title in ("## GPU kernels", "## GPU class_stats from logits, by feature", "latency on the GPU",
                  "metric update on the GPU", "Host syncs per step"):
        assert title in text, title
    p50 = {(r["op"], r["shape"], r["provider"]): float(r["p50_us"]) for r in _rows(tmp_path / names[0])}
    shape = "N=100000000,C=0"
    one_d = min(p50[(op, shape, "floor")] / p50[(op, shape, "cuda")] for op in ("weighted_moments", "running_extrema"))
    row = next(line for line in text.splitlines() if line.startswith("| kernels (GPU) | 1-D kernels"))
    assert f"| {one_d:.2f} |" in row
    assert "docs/performance.md" in block and block.count("\n| ") <= 5  # the README: headline rows only


@pytest.mark.timeout(300)
def test_d9d_tiny_run_and_report(tmp_path):
    """bench_d9d.py --tiny: well-formed timing rows for both contenders, the checks give the
    measured facts (1 all_reduce per steady group sync, 13 for d9d's built-ins; exact float64
    token sums, float32 ones off), and the report renders its section, targets and plot."""
    pytest.importorskip("d9d")
    import report

    out = tmp_path / "bench_d9d.csv"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_d9d.py"), "--tiny", "--out", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = report.load(out)
    assert {(r["op"], r["provider"]) for r in rows} == {
        ("update", p) for p in ("d9d_builtin", "d9d", "d9d_f32_count")} | {
        ("sync_compute", p) for p in ("d9d_builtin", "d9d")}
    for r in rows:
        assert 0 < r["_p20"] <= r["_p50"] <= r["_p80"], r
    checks = _rows(tmp_path / "bench_d9d_checks.csv")
    steady = {c["provider"]: int(c["value"]) for c in checks
              if c["check"] == "all_reduce_per_sync" and c["shape"].endswith("sync=steady")}
    assert steady == {"d9d": 1, "d9d_builtin": 13}
    sums = {(c["provider"], c["shape"]): c for c in checks if c["check"] == "token_sum_exact"}
    assert all(c["value"] == c["expected"] for (p, _), c in sums.items() if p == "d9d")
    assert any(c["value"] != c["expected"] for (p, _), c in sums.items() if p == "d9d_builtin")
    text, _ = report.build(tmp_path, tmp_path / "performance.md")
    assert "## Inside d9d" in text and "| d9d | update: d9d built-ins / d9d_kernels" in text
    assert (tmp_path / "bench_d9d.png").stat().st_size > 1000


def test_catalogue_bench_covers_every_class_and_reports(tmp_path):
    """bench_catalogue has a case for every exported metric class (it exits
    naming any without one) and its rows reach the report's targets."""
    import report

    out = tmp_path / "bench_catalogue.csv"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_catalogue.py"), "--quick", "--only",
                           "SumMetric,AUROC,Accuracy,LogCoshError", "--out", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(out)
    assert [r["metric"] for r in rows] == ["AUROC", "Accuracy", "LogCoshError", "SumMetric"]
    assert {r["kernels"] for r in rows} == {"score_histogram", "class_stats", "weighted_moments"}
    assert all(float(r["update_us"]) > 0 and float(r["all_ops_us"]) > 0 for r in rows)
    text, _ = report.build(tmp_path, tmp_path / "performance.md", plots=False)
    assert "## Catalogue updates against their op calls" in text and "| catalogue |" in text


def test_first_update_bench_tiny(tmp_path):
    """bench_first_update.py --tiny: rows of every case and series, quantiles ordered (no timing asserted)."""
    out = tmp_path / "bench_first_update.csv"
    proc = subprocess.run([sys.executable, str(BENCH / "bench_first_update.py"), "--tiny", "--out", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = _rows(out)
    assert {(r["op"], r["provider"]) for r in rows} == {
        (case, p) for case in ("WeightedMeanMetric", "MetricGroup[Accuracy]")
        for p in ("first", "warm", "first_minus_warm")}
    for r in rows:
        assert float(r["p20_us"]) <= float(r["p50_us"]) <= float(r["p80_us"]), r
