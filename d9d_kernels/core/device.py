"""Naming a device the way its tensors do."""

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
