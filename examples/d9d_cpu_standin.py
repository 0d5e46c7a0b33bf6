"""A CPU stand-in for the CUDA calls d9d 0.24's training loop makes, for tests and examples only.

``install()`` patches, in the calling process, exactly the calls that stop
d9d's real ``TrainingConfigurator(...).configure().train()`` on a machine
without a GPU (``examples/d9d_moe_task.py`` on CPU, ``tests/d9d/test_d9d_trainer.py``,
``tests/test_example_moe.py``); everything else (meshes, collectives over gloo, pipeline
schedule, gradient sync, metric collector, tracker, checkpointer) is d9d's
own code. Each patch names the d9d call it stands in for and why.
CPU work runs in program order, so streams and events have nothing to order:
they are no-ops here.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["install"]


class _Stream:
    """``torch.cuda.Stream``: CPU work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or _Event()

    def synchronize(self) -> None:
        pass


class _Event:
    """``torch.cuda.Event``: a CPU copy is complete when the call returns."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


def _to_cpu(cls) -> None:
    """``cls.to("cuda")`` moves to the CPU instead."""
    to = cls.to

    def cpu_to(self, device):
        return to(self, "cpu" if torch.device(device).type == "cuda" else device)

    cls.to = cpu_to


def install() -> None:
    """Patches the CUDA calls of d9d's train loop (idempotent, this process only)."""
    # the mark is on torch.cuda, not in this module: an example imports it as ``d9d_cpu_standin``,
    # a test may import it as ``examples.d9d_cpu_standin``, and a second patch would wrap the first
    if getattr(torch.cuda, "_d9d_cpu_standin", False):
        return
    setattr(torch.cuda, "_d9d_cpu_standin", True)
    from d9d.core.dist_context import configured, device_mesh_domains
    from d9d.internals.grad_norm import norm
    from d9d.metric.impl.aggregation import WeightedMeanMetric
    from d9d.metric.impl.container import ComposeMetric
    from d9d.pipelining.infra.stage import communications
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda  # setattr: the patches replace typed attributes (mypy checks examples/)
    # DistributedContext.__init__ divides the world size and the rank by the GPU count (configured.py:55, :73)
    setattr(cuda, "device_count", lambda: 1)
    # DistributedContext.__init__ selects the rank's GPU, the barrier of wait_world() names it
    # (configured.py:78, :129)
    setattr(cuda, "set_device", lambda device: None)
    setattr(cuda, "current_device", lambda: 0)
    # wait_world(), the checkpointer and the model offload wait for / free the GPU (configured.py:130, checkpointer.py:63)
    setattr(cuda, "synchronize", lambda device=None: None)
    setattr(cuda, "empty_cache", lambda: None)
    # side streams and events: metric collector, gradient buckets, pack prefetch, tracker writes
    setattr(cuda, "Stream", _Stream)
    setattr(cuda, "Event", _Event)
    setattr(cuda, "current_stream", lambda device=None: _Stream())
    setattr(cuda, "stream", lambda stream=None: contextlib.nullcontext())
    # every domain's mesh is built with device_type="cuda" (device_mesh_domains.py:49 ...)
    device_mesh_domains.init_device_mesh = lambda device_type, **kw: init_device_mesh("cpu", **kw)
    # Not a CUDA call, a d9d 0.24 bug that GPUs hit too: the expert mesh leaves tp out of its size
    # (device_mesh_domains.py:84), so with tp > 1 some ranks are outside it and set_timeout() fails there
    # with an IndexError. tp is folded into ep_replicate, the size DeviceMeshParameters validates.
    expert = device_mesh_domains.ExpertDomain.build_mesh
    setattr(device_mesh_domains.ExpertDomain, "build_mesh", lambda self, p: expert(self, p.model_copy(
        update={"data_parallel_replicate": p.data_parallel_replicate * p.tensor_parallel})))
    # the context's device is torch.device("cuda") (configured.py:76): model stages, packs and metrics go there
    setattr(configured.DistributedContext, "current_device", property(lambda self: torch.device("cpu")))
    # the metric collector's bind() and the gradient manager move their metrics with .to("cuda")
    # (metric_collector/collector.py:28, gradient_manager.py:39)
    _to_cpu(ComposeMetric)
    _to_cpu(WeightedMeanMetric)
    # pipeline receive buffers and an empty gradient norm are allocated with device="cuda"
    # (pipelining/infra/stage/communications.py:73, internals/grad_norm/norm.py:35, :49)
    recv = communications.__dict__
    for mod in (recv, norm.__dict__):
        mod["torch"] = _CpuTorch()


class _CpuTorch:
    """The ``torch`` module, with factory functions' ``device="cuda"`` read as the CPU."""

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in ("empty", "tensor", "zeros", "ones", "full"):
            def make(*args, _f=attr, **kw):
                if kw.get("device") is not None and torch.device(kw["device"]).type == "cuda":
                    kw["device"] = "cpu"
                return _f(*args, **kw)
            return make
        return attr
