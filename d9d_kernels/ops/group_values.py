"""group_values: many metrics' values from a group's packed float64 buffers in one call.

The fused compute and forward's batch values (d9d_kernels/metrics/formulas/
fused.py) write every member whose formula the op knows with ONE call: a
program row per member (``csrc/kernels/group_values.h`` lists the columns and
formula codes) says which formula to apply to which offsets of the SUM / MAX /
REPLICA buffers and where in ``out`` the value goes. An internal op, not one
of ``OPS``: compiled for CPU and CUDA; where it cannot run (no extension,
another device, inside ``torch.compile``) ``group_values_ok`` is false and
the caller evaluates the torch formulas instead.
"""

from __future__ import annotations

import torch

from d9d_kernels import _extension

# Program columns and codes, as csrc/kernels/group_values.h numbers them.
COLUMNS = ("formula", "average", "layout", "top_k_rule", "classes", "offset", "count", "nonfinite", "out")
MEAN, SUM, MAX, MIN, ACCURACY, PRECISION, RECALL, FBETA, SPECIFICITY, JACCARD, CONFMAT = range(11)
AVERAGES = {"micro": 0, "macro": 1, "weighted": 2, "none": 3}
CLASS_ROWS, LABEL_ROWS = 0, 1

_DEVICES = {key.lower(): _extension.CPP_ERROR is None and _extension._has_kernel("group_values", key)
            for key in ("CPU", "CUDA")}


# csrc/cpu/group_compute.cpp
_SCALAR_VIEWS = _extension.host_function("scalar_views")
_GROUP_COMPUTE = _extension.host_function("group_compute")


def scalars(out: torch.Tensor) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
    """``out.unbind(0)`` for the 1-D float64 ``out`` that ``group_values`` just
    wrote (eager, no grad): one fresh 0-d tensor per value, on ``out``'s
    storage, made in C++ without the dispatcher: a group's compute returns one
    per member, and unbind dispatches a select per value."""
    return _SCALAR_VIEWS(out) if _SCALAR_VIEWS is not None else out.unbind(0)


def host_compute_ok(device: torch.device) -> bool:
    """``host_compute`` serves buffers on ``device`` (and we are not being traced)."""
    return _GROUP_COMPUTE is not None and device.type == "cpu" and not torch.compiler.is_compiling()


def host_compute(sum_buf: torch.Tensor, max_buf: torch.Tensor, replica: torch.Tensor, program: torch.Tensor,
                 beta2: torch.Tensor, out_size: int, n_scalar: int, shapes: list[list[int]], bad_index: torch.Tensor,
                 bad_matrix: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, list[float]]:
    """CPU buffers, one C++ call: ``group_values`` into a new ``out`` of
    ``out_size``, then ``(values, out, counts)``: ``values`` are
    ``scalars(out[:n_scalar])`` followed by one tensor of each shape in
    ``shapes`` (the vector members, packed after the scalars), and
    ``counts[r] = sum_j bad_matrix[r, j] * sum_buf[bad_index[j]]`` (the bad-input
    counts that make members raise). compute() runs right after a sync, from
    cold caches, where the number of distinct ops it touches decides its cost."""
    return _GROUP_COMPUTE(sum_buf, max_buf, replica, program, beta2, out_size, n_scalar, shapes, bad_index,
                          bad_matrix)


def group_values_ok(device: torch.device) -> bool:
    """The compiled op runs on ``device`` (and we are not being traced)."""
    return _DEVICES.get(device.type, False) and not torch.compiler.is_compiling()


def group_values(sum_buf: torch.Tensor, max_buf: torch.Tensor, replica: torch.Tensor,
                 program: torch.Tensor, beta2: torch.Tensor, out: torch.Tensor) -> None:
    """Writes each program row's value(s) into ``out`` (float64, same device):
    ``program`` int64 ``[K, len(COLUMNS)]``, ``beta2`` float64 ``[K]`` (FBeta's
    beta squared, else ignored); an empty tensor stands for an absent buffer."""
    torch.ops.d9d_kernels.group_values(sum_buf, max_buf, replica, program, beta2, out)
