"""Shared benchmark harness: time a callable, write fixed-column CSV rows, plot.

API (keep it small, every bench/bench_*.py uses it)::

    timing = Timing()                    # or Timing.quick() (CI) / Timing.tiny() (smoke tests)
    st = measure(fn, timing)             # Stats(p20, p50, p80) in seconds per call of fn()
    st = stats([t0, t1, ...])            # Stats of times you measured yourself (seconds)
    rows.append(row("kernels", op="class_stats", provider="cpp", shape="N=1000,C=10",
                    dtype="float32", device="cpu", stats=st))
    write_csv(RESULTS / "kernels.csv", rows)          # overwrite (append=True to add)
    plot(RESULTS / "kernels.csv", RESULTS / "kernels.png", x="N", title="...")

``measure`` runs ``timing.warmup`` calls, then ``timing.repeats`` repeats; each
repeat times a loop of ``number`` calls, ``number`` chosen once so that a repeat
lasts at least ``timing.min_repeat_s`` (so a 1 µs call is not timed with the
timer's own resolution). Quantiles are over repeats. For CUDA work pass
``sync=torch.cuda.synchronize``.
"""

from __future__ import annotations

import csv
import datetime
import os
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
COLUMNS = ("bench", "op", "provider", "shape", "dtype", "device", "p20_us", "p50_us", "p80_us", "git_sha", "date")


@dataclass(frozen=True)
class Timing:
    """How long to measure: warmup calls, repeats, minimum duration of one repeat."""

    warmup: int = 3
    repeats: int = 15
    min_repeat_s: float = 0.02
    max_total_s: float = 20.0  # stop repeating early past this (huge inputs)

    @classmethod
    def quick(cls) -> "Timing":
        return cls(warmup=2, repeats=7, min_repeat_s=0.005, max_total_s=6.0)

    @classmethod
    def tiny(cls) -> "Timing":
        return cls(warmup=1, repeats=2, min_repeat_s=0.0, max_total_s=1.0)


@dataclass(frozen=True)
class Stats:
    """Seconds per call: 20th, 50th, 80th percentile over repeats."""

    p20: float
    p50: float
    p80: float
    n: int = 0


def stats(times: Iterable[float]) -> Stats:
    """Percentiles of a list of per-call times (seconds)."""
    ts = sorted(float(t) for t in times)
    if not ts:
        raise ValueError("stats() needs at least one time")
    if len(ts) == 1:
        return Stats(ts[0], ts[0], ts[0], 1)
    q = statistics.quantiles(ts, n=10, method="inclusive")  # deciles: q[1] = p20, q[7] = p80
    return Stats(q[1], statistics.median(ts), q[7], len(ts))


def measure(fn: Callable[[], object], timing: Timing = Timing(), sync: Callable[[], object] | None = None) -> Stats:
    """Times ``fn()``; returns per-call Stats (seconds)."""
    sync = sync or (lambda: None)
    for _ in range(timing.warmup):
        fn()
    sync()
    # calibrate the loop length of one repeat
    number, t0 = 1, time.perf_counter()
    fn()
    sync()
    one = time.perf_counter() - t0
    if timing.min_repeat_s > 0 and one < timing.min_repeat_s:
        number = max(1, int(timing.min_repeat_s / max(one, 1e-9)))
    times, start = [], time.perf_counter()
    for _ in range(timing.repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / number)
        if time.perf_counter() - start > timing.max_total_s and len(times) >= 3:
            break
    return stats(times)


def git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def row(bench: str, *, op: str, provider: str, shape: str, dtype: str, device: str, stats: Stats) -> dict:
    """One CSV row with the fixed COLUMNS (times in microseconds per call)."""
    return {
        "bench": bench, "op": op, "provider": provider, "shape": shape, "dtype": dtype, "device": device,
        "p20_us": f"{stats.p20 * 1e6:.3f}", "p50_us": f"{stats.p50 * 1e6:.3f}", "p80_us": f"{stats.p80 * 1e6:.3f}",
        "git_sha": git_sha(), "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def write_csv(path: str | os.PathLike, rows: list[dict], append: bool = False) -> Path:
    """Writes ``rows`` (COLUMNS order) to ``path``; ``append`` adds to an existing file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not (append and path.exists() and path.stat().st_size > 0)
    with open(path, "w" if not append else "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)
    return path


def read_csv(path: str | os.PathLike) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _shape_value(shape: str, key: str) -> float | None:
    for part in shape.split(","):
        k, _, v = part.partition("=")
        if k.strip() == key:
            try:
                return float(v)
            except ValueError:
                return None
    return None


def plot(csv_path: str | os.PathLike, png_path: str | os.PathLike, *, x: str = "N", title: str = "",
         ylabel: str = "µs per call (p50)", group: tuple[str, ...] = ("op", "provider"),
         panels: str | None = "op") -> Path:
    """Log-log p50 vs the ``x`` field of ``shape``, one line per ``group``, one panel per ``panels`` value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in read_csv(csv_path) if _shape_value(r["shape"], x) is not None]
    keys = sorted({r[panels] for r in rows}) if panels else [""]
    fig, axes = plt.subplots(1, max(1, len(keys)), figsize=(4.2 * max(1, len(keys)), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        sub = [r for r in rows if not panels or r[panels] == key]
        lines: dict[tuple, list] = {}
        for r in sub:
            rest = tuple(f"{k}={v}" for k, v in (_other_shape(r["shape"], x)))
            lines.setdefault(tuple(r[g] for g in group if g != panels) + rest, []).append(
                (_shape_value(r["shape"], x), float(r["p50_us"])))
        for label, pts in sorted(lines.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=" ".join(label))
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(x)
        ax.set_title(key, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel(ylabel)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def _other_shape(shape: str, x: str):
    for part in shape.split(","):
        k, _, v = part.partition("=")
        if k.strip() and k.strip() != x:
            yield k.strip(), v.strip()
