"""Run a function on N local gloo ranks (127.0.0.1), never hanging.

Shared by the demo, bench/bench_sync.py and the distributed tests:
``spawn_gloo(fn, world_size, *args)`` starts ``world_size`` fresh processes
(``spawn`` start method), initialises the default process group (gloo, a
free port, ``pg_timeout``), runs ``fn(rank, world_size, *args)`` and returns
``{rank: ("ok", value) | ("error", traceback text) | ("timeout", None)}``.
Ranks still running after ``timeout`` seconds (or, with
``stop_on_error``, once any rank failed: the others would block in a
collective) are killed.

Example (``fn`` must be importable: defined at module level)::

    out = spawn_gloo(my_fn, 2, "arg")      # {0: ("ok", ...), 1: ("ok", ...)}
"""

from __future__ import annotations

import datetime
import os
import queue as _queue
import socket
import time
import traceback

__all__ = ["free_port", "spawn_gloo"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world_size, port, fn, args, q, pg_timeout, threads, env):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    for k, v in (env or {}).items():
        os.environ.setdefault(k, v)
    import torch
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        q.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException as e:  # report every failure to the parent
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn_gloo(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 30.0,
               threads: int | None = None, env: dict[str, str] | None = None,
               stop_on_error: bool = False) -> dict[int, tuple[str, object]]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        timeout: seconds for the whole run; later ranks are killed.
        pg_timeout: the process group's timeout (collectives, store).
        threads: ``torch.set_num_threads`` in each rank (None: torch's default).
        env: variables set in each rank unless already set.
        stop_on_error: stop waiting (and kill the rest) at the first error.

    Returns ``{rank: (status, payload)}`` for every rank; values must pickle.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, world_size, port, fn, args, q, pg_timeout, threads, env), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, object]] = {}
    deadline = time.monotonic() + timeout
    failed = False
    try:
        while len(out) < world_size and time.monotonic() < deadline and not (stop_on_error and failed):
            try:
                rank, status, payload = q.get(timeout=1.0)
            except _queue.Empty:
                if all(not p.is_alive() for p in procs) and q.empty():
                    break
                continue
            out[rank] = (status, payload)
            failed = failed or status == "error"
    finally:
        for p in procs:
            p.join(timeout=1 if failed else 5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    for r in range(world_size):
        out.setdefault(r, ("timeout", None))
    return out
