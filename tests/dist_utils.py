"""Spawn real gloo process groups on 127.0.0.1 for distributed tests.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)``
in ``world_size`` fresh processes with the default process group initialised
(gloo, a free port; ``d9d_kernels.spawn``), and returns the list of per-rank
return values. Any rank raising, or the whole run exceeding ``timeout``
seconds, fails the calling test: the processes are killed, nothing can hang CI.
"""

from __future__ import annotations

from d9d_kernels.spawn import free_port, spawn_gloo

__all__ = ["free_port", "run_distributed", "run_distributed_expect_errors"]

_ENV = {"TRITON_INTERPRET": "1"}  # no GPU here: Triton kernels run interpreted


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
    return spawn_gloo(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout, env=_ENV)


#: the torch.distributed collectives ``spy_collectives`` counts
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_object",
               "broadcast", "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all", "all_to_all_single", "barrier", "gather", "scatter")


def spy_collectives(calls: list) -> list:
    """Appends the name of every collective launched in this process to
    ``calls`` (patched on torch.distributed and c10d once per process: later
    calls keep the first list); returns ``calls``."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in COLLECTIVES:
        for mod in (dist, c10d):
            orig = getattr(mod, name, None)
            if orig is None or getattr(orig, "_spied", False):
                continue

            def wrap(*a, _orig=orig, _name=name, **k):
                calls.append(_name)
                return _orig(*a, **k)

            wrap._spied = True
            setattr(mod, name, wrap)
    return calls
