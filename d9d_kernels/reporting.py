"""How values and bad-input errors reach the host.

``compute_to_host`` packs every value into one tensor and starts ONE
non-blocking device->host copy (``copy_to_host``); ``HostValues.result()``
waits for it. On a GPU ``compute()`` never reads on the host: a metric
whose raising bad-input count is non-zero computes NaN (``poisoned``) and
the error is raised where the host reads values (``host_checks``). The
``bad`` slots' causes and the fixes the error names are here too.
"""

from __future__ import annotations

import math

import torch

__all__ = ["copy_to_host", "HostValues", "host_checks", "poisoned", "BAD_CAUSES", "raising_count", "bad_causes_hint"]


def copy_to_host(packed: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """Starts ONE device->host copy of ``packed`` without blocking: a pinned
    buffer and the event that marks the copy's end (CPU: the tensor, None)."""
    if not packed.is_cuda:
        return packed.to("cpu"), None
    host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


class HostValues:
    """Results packed into one tensor copied device->host without blocking.

    ``result()`` waits for the copy and returns ``{name: float}`` (a nested
    list for non-scalar results), or a single value for a standalone metric;
    it raises the ``ValueError`` that ``compute()`` would have raised for
    bad-input counts.
    """

    def __init__(self, host, names, shapes, checks, event, single):
        self._host, self._names, self._shapes = host, names, shapes
        self._checks, self._event, self._single = checks, event, single

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def result(self):
        if self._event is not None:
            self._event.synchronize()
        flat = self._host.tolist()
        pos = 0
        out: dict = {}
        for (name, key), shape in zip(self._names, self._shapes):
            n = math.prod(shape)
            vals = flat[pos : pos + n]
            pos += n
            v = vals[0] if len(shape) == 0 else torch.tensor(vals, dtype=torch.float64).reshape(shape).tolist()
            if key is None:
                out[name] = v
            else:  # a metric whose value is a dict of tensors
                out.setdefault(name, {})[key] = v
        for metric, causes in self._checks:
            count = flat[pos]
            metric._raise_if_bad(count, dict(zip(causes, flat[pos + 1 : pos + 1 + len(causes)])))
            pos += 1 + len(causes)
        return out[None] if self._single else out


def host_checks(device: torch.device) -> bool:
    """Whether ``compute()`` reads the bad-input counts on the host and
    raises. On CPU state yes: the read waits for nothing. On a GPU never:
    ``compute()`` makes no host sync (d9d's collector runs sync and compute
    on a side stream so the host never waits); there a metric whose raising
    count is non-zero computes NaN (``poisoned``), and the error with its
    count is raised where the host reads values through the library:
    ``compute_to_host().result()``, or ``bad_input_counts()``."""
    return device.type == "cpu"


def poisoned(value, count: torch.Tensor):
    """``value`` where ``count`` is zero, else NaN: on the device, no host read."""
    if isinstance(value, dict):
        return {k: poisoned(v, count) for k, v in value.items()}
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return value
    return torch.where(count == 0, value, torch.full_like(value, float("nan")))


#: the causes counted by a two-count ``bad`` slot, in its order
BAD_CAUSES = ("target_out_of_range", "nonfinite_preds")


def raising_count(bad: torch.Tensor, nan_strategy: str) -> torch.Tensor:
    """The count of a ``bad`` slot that makes compute() raise: every count
    under ``"error"``; of a two-count slot (``BAD_CAUSES``) otherwise only the
    bad targets (nan_strategy applies to NaN/Inf predictions, never to labels)."""
    bad = bad.reshape(-1)
    return bad[0] if bad.numel() == 2 and nan_strategy != "error" else bad.sum()


#: fixes named by compute()'s bad-input error, per cause
_FIXES = {
    "target_out_of_range": "pass ignore_index=<value> if those targets are padding, else fix the labels "
    "(class indices must lie in [0, num_classes))",
    "nonfinite_preds": "nan_strategy='ignore' leaves NaN/Inf rows out, 'propagate' makes the value NaN",
    "nonfinite_inputs": "nan_strategy='ignore' leaves NaN/Inf elements out, 'propagate' lets them into the value",
}


def bad_causes_hint(causes: dict[str, float] | None, nan_strategy: str) -> str:
    """``"; by cause: a=1, b=0. Fix: ...; reset() clears the counts"``."""
    if not causes:
        return ". reset() clears the counts (they stay until then)"
    parts = ", ".join(f"{k}={int(v) if math.isfinite(v) else v}" for k, v in causes.items())
    fixes = [_FIXES[k] for k, v in causes.items() if v != 0 and k in _FIXES]
    if nan_strategy != "error":
        fixes = [f for f in fixes if not f.startswith("nan_strategy")]
    fix = "; ".join(fixes)
    return f"; by cause: {parts}. Fix: {fix + '; ' if fix else ''}reset() clears the counts (they stay until then)"
