"""Will a metric's state fit? Checked before anything is allocated.

A storage holds ``STATE_COPIES`` float64 copies of its state; ``check_fits``
compares them with the free memory of the device (CPU: ``MemAvailable``;
CUDA: ``mem_get_info``; else a cap) and raises ``ValueError`` naming the
size and the largest slot, so ``ConfusionMatrix(num_classes=200_000)``
fails with a clear message instead of an allocator error.
"""

from __future__ import annotations

import torch

__all__ = ["format_bytes", "available_bytes", "check_fits", "STATE_COPIES", "STATE_CAP_BYTES"]


def format_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}" if n < 100 * scale else f"{n / scale:.0f} {unit}"
    return f"{int(n)} B"


#: buffers a storage holds per state copy: local, reset values, two sync snapshots
STATE_COPIES = 4
#: ceiling on one metric's state when the free memory cannot be read
STATE_CAP_BYTES = 64 * 2**30


def available_bytes(device: torch.device) -> int | None:
    """Free memory on ``device`` (CPU: MemAvailable; CUDA: mem_get_info), or None."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError):
        return None
    return None


def check_fits(layout: "Layout", device: torch.device, label: str) -> None:
    """Raises ``ValueError`` naming the state size before anything is
    allocated when the buffers could not fit in memory."""
    one = layout.state_bytes()
    need = STATE_COPIES * one
    avail = available_bytes(device)
    limit = STATE_CAP_BYTES * STATE_COPIES if avail is None else avail
    if need <= limit:
        return
    where = f"{format_bytes(avail)} available on {device}" if avail is not None else \
        f"the {format_bytes(limit)} cap (free memory of {device} unknown)"
    raise ValueError(
        f"{label}: needs {format_bytes(one)} of float64 state (largest slot: {layout.largest_slot()}), "
        f"{format_bytes(need)} with its {STATE_COPIES} buffers (local, reset values, 2 sync snapshots); "
        f"that exceeds {where}. Reduce num_classes / num_bins, or use a metric with O(C) state "
        "(e.g. F1Score instead of ConfusionMatrix)"
    )
