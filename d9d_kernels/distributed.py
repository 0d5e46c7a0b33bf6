"""DistributedContext: which ranks a metric reduces over, and how.

A context names a set of ranks (a ``torch.distributed`` process group, a
sub-mesh of a ``DeviceMesh``, or none at all) and offers the things the
metric layer needs from it:

* ``all_reduce(tensor, op)`` -- ONE asynchronous in-place collective ("sum" or
  "max") returning a handle whose ``wait()`` raises ``RuntimeError`` instead of
  hanging when the collective does not finish within ``ctx.timeout``;
* ``handshake(fingerprint, what, payload=...)`` -- ONE fixed-shape SUM
  all-reduce that checks a fingerprint is equal on every rank (and carries a
  small payload, e.g. rank 0's moment pivots); only on a mismatch are details
  gathered, for a ``ValueError`` raised on every rank. No store operation, so
  it costs O(log W) collective latency and O(1) work per rank at any W;
* ``all_gather_into_tensor(output, input)`` -- one async gather (equal sizes),
  used by ``d9d_kernels.functional.all_gather``;
* ``exchange(tag, value)`` / ``check_same(tag, fingerprint, what)`` -- a
  host-side exchange through the c10d store. Every rank reads W keys, so it
  is a small-world helper (O(W) store reads per rank, O(W^2) for the store);
  the metric sync does not use it.

``as_context(ctx)`` turns whatever a user passes as ``ctx`` (None, a
DistributedContext, a ProcessGroup, a DeviceMesh, a d9d DistributedContext)
into a DistributedContext; the metric sync and ``dk.functional`` both use it.

Example:
    >>> import torch, d9d_kernels as dk
    >>> ctx = dk.DistributedContext.local()
    >>> t = torch.tensor([1.0, 2.0])
    >>> ctx.all_reduce(t, "sum").wait()   # local: completed no-op handle
    >>> t.tolist(), ctx.is_local, ctx.world_size, ctx.rank
    ([1.0, 2.0], True, 1, 0)

Notes for the metric layer (design decisions):

* ``DistributedContext()`` resolves the world group lazily, at each use: a
  context built before ``init_process_group`` becomes the world group once it
  is initialised. ``is_local`` is True for ``local()``, an uninitialised
  ``torch.distributed``, or a group of size 1 -- skip packing/launching then.
* ``all_reduce`` is called outside compiled regions (``trigger_sync`` launches
  it after the compiled snapshot), and must be called in the same order on
  every rank of the group, like any collective. A min is reduced as the max of
  its negation, so ops are only "sum" and "max".
* Device routing (``_route()``): a CPU tensor under a group without a CPU
  backend (NCCL-only) is staged through the current CUDA device (pinned host
  buffer, non-blocking copies and the collective on a side stream, an event
  that ``wait()`` polls: no host sync at launch). Only where no CUDA device
  exists does it fall back to a private gloo backend over the same ranks
  (a full mesh of W - 1 connections per rank, set up through the store: a
  small-world route), created on first use and cached per group; it is not a
  c10d-registered group, so c10d's group naming stays consistent. CUDA
  tensors under a CPU-only backend are staged through host memory (copied
  back in ``wait()``).
* ``exchange`` keys are ``d9d_kernels/exchange/<group name>/<seq>/<global
  rank>`` in the default store (the value carries the tag); every rank of a
  group must call ``exchange`` in the same order (like a collective); ranks
  that reach different tags at the same ``seq`` all raise ``RuntimeError``
  naming them; a rank that never arrives makes the others raise naming the
  missing ranks after ``timeout``. ``check_same`` raises ``ValueError`` on
  every rank naming the ranks of each variant and the first difference.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import json
import math
import sys
import time
import weakref
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
import torch.distributed as dist

__all__ = ["DistributedContext", "CollectiveHandle", "as_context"]

DEFAULT_TIMEOUT = datetime.timedelta(seconds=60)
DEFAULT_MESH_DIMS = ("dp_replicate", "dp_shard")
# d9d: the regular-domain dims whose ranks hold different data; tp and
# cp_replicate ranks hold replicas (docs/distributed.md, "d9d")
D9D_DOMAIN = "regular"
D9D_DIMS = ("pp", "dp_replicate", "dp_shard", "cp_shard")
_OPS = ("sum", "max")
_STORE_PREFIX = "d9d_kernels/exchange/"



class _GroupState:
    """Per-process state kept for one process group (keyed by its group name)."""

    def __init__(self, group):
        self.group = group  # identity check: a re-initialised world reuses names
        self.exchange_seq = itertools.count()  # exchanges on this group so far
        self.exchange_last_key: Union[str, None] = None  # this rank's key of the previous exchange
        self.gloo = None  # private gloo backend over the same ranks (device routing)
        self.routes: dict[str, str] = {}  # device type -> _route(...) (the backend config is fixed)
        self.ctx: Optional["DistributedContext"] = None  # as_context(group), built once
        self.stream = None  # side CUDA stream of the "cuda_stage" route


_group_states: dict[str, _GroupState] = {}


def _state(group) -> _GroupState:
    st = _group_states.get(group.group_name)
    if st is None or st.group is not group:
        st = _group_states[group.group_name] = _GroupState(group)
    return st

# sorted rank tuple -> group built by from_mesh's fallback path
_mesh_groups: dict[tuple[int, ...], "dist.ProcessGroup"] = {}


def _as_timedelta(timeout) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        out = timeout
    elif isinstance(timeout, (int, float)):
        out = datetime.timedelta(seconds=float(timeout))
    else:
        raise TypeError(
            f"DistributedContext: timeout must be a datetime.timedelta or seconds, got {type(timeout).__name__}"
        )
    if out.total_seconds() <= 0:
        raise ValueError(f"DistributedContext: timeout must be positive, got {out}")
    return out


def _backend_config(group) -> str:
    """The group's device->backend map as c10d prints it, e.g. "cpu:gloo,cuda:nccl"."""
    try:
        return str(dist.get_backend_config(group))
    except Exception:  # older torch / custom groups: a bare backend name
        return str(dist.get_backend(group))


def _parse_backend_config(config: str) -> dict[str, str]:
    """"cpu:gloo,cuda:nccl" -> {"cpu": "gloo", "cuda": "nccl"}; "nccl" -> by capability."""
    out: dict[str, str] = {}
    config = config.strip().lower()
    if ":" not in config:
        for device in dist.Backend.backend_capability.get(config, ()):
            out[device] = config
        return out
    for item in config.split(","):
        device, _, backend = item.partition(":")
        out[device.strip()] = backend.strip()
    return out


def _route(config: str, device_type: str, cuda: Optional[bool] = None) -> str:
    """How a tensor on ``device_type`` goes through a group with backend ``config``.

    Returns "direct" (the group's backend handles the device), "cuda_stage"
    (a CPU tensor under a group whose only backend is a CUDA one, e.g.
    NCCL-only, on a machine with a CUDA device: reduce a device copy on the
    group), "gloo" (the same without a CUDA device: a private gloo backend
    over the same ranks, the small-world route), "stage" (a device tensor
    under a group without that device's backend: copy to CPU, reduce on the
    group's CPU backend, copy back) or "gloo_stage" (neither: copy to CPU,
    private gloo). ``cuda``: whether a CUDA device exists (None: ask torch).
    """
    backends = _parse_backend_config(config)
    if device_type in backends:
        return "direct"
    if device_type == "cpu":
        if cuda is None:
            cuda = torch.cuda.is_available()
        return "cuda_stage" if cuda and "cuda" in backends else "gloo"
    return "stage" if "cpu" in backends else "gloo_stage"


class _EventWork:
    """Work-like handle of a collective staged on a CUDA side stream: done when
    the event recorded after the copy back has completed. ``wait`` polls it
    (a CUDA event has no timed wait), so a collective that never finishes
    gives the caller's timeout error instead of a hang."""

    def __init__(self, event, keep):
        self._event = event
        self._keep = keep  # device and pinned buffers in flight

    def is_completed(self) -> bool:
        return bool(self._event.query())

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        pause = 1e-5
        while not self._event.query():
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        self._keep = None
        return True


#: test hook: keyword arguments for _cuda_staged (a stand-in for torch.cuda on CPU)
_STAGING: dict = {}


def _cuda_staged(group, st: "_GroupState", launch, out_host: torch.Tensor, in_host: Optional[torch.Tensor] = None,
                 *, cuda=None, device=None, pin: bool = True):
    """Runs ``launch(device_out, device_in, group)`` (an async c10d collective
    returning its work) on device copies of host tensors.

    ``out_host`` (and ``in_host``, for gathers) are copied into pinned host
    buffers (a host memcpy), then on a side stream of the current CUDA device:
    non-blocking H2D copies, the collective, ``work.wait()`` (a stream wait
    for NCCL, not a host block), the D2H copy back into the pinned buffer and
    an event. Nothing here waits for the device. Returns ``(work, pinned
    result)``: the result is valid once ``work.wait()`` returned True.
    ``cuda``, ``device``, ``pin``: torch.cuda, its current device, pinned
    buffers (tests pass a CPU stand-in).
    """
    cuda = torch.cuda if cuda is None else cuda
    dev = torch.device("cuda", cuda.current_device()) if device is None else torch.device(device)
    if st.stream is None:  # the current device is fixed per rank
        st.stream = cuda.Stream(dev)
    stream = st.stream
    pinned_out = torch.empty(out_host.shape, dtype=out_host.dtype, pin_memory=pin)
    if in_host is None:  # an all_reduce reads its buffer; a gather only writes it
        pinned_out.copy_(out_host)
    pinned_in = None
    if in_host is not None:
        pinned_in = torch.empty(in_host.shape, dtype=in_host.dtype, pin_memory=pin)
        pinned_in.copy_(in_host)
    with cuda.stream(stream):
        d_out = torch.empty(out_host.shape, dtype=out_host.dtype, device=dev)
        if in_host is None:
            d_out.copy_(pinned_out, non_blocking=True)
            d_in = None
        else:
            d_in = torch.empty(in_host.shape, dtype=in_host.dtype, device=dev)
            d_in.copy_(pinned_in, non_blocking=True)
        work = launch(d_out, d_in, group)
        work.wait()  # NCCL: the side stream waits for the collective; the host does not
        pinned_out.copy_(d_out, non_blocking=True)
        event = cuda.Event()
        event.record(stream)
    return _EventWork(event, (d_out, d_in, pinned_in)), pinned_out


class CollectiveHandle:
    """Handle of an asynchronous collective launched by a DistributedContext.

    ``wait()`` blocks until the collective has finished (at most the context's
    timeout) and raises ``RuntimeError`` naming the operation and the timeout
    otherwise. Waiting twice is a no-op.
    """

    def __init__(self, work=None, *, what=None, timeout: datetime.timedelta = DEFAULT_TIMEOUT, finish=None):
        self._work = work
        self._what = what
        self._timeout = timeout
        self._finish = finish
        self._done = work is None and finish is None

    def is_completed(self) -> bool:
        """True when ``wait()`` would not block."""
        return self._done or self._work is None or bool(self._work.is_completed())

    @property
    def what(self) -> str:
        """The operation, for messages (``what`` may be given as a callable: built only when needed)."""
        return self._what() if callable(self._what) else (self._what or "collective")

    def wait(self) -> None:
        if self._done:
            return
        if self._work is not None:
            secs = self._timeout.total_seconds()
            try:
                ok = self._work.wait(timeout=self._timeout)
            except Exception as e:  # gloo raises "Operation timed out!", NCCL a DistBackendError
                raise RuntimeError(
                    f"d9d_kernels: {self.what} did not complete within the timeout of {secs:g} s "
                    f"(a rank did not join, or ranks issued different collectives): {type(e).__name__}: {e}"
                ) from e
            if ok is False:
                raise RuntimeError(f"d9d_kernels: {self.what} did not complete within the timeout of {secs:g} s")
        if self._finish is not None:
            self._finish()
        self._done = True


_COMPLETED = CollectiveHandle()


class DistributedContext:
    """The set of ranks a metric reduces over.

    Args:
        group: a ``torch.distributed`` ProcessGroup. ``None`` means the default
            (world) group when ``torch.distributed`` is initialised -- resolved
            at each use, so a context built before ``init_process_group`` works
            -- and no communication otherwise.
        timeout: how long ``wait()`` and ``exchange()`` wait for the other
            ranks before raising (``datetime.timedelta`` or seconds; default 60 s).

    Build one with ``DistributedContext()``, ``DistributedContext(group=pg)``,
    ``DistributedContext.from_mesh(mesh, dims=(...))`` or
    ``DistributedContext.local()``.

    Example:
        >>> import d9d_kernels as dk
        >>> dk.DistributedContext.local().is_local
        True
    """

    def __init__(self, group=None, *, timeout=None):
        if group is not None and group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("DistributedContext: this rank is not a member of the given process group")
        self._group = group
        self._local = False
        self._timeout = _as_timedelta(timeout)
        self._duplicate: bool | None = None

    # ------------------------------------------------------------ builders
    @classmethod
    def local(cls) -> "DistributedContext":
        """A context that never communicates (every rank reduces only its own data)."""
        ctx = cls()
        ctx._local = True
        return ctx

    @classmethod
    def from_mesh(
        cls, mesh, dims: Union[str, Sequence[str]] = DEFAULT_MESH_DIMS, *, timeout=None
    ) -> "DistributedContext":
        """Reduce over the sub-mesh of the named ``dims`` of a DeviceMesh only.

        Ranks that differ only along other dims (e.g. "tp", "pp", "cp") are
        treated as holding replicas and are not reduced over. Several dims are
        flattened into one group (in the mesh's dim order). With the default
        ``dims=("dp_replicate", "dp_shard")`` dims missing from the mesh are
        skipped (torchtitan-style meshes omit size-1 dims); explicitly named
        dims must exist. Every rank of the mesh must call this (it may create
        process groups). A d9d ``DistributedContext`` in place of ``mesh`` is
        ``from_d9d(mesh, dims=dims)`` (d9d's default dims unless ``dims`` is given).
        """
        if _is_d9d_context(mesh):
            return cls.from_d9d(mesh, dims=D9D_DIMS if dims is DEFAULT_MESH_DIMS else dims, timeout=timeout)
        names = tuple(mesh.mesh_dim_names or ())
        if not names:
            raise ValueError("DistributedContext.from_mesh: the mesh has no mesh_dim_names; name its dims")
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if not dims:
            raise ValueError(
                "DistributedContext.from_mesh: dims is empty; use DistributedContext.local() for no reduction"
            )
        missing = [d for d in dims if d not in names]
        if missing:
            if dims == DEFAULT_MESH_DIMS and len(missing) < len(dims):
                dims = tuple(d for d in dims if d in names)
            else:
                raise ValueError(f"DistributedContext.from_mesh: dims {missing} not in the mesh dims {list(names)}")
        dims = tuple(sorted(set(dims), key=names.index))
        if len(dims) == 1:
            group = mesh.get_group(dims[0])
        else:
            group = _flattened_group(mesh, dims)
        ctx = cls(group=group, timeout=timeout)
        ctx._duplicate = _duplicate(mesh, dims)
        return ctx

    @classmethod
    def from_d9d(
        cls, d9d_ctx, dims: Union[str, Sequence[str]] = D9D_DIMS, *, domain: str = D9D_DOMAIN, timeout=None
    ) -> "DistributedContext":
        """Reduce over the ranks of a d9d ``DistributedContext`` that hold different data.

        A context that is not distributed (``mesh_params.is_distributed``
        False) is local. Otherwise: the sub-mesh of ``dims`` of
        ``d9d_ctx.mesh_for(domain)``; by default the regular-domain dims
        ``pp``, ``dp_replicate``, ``dp_shard``, ``cp_shard`` -- not ``tp`` or
        ``cp_replicate``, whose ranks hold replicas. Reducing over ``pp`` gives
        every stage the global value when only the last stage updates (the
        other stages contribute empty states). Size-1 dims are dropped; if no
        dim is left the context is local, and if the dims span the world it is
        the world group (no new group). Every rank must call this (it may
        create process groups); ``as_context`` caches the default per
        ``d9d_ctx``.
        """
        if not _is_d9d_context(d9d_ctx):
            raise TypeError(
                "DistributedContext.from_d9d: d9d_ctx must be a d9d DistributedContext (mesh_params, mesh_for), "
                f"got {type(d9d_ctx).__name__}"
            )
        if not d9d_ctx.mesh_params.is_distributed:
            return cls.local()
        mesh = d9d_ctx.mesh_for(domain)
        sizes = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
        dims = (dims,) if isinstance(dims, str) else tuple(dims)
        if not dims:
            raise ValueError(
                "DistributedContext.from_d9d: dims is empty; use DistributedContext.local() for no reduction"
            )
        missing = [d for d in dims if d not in sizes]
        if missing:
            raise ValueError(
                f"DistributedContext.from_d9d: dims {missing} not in the {domain!r} mesh dims {list(sizes)}"
            )
        kept = tuple(d for d in sizes if d in dims and sizes[d] > 1)
        if not kept:
            ctx = cls.local()
            ctx._duplicate = _duplicate(mesh, kept)
            return ctx
        if math.prod(sizes[d] for d in kept) == dist.get_world_size():
            ctx = cls(group=dist.group.WORLD, timeout=timeout)
            ctx._duplicate = False  # every dim is reduced over: no copies
            return ctx
        return cls.from_mesh(mesh, dims=kept, timeout=timeout)

    # ------------------------------------------------------------ properties
    @property
    def group(self):
        """The ProcessGroup reduced over, or None for a local context."""
        if self._local:
            return None
        if self._group is not None:
            return self._group
        if dist.is_available() and dist.is_initialized():
            return dist.group.WORLD
        return None

    @property
    def is_local(self) -> bool:
        """True when no communication is needed (local(), no torch.distributed, or a group of one)."""
        g = self.group
        return g is None or dist.get_world_size(g) == 1

    @property
    def world_size(self) -> int:
        g = self.group
        return 1 if g is None else dist.get_world_size(g)

    @property
    def rank(self) -> int:
        """This rank's index within the group (0 for a local context)."""
        g = self.group
        return 0 if g is None else dist.get_rank(g)

    @property
    def ranks(self) -> list[int]:
        """Global ranks of the group, in group-rank order ([0] style for local: [own global rank])."""
        g = self.group
        if g is None:
            return [dist.get_rank() if dist.is_available() and dist.is_initialized() else 0]
        return list(dist.get_process_group_ranks(g))

    @property
    def duplicate(self) -> bool | None:
        """True when this rank's data is a copy of another rank's that a
        checkpoint resumed on another world size must not count again: the
        context came from a mesh (``from_mesh``, ``from_d9d``) and this rank
        is not the last along some dim not reduced over (tp, cp_replicate;
        for pp, the last stage is the one that updates). None when the
        context does not know the job's replicas (a plain group, the world,
        ``local()``): a sync over it leaves what an earlier one recorded."""
        return self._duplicate

    @property
    def timeout(self) -> datetime.timedelta:
        return self._timeout

    @property
    def cache_key(self) -> tuple:
        """Hashable identity of the ranks reduced over (equal for contexts over the same group)."""
        g = self.group
        if g is None or self.is_local:
            return ("local",)
        return ("group", g.group_name)

    def __repr__(self) -> str:
        if self.is_local:
            return "DistributedContext(local)"
        secs = self._timeout.total_seconds()
        return f"DistributedContext(group={self.group.group_name!r}, ranks={self.ranks}, timeout={secs:g}s)"

    # ------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: str) -> CollectiveHandle:
        """Launch ONE asynchronous in-place all-reduce of ``tensor`` ("sum" or "max").

        Returns a handle; after ``handle.wait()`` the tensor holds the reduced
        value. Local contexts return a completed handle and leave the tensor.
        """
        if op not in _OPS:
            raise ValueError(f"DistributedContext.all_reduce: op must be one of {_OPS}, got {op!r}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"DistributedContext.all_reduce: expected a tensor, got {type(tensor).__name__}")
        if self.is_local:
            return _COMPLETED
        # built only for an error message: get_process_group_ranks + formatting
        # cost ~20 us, a tenth of a gloo all_reduce (bench_sync)
        what = lambda: f"all_reduce({op}) of {tuple(tensor.shape)} {tensor.dtype} over ranks {self.ranks}"  # noqa: E731
        return self._all_reduce(tensor, op, what)

    def _all_reduce(self, tensor: torch.Tensor, op: str, what) -> CollectiveHandle:
        """``all_reduce`` with the operation named by ``what()`` in errors."""
        red = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX
        group, route, buf, finish = self._routed(tensor)
        if route == "cuda_stage":
            work, res = _cuda_staged(
                group, _state(group),
                lambda d, _, g: dist.all_reduce(d, op=red, group=g, async_op=True), buf, **_STAGING,
            )
            finish = lambda: tensor.copy_(res.view(tensor.shape))  # noqa: E731
        elif route in ("gloo", "gloo_stage"):  # private gloo backend: not registered with c10d
            work = group.allreduce(buf, red)
        else:
            work = dist.all_reduce(buf, op=red, group=group, async_op=True)
        return CollectiveHandle(work, what=what, timeout=self._timeout, finish=finish)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor) -> CollectiveHandle:
        """Launch ONE asynchronous gather: ``output`` (``world_size * input.numel()``
        elements, same dtype/device) receives every rank's ``input`` in rank order."""
        if output.numel() != self.world_size * input.numel():
            raise ValueError(
                f"DistributedContext.all_gather_into_tensor: output has {output.numel()} elements, "
                f"expected world_size * input.numel() = {self.world_size * input.numel()}"
            )
        if self.is_local:
            output.view(-1).copy_(input.reshape(-1))
            return _COMPLETED
        what = lambda: f"all_gather of {input.numel()} x {input.dtype} over ranks {self.ranks}"  # noqa: E731
        group, route, out_buf, finish = self._routed(output)
        in_buf = input if input.device == out_buf.device else input.to(out_buf.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        if route == "cuda_stage":
            work, res = _cuda_staged(
                group, _state(group),
                lambda d, i, g: gather(d.view(-1), i.reshape(-1), group=g, async_op=True),
                out_buf, in_buf.contiguous(), **_STAGING,
            )
            finish = lambda: output.copy_(res.view(output.shape))  # noqa: E731
        elif route in ("gloo", "gloo_stage"):
            work = group._allgather_base(out_buf.view(-1), in_buf.reshape(-1))
        else:
            work = gather(out_buf.view(-1), in_buf.reshape(-1), group=group, async_op=True)
        return CollectiveHandle(work, what=what, timeout=self._timeout, finish=finish)

    def _routed(self, tensor: torch.Tensor):
        """(group or private gloo backend, route, buffer to communicate, finish callback).

        The buffer is ``tensor`` itself when it is contiguous and the group's
        backend handles its device; otherwise a contiguous (host) copy that
        ``finish`` copies back after the wait. The "cuda_stage" route's caller
        replaces ``finish`` by the copy from its pinned result.
        """
        group = self.group
        routes = _state(group).routes
        dev = tensor.device.type
        route = routes.get(dev)
        if route is None:
            route = routes[dev] = _route(_backend_config(group), dev)
        buf = tensor
        if route in ("stage", "gloo_stage"):  # device tensor through host memory (the copy syncs the stream)
            buf = tensor.detach().to("cpu")
        if not buf.is_contiguous():
            buf = buf.contiguous()
        finish = None if buf is tensor else (lambda: tensor.copy_(buf))
        if route in ("gloo", "gloo_stage"):
            return self._gloo_backend(), route, buf, finish
        return group, route, buf, finish

    def _gloo_backend(self):
        """A gloo backend over the group's ranks, created on first use and cached.

        Built directly (``ProcessGroupGloo`` on a store prefix named after the
        group), NOT with ``dist.new_group``: creating a c10d group on a subset
        of ranks would advance c10d's group counter on those ranks only and
        make later ``new_group`` calls disagree on group names across ranks.
        Creation is a rendezvous of the group's members only.
        """
        group = self.group
        st = _state(group)
        if st.gloo is None:
            default_store = dist.distributed_c10d._get_default_store()
            store = dist.PrefixStore(f"d9d_kernels/gloo/{group.group_name}/", default_store)
            st.gloo = dist.ProcessGroupGloo(store, dist.get_rank(group), dist.get_world_size(group), self._timeout)
        return st.gloo

    # ------------------------------------------------------------ host-side exchange
    def exchange(self, tag: str, value: Union[bytes, str]) -> list:
        """Exchange a small value with every rank of the group, without a collective.

        Returns the values of all ranks in group-rank order, as ``str`` if
        ``value`` is a ``str`` else as ``bytes``. Uses the c10d store; every
        rank of the group must call it, in the same order (like a collective).
        Raises RuntimeError naming the ranks that did not arrive within
        ``timeout``, or, on every rank, when ranks passed different tags at
        the same point (they called exchanges in different orders).
        """
        as_str = isinstance(value, str)
        if not isinstance(value, (bytes, str)):
            raise TypeError(f"DistributedContext.exchange: value must be bytes or str, got {type(value).__name__}")
        if self.is_local:
            return [value]
        group = self.group
        st = _state(group)
        seq = next(st.exchange_seq)
        store = dist.PrefixStore(f"{_STORE_PREFIX}{group.group_name}/", dist.distributed_c10d._get_default_store())
        ranks = self.ranks
        me = dist.get_rank()
        keys = [f"{seq}/{r}" for r in ranks]
        tag_b = tag.encode()
        store.set(f"{seq}/{me}", b"%d:" % len(tag_b) + tag_b + (value.encode() if as_str else bytes(value)))
        try:
            store.wait(keys, self._timeout)
        except Exception as e:
            missing = [r for r, k in zip(ranks, keys) if not _store_has(store, k)]
            raise RuntimeError(
                f"d9d_kernels: exchange {tag!r} over ranks {ranks}: ranks {missing or '?'} did not arrive within "
                f"the timeout of {self._timeout.total_seconds():g} s (did every rank reach the same sync?)"
            ) from e
        tags, values = [], []
        for raw in _store_get_all(store, keys):
            raw = bytes(raw)
            n, _, rest = raw.partition(b":")
            tags.append(rest[: int(n)].decode())
            values.append(rest[int(n) :])
        prev, st.exchange_last_key = st.exchange_last_key, f"{seq}/{me}"
        if prev is not None:  # every rank has posted `seq`, so all have read `prev`
            try:
                store.delete_key(prev)
            except Exception:
                pass
        if any(t != tag for t in tags):
            by_tag: dict[str, list[int]] = {}
            for r, t in zip(ranks, tags):
                by_tag.setdefault(t, []).append(r)
            raise RuntimeError(
                f"d9d_kernels: ranks {ranks} reached different exchanges (exchange #{seq} on this group): "
                + "; ".join(f"ranks {rs}: {t!r}" for t, rs in by_tag.items())
                + " -- every rank must sync the same metrics in the same order"
            )
        return [v.decode() for v in values] if as_str else values

    def check_same(self, tag: str, fingerprint: str, what: str) -> None:
        """Raise ValueError on every rank if ``fingerprint`` differs between ranks.

        ``what`` names the thing compared in the message (e.g. "MetricGroup schema").
        """
        values = self.exchange(tag, fingerprint)
        if all(v == values[0] for v in values):
            return
        ranks = self.ranks
        by_value: dict[str, list[int]] = {}
        for r, v in zip(ranks, values):
            by_value.setdefault(v, []).append(r)
        groups = list(by_value.items())
        a, b = groups[0][0], groups[1][0]
        i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        lo = max(0, i - 40)
        detail = "; ".join(f"ranks {rs}: {_clip(v)}" for v, rs in groups)
        raise ValueError(
            f"d9d_kernels: {what} differs across ranks ({len(groups)} variants; ranks are global ranks). "
            f"First difference at character {i}: ranks {groups[0][1]} have ...{a[lo:i + 40]!r}..., "
            f"ranks {groups[1][1]} have ...{b[lo:i + 40]!r}.... All: {detail}"
        )


    # ------------------------------------------------------------ collective handshake
    def handshake(
        self,
        fingerprint: Union[str, bytes],
        what: str,
        *,
        payload: Optional[torch.Tensor] = None,
        device=None,
        detail: Union[str, Callable[[], str], None] = None,
        explain: Optional[Callable[[list], str]] = None,
    ) -> Optional[torch.Tensor]:
        """Check that every rank passed the same ``fingerprint``, with ONE
        fixed-shape MAX all-reduce, and max ``payload`` across ranks in it.

        The buffer is ``[h_hi, h_lo, -h_hi, -h_lo | payload]`` (the two 32-bit
        words of a 64-bit hash, exact in float64): all ranks hold the same
        hash iff the max of each word equals its min, which every rank checks
        on its own. ``payload`` (float64, the same length on every rank; e.g.
        rank 0's values and ``-inf`` elsewhere) rides in the same collective;
        the reduced payload is returned (None without one). The buffer lives
        on ``device`` (default: the payload's, else CPU) and goes through the
        usual device routing.

        On a mismatch every rank raises ``ValueError``: the ranks of each
        variant come from one gather of the hashes, and each variant's
        ``detail`` (a string, or a callable building it, only called then)
        from its lowest rank, by two more collectives. The message is
        ``explain(variants)`` with ``variants`` a list of ``(global ranks,
        detail text)`` (at most 4 variants), or by default the first
        difference of the details. A rank that does not arrive makes the
        others raise ``RuntimeError`` after ``timeout``. No store operation:
        O(log W) latency, O(1) host work per rank.
        """
        words = _hash_words(fingerprint)
        if payload is not None and (payload.dtype != torch.float64 or payload.dim() != 1):
            raise ValueError("DistributedContext.handshake: payload must be a 1-d float64 tensor")
        if self.is_local:
            return None if payload is None else payload.clone()
        dev = torch.device(device) if device is not None else (payload.device if payload is not None else torch.device("cpu"))
        n_pay = 0 if payload is None else payload.numel()
        buf = torch.empty(4 + n_pay, dtype=torch.float64, device=dev)
        buf[:4].copy_(torch.tensor(words + [-w for w in words], dtype=torch.float64))
        if payload is not None:
            buf[4:].copy_(payload)
        self._all_reduce(buf, "max", lambda: f"first-sync handshake of {what} over ranks {self.ranks}").wait()
        got = buf[:4].tolist()
        if got[0] != -got[2] or got[1] != -got[3]:  # max != min: not every rank holds this hash
            self._raise_mismatch(fingerprint, what, dev, detail, explain)
        return None if payload is None else buf[4:]

    def _raise_mismatch(self, fingerprint, what, dev, detail, explain) -> None:
        """Every rank: who holds which fingerprint, each variant's detail, then ValueError."""
        n, me = self.world_size, self.rank
        mine = torch.tensor(_hash_words(fingerprint), dtype=torch.float64, device=dev)
        hashes = torch.empty(n * 2, dtype=torch.float64, device=dev)
        self.all_gather_into_tensor(hashes, mine).wait()
        by_hash: dict[tuple, list[int]] = {}
        for r, hv in enumerate(map(tuple, hashes.view(n, 2).tolist())):
            by_hash.setdefault(hv, []).append(r)
        variants = sorted(by_hash.values(), key=lambda rs: rs[0])
        shown = variants[:_MAX_VARIANTS]
        mine_at = next((i for i, rs in enumerate(shown) if rs[0] == me), None)  # this rank speaks for variant i
        text = b""
        if mine_at is not None:
            d = detail() if callable(detail) else detail
            text = (d if d is not None else _as_text(fingerprint)).encode()[:_MAX_DETAIL]
        lens = torch.zeros(len(shown), dtype=torch.float64, device=dev)
        if mine_at is not None:
            lens[mine_at] = len(text)
        self.all_reduce(lens, "max").wait()
        width = max(1, int(max(lens.tolist())))
        rows = torch.zeros(len(shown), width, dtype=torch.uint8, device=dev)
        if mine_at is not None and text:
            rows[mine_at, : len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(dev)
        self.all_reduce(rows, "sum").wait()
        texts = [bytes(rows[i, : int(L)].tolist()).decode(errors="replace") for i, L in enumerate(lens.tolist())]
        ranks = self.ranks
        listed = [([ranks[r] for r in rs], t) for rs, t in zip(shown, texts)]
        body = explain(listed) if explain is not None else _first_difference(listed)
        more = f" ({len(variants) - len(shown)} more variants not shown)" if len(variants) > len(shown) else ""
        raise ValueError(
            f"d9d_kernels: {what} differs across ranks ({len(variants)} variants{more}; ranks are global ranks): {body}"
        )


_MAX_VARIANTS = 4  # variants whose details a mismatch error gathers
_MAX_DETAIL = 1 << 16  # bytes of detail per variant
_MAX_LISTED = 8  # ranks listed per variant in messages


def _as_text(v: Union[str, bytes]) -> str:
    return v if isinstance(v, str) else bytes(v).decode(errors="replace")


def _hash_words(value: Union[str, bytes]) -> list[float]:
    """The 64-bit blake2b hash of ``value`` as two 32-bit words (exact floats)."""
    raw = value.encode() if isinstance(value, str) else bytes(value)
    h = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")
    return [float(h >> 32), float(h & 0xFFFFFFFF)]


def fmt_ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 2]``, or the first few and a count when there are many."""
    ranks = list(ranks)
    if len(ranks) <= _MAX_LISTED:
        return str(ranks)
    return "[" + ", ".join(map(str, ranks[:_MAX_LISTED])) + f", ... ({len(ranks):,} ranks)]"


def _first_difference(variants: list) -> str:
    (ra, a), (rb, b) = variants[0], variants[1]
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    lo = max(0, i - 40)
    return (
        f"ranks {fmt_ranks(ra)} have ...{a[lo:i + 40]!r}..., ranks {fmt_ranks(rb)} have ...{b[lo:i + 40]!r}..."
    )


# ------------------------------------------------------------------ ctx normalisation
_DEFAULT_CTX = DistributedContext()  # the world group, resolved at each use
# id(mesh or d9d context) -> (weak ref to it, its context): by identity, since
# equal meshes of a re-initialised world hold other (new) groups
_mesh_ctxs: dict[int, tuple] = {}


def as_context(ctx) -> DistributedContext:
    """The DistributedContext for any ``ctx`` the library takes.

    ``None``: the default world group (resolved at each use; local when
    ``torch.distributed`` is not initialised); a ``DistributedContext``:
    itself; a ``ProcessGroup``: that group (one context per group, cached);
    a ``DeviceMesh``: all of its ranks (every dim; the world group itself
    when the mesh spans the world, so no group is created); a d9d
    ``DistributedContext``: ``DistributedContext.from_d9d(ctx)``. Meshes and
    d9d contexts are resolved once per object (cached weakly). Anything else
    raises ``TypeError``.
    """
    if ctx is None:
        return _DEFAULT_CTX
    if isinstance(ctx, DistributedContext):
        return ctx
    if isinstance(ctx, dist.ProcessGroup):
        st = _state(ctx)
        if st.ctx is None:
            st.ctx = DistributedContext(group=ctx)
        return st.ctx
    hit = _mesh_ctxs.get(id(ctx))
    if hit is not None and hit[0]() is ctx:
        return hit[1]
    mesh_type = _device_mesh_type()
    if mesh_type is not None and isinstance(ctx, mesh_type):
        return _cache(ctx, _mesh_context(ctx))
    if _is_d9d_context(ctx):
        return _cache(ctx, DistributedContext.from_d9d(ctx))
    if isinstance(ctx, int) and ctx == dist.GroupMember.NON_GROUP_MEMBER:
        return DistributedContext(group=ctx)  # raises: this rank is not in the group
    raise TypeError(
        f"ctx must be a dk.DistributedContext, a torch.distributed ProcessGroup, a DeviceMesh, "
        f"a d9d DistributedContext or None, got {type(ctx).__name__}"
    )


def _cache(obj, ctx: DistributedContext) -> DistributedContext:
    """Remembers ``ctx`` for ``obj`` while ``obj`` lives (objects without weak
    references are resolved at each use)."""
    key = id(obj)
    try:
        _mesh_ctxs[key] = (weakref.ref(obj, lambda _: _mesh_ctxs.pop(key, None)), ctx)
    except TypeError:
        pass
    return ctx


def _is_d9d_context(obj) -> bool:
    """A d9d ``DistributedContext`` (or a look-alike): checked on the type,
    without importing d9d."""
    d9d_ctx = getattr(sys.modules.get("d9d.core.dist_context"), "DistributedContext", None)
    if d9d_ctx is not None and isinstance(obj, d9d_ctx):
        return True
    return hasattr(type(obj), "mesh_params") and hasattr(type(obj), "mesh_for")


def _device_mesh_type():
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except Exception:  # torch built without distributed
        return None
    return DeviceMesh


def _mesh_context(mesh) -> DistributedContext:
    """Every rank of ``mesh`` (all dims)."""
    if mesh.ndim == 1:
        return DistributedContext(group=mesh.get_group(0))
    if dist.is_initialized() and mesh.size() == dist.get_world_size():
        # every rank of the world: reduce over the world group (no new group,
        # whose creation costs store traffic growing with W)
        return DistributedContext(group=dist.group.WORLD)
    names = tuple(mesh.mesh_dim_names or ())
    if not names:
        raise ValueError(
            "ctx: a DeviceMesh with several unnamed dims over part of the world; name its dims "
            "or pass DistributedContext.from_mesh(mesh, dims=...)"
        )
    return DistributedContext.from_mesh(mesh, dims=names)


def _clip(s: str, n: int = 160) -> str:
    return repr(s) if len(s) <= n else repr(s[:n]) + f"... ({len(s)} chars)"


def _store_has(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False


def _store_get_all(store, keys: list[str]) -> Iterable[bytes]:
    try:
        return store.multi_get(keys)
    except Exception:
        return [store.get(k) for k in keys]


def _duplicate(mesh, dims: tuple[str, ...]) -> bool:
    """Whether this rank is not the last along some dim of ``mesh`` outside ``dims``."""
    coord = mesh.get_coordinate()
    return coord is not None and any(
        c != n - 1 for name, c, n in zip(mesh.mesh_dim_names, coord, mesh.shape) if name not in dims)


def _flattened_group(mesh, dims: tuple[str, ...]):
    """ProcessGroup of the sub-mesh spanned by ``dims`` (those containing this rank)."""
    try:
        return mesh[dims]._flatten().get_group()
    except Exception:  # private API moved: build the group from the mesh layout
        pass
    names = tuple(mesh.mesh_dim_names)
    idx = [names.index(d) for d in dims]
    rest = [i for i in range(len(names)) if i not in idx]
    layout = mesh.mesh.permute(*rest, *idx).reshape(-1, int(torch.tensor([mesh.mesh.shape[i] for i in idx]).prod()))
    me = dist.get_rank()
    row = next(r for r in layout.tolist() if me in r)
    key = tuple(sorted(row))
    g = _mesh_groups.get(key)
    if g is None:
        g = dist.new_group(ranks=list(row), use_local_synchronization=True)
        _mesh_groups[key] = g
    return g


def member_detail(owners: list, layout) -> str:
    """JSON ``[[label, {field: text}], ...]`` of a layout's ``owners``
    (``(label, metric)``): the class, the public configuration attributes and
    each statistic's schema. Sent by one rank per schema variant when ranks disagree."""
    out = []
    for i, (label, m) in enumerate(owners):
        fields: dict[str, str] = {"class": type(m).__name__}
        for k, v in sorted(vars(m).items()):
            if not k.startswith("_") and _plain(v):
                fields[k] = repr(v)
        for name, j in sorted(layout.maps[i].items()):
            stat = layout.stats[j]
            slots = ", ".join(f"{s.name} {s.kind} {tuple(s.shape)}" for s, _ in layout.placed[j])
            fields[f"state {name}"] = f"{stat.schema()} [{slots}]"
        out.append([label, fields])
    return json.dumps(out)


def _plain(v) -> bool:
    if isinstance(v, (tuple, list)):
        return len(v) <= 16 and all(_plain(x) for x in v)
    return v is None or isinstance(v, (bool, int, float, str))


def explain_members(variants: list) -> str:
    """Per member, in words: "MetricGroup['acc']: num_classes 5 on ranks [0]
    vs 6 on ranks [1]" (configuration first; the state only when the
    configuration does not differ)."""
    parsed = []
    for ranks, text in variants:
        try:
            parsed.append((ranks, dict(json.loads(text)), [label for label, _ in json.loads(text)]))
        except ValueError:  # truncated detail: show the raw text
            return " vs ".join(f"ranks {fmt_ranks(r)}: {t[:300]!r}" for r, t in variants)
    lines = []
    labels = list(dict.fromkeys(label for _, _, order in parsed for label in order))
    for label in labels:
        having = [(ranks, members[label]) for ranks, members, _ in parsed if label in members]
        missing = [ranks for ranks, members, _ in parsed if label not in members]
        if missing:
            cls = having[0][1].get("class", "?")
            lines.append(
                f"{label} ({cls}) on ranks {fmt_ranks(_cat(r for r, _ in having))}, "
                f"missing on ranks {fmt_ranks(_cat(missing))}"
            )
            continue
        diffs = _field_diffs(having, lambda k: not k.startswith("state "))
        diffs = diffs or _field_diffs(having, lambda k: k.startswith("state "))
        lines.extend(f"{label}: {d}" for d in diffs)
    orders = [order for _, _, order in parsed]
    if not lines and len({tuple(o) for o in orders}) > 1:
        lines.append("member order " + " vs ".join(f"{o} on ranks {fmt_ranks(r)}" for o, (r, _, _) in zip(orders, parsed)))
    if not lines:
        lines.append("members agree but their merged statistics differ: " + " vs ".join(
            f"ranks {fmt_ranks(r)}: {t[:200]!r}" for r, t in variants))
    more = f"; ... ({len(lines) - 12} more)" if len(lines) > 12 else ""
    return "; ".join(lines[:12]) + more


def _cat(lists) -> list[int]:
    return sorted(r for rs in lists for r in rs)


def _field_diffs(having: list, pick) -> list[str]:
    """"field a on ranks [..] vs b on ranks [..]" for every field that differs."""
    keys = list(dict.fromkeys(k for _, f in having for k in f if pick(k)))
    out = []
    for k in keys:
        by_value: dict[str, list[int]] = {}
        for ranks, f in having:
            by_value.setdefault(f.get(k, "(unset)"), []).extend(ranks)
        if len(by_value) > 1:
            out.append(f"{k} " + " vs ".join(f"{v} on ranks {fmt_ranks(sorted(r))}" for v, r in by_value.items()))
    return out
