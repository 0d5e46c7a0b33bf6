"""Device helpers of the metric core: naming a device the way its tensors do,
and putting small constant tables on it without a host sync."""

from __future__ import annotations

import torch


def resolve_device(device) -> torch.device:
    """``torch.device(device)`` with its index: ``"cuda"`` names the current CUDA
    device, which is what tensors made there report (``cuda:0``), so a metric
    built with ``device="cuda"`` accepts them."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def constant(values, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without blocking the
    host: a copy from pageable memory to a GPU waits for the stream, so on CUDA
    the values go through pinned memory and a non-blocking copy (the pinned
    block is kept until the copy has run by torch's host allocator)."""
    t = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
