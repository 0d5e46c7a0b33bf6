"""``python -m d9d_kernels.trace DIR [--tools ...] [--steps all|hta|N:M] [--workload-card F] [--json F] [--html F]``
and ``python -m d9d_kernels.trace diff RUN_A RUN_B [--steps ...] [--top N] [--json F] [--html F]``.

Runs the selected tools (all by default) on a workload / trace directory, a
trace file or a snapshot, prints one table per tool, and optionally writes the
full results as JSON and a self-contained HTML report.

Errors: bad input never produces a traceback. A file that cannot be read is
named in a one-line ``error:`` message (stderr) and in the failing tool's
section; the other ranks and tools still run. Exit status: 0 when at least one
tool produced a result, 1 when every tool failed (nothing readable), 2 for
usage errors (unknown tool, missing path, unwritable output).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import sys
import time
from pathlib import Path

TOOLS = ("throughput", "communication", "memory", "overlap", "training_phases",
         "fsdp", "straggler", "kernel", "gpu_utilization", "idle_time", "launch", "counters", "sequences", "critical_path")


def _parse(argv):
    p = argparse.ArgumentParser(
        prog="python -m d9d_kernels.trace",
        description="Analyse PyTorch profiler traces (one per rank) and CUDA memory snapshots.")
    p.add_argument("paths", nargs="+", metavar="DIR",
                   help="workload dir, trace dir, trace file(s) (.json/.json.gz) or snapshot (.pickle)")
    p.add_argument("--tools", default=",".join(TOOLS),
                   help=f"comma-separated subset of: {','.join(TOOLS)} (default: all)")
    p.add_argument("--workload-card", default=None, metavar="F",
                   help="workload_card.yaml (batch size, seq len, FLOPs) for tokens/s and MFU")
    p.add_argument("--steps", default="hta", metavar="all|hta|N:M",
                   help="step filter for every tool: 'hta' (default: HolisticTraceAnalysis's, GPU work "
                        "of the last ProfilerStep dropped), 'all', or ProfilerStep numbers N:M inclusive")
    p.add_argument("--allow-mixed", action="store_true",
                   help="analyse traces of different jobs in one directory together (refused by default)")
    p.add_argument("--profile-mode", default="auto", choices=("auto", "gpu", "cpu"),
                   help="GPU analysis when the trace has GPU events (auto), or force one")
    p.add_argument("--json", default=None, metavar="F", help="write all results as JSON to F")
    p.add_argument("--html", default=None, metavar="F", help="write a self-contained HTML report to F")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="progress bars on stderr even when it is not a terminal")
    g.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars (default: only when stderr is a terminal)")
    p.add_argument("--quiet", action="store_true", help="do not print the tables")
    return p.parse_args(argv)


def _one_line(msg: str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(msg)).strip()


def _write_outputs(args, doc: dict, page) -> int:
    """Writes ``doc`` to ``--json`` and ``page(html_report)`` to ``--html``
    when asked; 2 when a file cannot be written, else 0."""
    rc = 0
    if args.json:
        try:
            text = _json_text(doc)
            with open(args.json, "w", encoding="utf-8") as fh:
                fh.write(text)
        except (OSError, ValueError, TypeError) as exc:
            _err(f"{args.json}: cannot write JSON: {exc}")
            rc = 2
    if args.html:
        from d9d_kernels.trace.report import html_report

        try:
            text = page(html_report)
            with open(args.html, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as exc:
            _err(f"{args.html}: cannot write HTML: {exc}")
            rc = 2
    return rc


def _json_text(doc) -> str:
    """``doc`` as indented JSON; msgspec's encoder when installed (json's indented encoder
    is pure Python: seconds for a many-rank result). ``doc`` is already NaN-free (_clean)."""
    try:
        import msgspec
    except ImportError:
        return json.dumps(doc, indent=1, allow_nan=False)
    return msgspec.json.format(msgspec.json.encode(doc), indent=1).decode("utf-8")


def _steps_ok(steps: str) -> bool:
    """Whether ``--steps`` parses; says why on stderr when not."""
    from d9d_kernels.trace._common import parse_steps

    try:
        parse_steps(steps)
    except ValueError as exc:
        _err(f"--steps: {exc}")
        return False
    return True


def _err(msg: str):
    print(f"error: {_one_line(msg)}", file=sys.stderr)


def _clean(x):
    """JSON-safe copy: NaN/inf -> None, numpy scalars -> python, unknown -> str."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    if hasattr(x, "item"):
        return _clean(x.item())
    return str(x)


def _run_tool(name: str, target, card, mode: str, steps="hta", allow_mixed=False) -> dict:
    from d9d_kernels.trace._load import TraceError
    from d9d_kernels.trace._result import result

    try:
        mod = importlib.import_module(f"d9d_kernels.trace.{name}")
    except Exception as exc:
        return result(name, errors={f"<tool {name}>": f"cannot import: {type(exc).__name__}: {exc}"})
    try:
        return mod.metric_cal(target, workload_card_path=card, profile_mode=mode, steps=steps,
                              allow_mixed=allow_mixed)
    except TraceError as exc:
        return result(name, errors={exc.file: exc.reason})
    except (MemoryError, RecursionError) as exc:
        return result(name, errors={str(target): f"{type(exc).__name__} while running {name}"})
    except Exception as exc:  # a tool bug must not take the other tools down
        return result(name, errors={f"<tool {name}>": f"{type(exc).__name__}: {exc}"})


def _ranges(nums: list[int]) -> str:
    out, i = [], 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        out.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(out)


def missing_ranks(found: list[int], world_sizes: list[int]) -> str | None:
    """A one-line warning when ranks are missing (gaps, or fewer than world_size)."""
    if not found:
        return None
    ws = max(world_sizes) if world_sizes else None
    expected = set(range(ws)) if ws else set(range(min(found), max(found) + 1))
    gone = sorted(expected - set(found))
    if not gone:
        return None
    basis = f"world_size {ws} from distributedInfo" if ws else "gaps in the rank numbering"
    return f"{len(found)} rank trace(s) found, missing rank(s) {_ranges(gone)} ({basis})"


def _preparse(target, card, progress: bool, allow_mixed: bool = False) -> tuple[dict, list]:
    """Parse every rank once (with a progress bar) so the tools reuse the parsed traces.

    Returns ``(errors, warnings)``.
    """
    from d9d_kernels.trace import _common
    from d9d_kernels.trace._load import TraceError, find_workload, load_ranks

    try:
        wl = find_workload(target, card, allow_mixed=allow_mixed)
    except TraceError as exc:
        return {exc.file: exc.reason}, []
    errors: dict = {}
    ranks = load_ranks(wl, parallel=len(wl.traces) > 1, progress=progress, errors=errors)
    warnings = []
    ws = [rt.world_size for rt in ranks.values() if isinstance(rt.world_size, int)]
    w = missing_ranks(sorted(wl.traces), ws)
    if w:
        warnings.append(w)
    if ranks:
        # seed the shared per-workload cache (same key open_workload computes)
        key = (_common._key(target, card), bool(allow_mixed))
        _common._CACHE.clear()
        _common._CACHE[key] = (wl, ranks, errors)
    return errors, warnings


def _diff_main(argv) -> int:
    """``python -m d9d_kernels.trace diff RUN_A RUN_B``: op-by-op comparison of two runs."""
    p = argparse.ArgumentParser(prog="python -m d9d_kernels.trace diff",
                                description="Compare two runs op by op (count and time per step), "
                                            "the largest regressions first.")
    p.add_argument("run_a", metavar="RUN_A", help="baseline: trace dir or file")
    p.add_argument("run_b", metavar="RUN_B", help="compared run: trace dir or file")
    p.add_argument("--steps", default="hta", metavar="all|hta|N:M", help="step filter for both runs")
    p.add_argument("--allow-mixed", action="store_true", help="accept traces of different jobs in one run")
    p.add_argument("--top", type=int, default=15, help="regressions/improvements listed per side (text)")
    p.add_argument("--json", default=None, metavar="F", help="write the full comparison as JSON to F")
    p.add_argument("--html", default=None, metavar="F", help="write an HTML report to F")
    args = p.parse_args(argv)
    from d9d_kernels.trace import diff
    from d9d_kernels.trace._load import TraceError

    for path in (args.run_a, args.run_b):
        if not os.path.exists(path):
            _err(f"{path}: no such file or directory")
            return 2
    if not _steps_ok(args.steps):
        return 2
    try:
        res = _clean(diff.compare(args.run_a, args.run_b, steps=args.steps, allow_mixed=args.allow_mixed))
    except TraceError as exc:
        _err(f"{exc.file}: {exc.reason}")
        return 1
    rc = _write_outputs(
        args, res,
        lambda html_report: html_report({"diff": {**res, "ranks": diff.top_table(res, args.top)}},
                                        title=f"diff {args.run_a} -> {args.run_b}",
                                        inputs=[args.run_a, args.run_b], errors=res["errors"],
                                        warnings=res["warnings"]),
    )
    for w in res["warnings"]:
        print(f"warning: {_one_line(w)}", file=sys.stderr)
    print(diff.text(res, args.top))
    if not res["ops"]["gpu"] and not res["ops"]["cpu"]:
        _err("nothing compared (no rank in both runs)")
        return 1
    return rc


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "diff":
        return _diff_main(argv[1:])
    args = _parse(argv)
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    bad = [t for t in tools if t not in TOOLS]
    if bad or not tools:
        _err(f"unknown tool(s) {', '.join(bad) or '(none given)'}; choose from {', '.join(TOOLS)}")
        return 2
    for p in args.paths:
        if not os.path.exists(p):
            _err(f"{p}: no such file or directory")
            return 2
    if args.workload_card:
        from d9d_kernels.trace._load import TraceError, load_card

        if not os.path.isfile(args.workload_card):
            _err(f"{args.workload_card}: workload card not found")
            return 2
        try:
            load_card(args.workload_card)
        except TraceError as exc:
            _err(f"{exc.file}: {exc.reason}")
            return 2
    if not _steps_ok(args.steps):
        return 2
    target = args.paths[0] if len(args.paths) == 1 else list(args.paths)
    progress = sys.stderr.isatty() if args.progress is None else args.progress

    t0 = time.perf_counter()
    snapshot_only = (isinstance(target, str) and Path(target).is_file()
                     and Path(target).suffix in (".pickle", ".pkl"))
    warnings: list = []
    if snapshot_only:
        skipped = [t for t in tools if t != "memory"]
        tools = ["memory"]
        if skipped:
            print(f"note: {target} is a memory snapshot: only the memory tool runs "
                  f"(skipped: {', '.join(skipped)})", file=sys.stderr)
    else:
        from d9d_kernels.trace._load import MixedJobsError, find_workload

        try:
            find_workload(target, args.workload_card, allow_mixed=args.allow_mixed)
        except MixedJobsError as exc:  # refused outright: no tool may merge them
            _err(f"{exc.file}: {exc.reason}")
            return 1
        except Exception:  # the tools report unreadable inputs themselves
            pass
    if not snapshot_only and any(t != "memory" for t in tools):
        try:
            warnings = _preparse(target, args.workload_card, progress, args.allow_mixed)[1]
        except Exception:  # the tools will report it themselves, one by one
            pass

    from d9d_kernels.trace._common import parse_steps

    spec = parse_steps(args.steps)
    if isinstance(spec, tuple) and not snapshot_only:
        from d9d_kernels.trace._common import open_workload
        from d9d_kernels.trace._load import TraceError

        try:
            _, ranks, _ = open_workload(target, args.workload_card, allow_mixed=args.allow_mixed)
        except TraceError:
            ranks = None  # unreadable: the tools report it
        nums = [rt.steps[0] for rt in (ranks or {}).values()]
        if nums and not any(((n >= spec[0]) & (n <= spec[1])).any() for n in nums):
            have = sorted({int(x) for rt in ranks.values() for x in rt.steps[0]})
            _err(f"--steps {args.steps}: no rank has a ProfilerStep#N in that range "
                 f"(steps present: {_ranges(have) or 'none'})")
            return 1
    results: dict[str, dict] = {}
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(tools), desc="tools", unit="tool", file=sys.stderr)
        except ImportError:  # pragma: no cover
            bar = None
    for name in tools:
        results[name] = _clean(_run_tool(name, target, args.workload_card, args.profile_mode,
                                         args.steps, args.allow_mixed))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()

    # one line per unreadable file, however many tools hit it
    all_errors: dict = {}
    for res in results.values():
        for f, why in (res.get("errors") or {}).items():
            all_errors.setdefault(f, why)
    for f, why in all_errors.items():
        _err(f"{f}: {why}")
    for res in results.values():
        warnings += [w for w in res.get("warnings") or [] if w not in warnings]
    for w in warnings:
        print(f"warning: {_one_line(w)}", file=sys.stderr)

    ok = [t for t, r in results.items() if r.get("ranks") or r.get("summary")
          or (r.get("notes") and not r.get("errors"))]
    doc = {"inputs": [str(p) for p in args.paths], "tools": results, "errors": all_errors,
           "warnings": warnings}
    rc_out = _write_outputs(
        args, doc,
        lambda html_report: html_report(results, title=f"Trace analysis: {', '.join(map(str, args.paths))}",
                                        inputs=args.paths, errors=all_errors, warnings=warnings),
    )
    if not args.quiet:
        from d9d_kernels.trace.report import text_report

        try:
            print(text_report(results))
            print(f"analysed {', '.join(map(str, args.paths))} in {time.perf_counter() - t0:.2f} s; "
                  f"{len(ok)}/{len(tools)} tools produced results")
            sys.stdout.flush()
        except BrokenPipeError:  # `| head`: stop printing quietly
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())

    if not ok:
        _err("no tool produced a result")
        return 1
    return rc_out


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        _err("interrupted")
        sys.exit(130)
