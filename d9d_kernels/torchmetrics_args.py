"""torchmetrics' ``Metric`` keyword arguments, taken by every metric class.

torchmetrics' classes all accept its "advanced settings" (``validate_args``,
``dist_sync_on_step``, ...). A metric here takes them too: a value that
behaves as torchmetrics' is accepted, another raises ``ValueError`` naming
the way to get that behaviour here (``Metric``'s metaclass calls
``take_settings`` once per construction).
"""

from __future__ import annotations

__all__ = ["TORCHMETRICS_SETTINGS", "take_settings"]


#: torchmetrics' ``Metric`` keyword arguments (its "advanced settings", taken by
#: every torchmetrics class), by what they mean here: ``None`` when any value
#: behaves as torchmetrics' (validation here is metadata only and free; no
#: list states to move; compute is cheap), else the value that matches this
#: library and what to use instead of the others.
TORCHMETRICS_SETTINGS = {
    "validate_args": None,
    "compute_on_cpu": None,
    "compute_with_cache": None,
    "dist_sync_on_step": (False, "forward's value is this rank's batch; sync the accumulated state with "
                          "trigger_sync(ctx) / wait_sync(ctx) or sync_and_compute(ctx)"),
    "sync_on_compute": (False, "compute() returns the value of the last sync (or the local one); call "
                        "sync_and_compute(ctx), or trigger_sync(ctx) / wait_sync(ctx) before compute()"),
    "process_group": (None, "pass the group as the ctx of trigger_sync(ctx) / sync_and_compute(ctx)"),
    "dist_sync_fn": (None, "the sync is one coalesced all_reduce; pass the ranks as a ctx to trigger_sync(ctx)"),
    "distributed_available_fn": (None, "pass dk.DistributedContext.local() as the ctx to sync locally"),
}


def take_settings(cls, kwargs: dict) -> None:
    """Takes torchmetrics' ``Metric`` keyword arguments out of ``kwargs``; a
    value whose behaviour differs here raises ``ValueError`` naming what to use."""
    for name in TORCHMETRICS_SETTINGS.keys() & kwargs.keys():
        rule, value = TORCHMETRICS_SETTINGS[name], kwargs.pop(name)
        if rule is not None and value is not rule[0] and value != rule[0]:
            raise ValueError(f"{cls.__name__}: argument {name!r}={value!r} (torchmetrics) is not supported: {rule[1]}")
