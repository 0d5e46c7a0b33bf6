"""Spawn real gloo process groups on 127.0.0.1 for distributed tests.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)``
in ``world_size`` fresh processes with the default process group initialised
(gloo, a free port), and returns the list of per-rank return values. Any
rank raising, or the whole run exceeding ``timeout`` seconds, fails the
calling test: the processes are killed, nothing can hang CI.
"""

from __future__ import annotations

import datetime
import os
import queue as _queue
import socket
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, pg_timeout):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout)
        )
        out = fn(rank, world_size, *args)
        queue.put((rank, "ok", out))
    except BaseException as e:  # report every failure to the parent
        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_distributed(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 30.0):
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    ``fn`` must be a module-level function (it is pickled). Returns the list of
    return values by rank (they must be picklable: use ``.tolist()``).
    Raises AssertionError naming the ranks that failed or timed out.
    """
    out = run_distributed_expect_errors(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout)
    errors = {r: m for r, (status, m) in out.items() if status == "error"}
    if errors:
        raise AssertionError("ranks failed:\n" + "\n".join(f"[rank {r}] {m}" for r, m in sorted(errors.items())))
    missing = [r for r, (status, _) in out.items() if status == "timeout"]
    if missing:
        raise AssertionError(f"ranks {missing} did not finish within {timeout}s")
    return [out[r][1] for r in range(world_size)]


def run_distributed_expect_errors(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 10.0):
    """Like run_distributed but returns ``{rank: ("ok", value) | ("error", msg)}``
    without raising, for tests that expect failures. Missing ranks (hung and
    killed) are reported as ``("timeout", None)``."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, pg_timeout), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = queue.get(timeout=1.0)
                out[rank] = (status, payload)
            except _queue.Empty:
                if all(not p.is_alive() for p in procs) and queue.empty():
                    break
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for r in range(world_size):
        out.setdefault(r, ("timeout", None))
    return out
