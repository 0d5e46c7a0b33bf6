"""Helpers shared by the Triton kernels: op registration, block sizes, jit helpers."""

import struct
from typing import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _probe():
    pass


# TRITON_INTERPRET=1 was set before `import triton`: kernels run in numpy on CPU tensors.
INTERPRETED: bool = isinstance(_probe, InterpretedFunction)

# Elements per program for 1-D kernels and per [rows, cols] tile for 2-D ones.
# The interpreter pays ~2 ms per program instance, so it gets bigger tiles.
BLOCK = 8192 if INTERPRETED else 1024
TILE = 8192 if INTERPRETED else 2048
# 1-D reductions run a grid-stride loop on at most this many programs, so the
# number of atomics on the few hot state addresses does not grow with N.
# Tiny under the interpreter so that small test inputs exercise the loop.
# 2-D kernels loop over row tiles on at most this many programs as well.
# Counters and partial sums are read only by later launches (stream order),
# so every atomic is sem="relaxed" (Triton's default is acq_rel).
MAX_PROGRAMS = 2 if INTERPRETED else 1024


def programs(n: int, block: int) -> int:
    """Grid size of a grid-stride 1-D kernel over n elements."""
    return min(triton.cdiv(n, block), MAX_PROGRAMS)


def register(name: str, mutates_args: tuple[str, ...]) -> Callable:
    """Registers a launcher as ``torch.ops.d9d_kernels.<name>``.

    With compiled Triton this is ``torch.library.triton_op``: torch.compile
    traces into the launcher and sees the kernels. Under ``TRITON_INTERPRET=1``
    ``wrap_triton`` hands back the interpreted function itself, which would run
    numpy on fake tensors while tracing; there the launcher is an opaque
    ``torch.library.custom_op`` whose fake implementation does nothing (the ops
    only mutate their state arguments and return None).
    """

    def dec(fn: Callable) -> Callable:
        qualname = f"d9d_kernels::{name}"
        if not INTERPRETED:
            return torch.library.triton_op(qualname, fn, mutates_args=mutates_args)
        op = torch.library.custom_op(qualname, fn, mutates_args=mutates_args)
        op.register_fake(lambda *args, **kwargs: None)
        return op

    return dec


def launch(kernel):
    """``wrap_triton(kernel)`` so launches inside a triton_op are traceable."""
    return torch.library.wrap_triton(kernel)


# Per-launch scratch (flags, partials) reused across calls: one buffer per
# (name, device, stream), so a call allocates nothing after the first and
# two streams never share one. Under torch.compile tracing a fresh tensor is
# made instead (a cached real tensor must not leak into a traced graph).
_SCRATCH: dict = {}


def _tracing() -> bool:
    """Under torch.compile, or on fake tensors: torch 2.11's Dynamo runs a
    triton_op's body in a fake mode with ``is_compiling()`` False."""
    fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    return torch.compiler.is_compiling() or fake is not None


def scratch(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable buffer of ``shape``/``dtype`` on ``device`` (contents undefined)."""
    if _tracing():
        return torch.empty(shape, dtype=dtype, device=device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (name, device, stream)
    buf = _SCRATCH.get(key)
    if buf is None or buf.shape != shape or buf.dtype != dtype:
        buf = _SCRATCH[key] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def f64_bits(v: float) -> int:
    """A float64 as the int64 of its bits: a kernel argument that keeps full
    precision (a Python float argument is rounded to float32 by Triton) and
    needs no device tensor. The kernel reads it back with ``from_bits``."""
    return struct.unpack("<q", struct.pack("<d", float(v)))[0]


@triton.jit
def from_bits(bits):
    # Triton types small ints (0.0's bits, tiny denormals) as int32 and may make
    # 1 a constant: widen first (sign extension keeps the bits' value).
    return tl.cast(bits, tl.int64).to(tl.float64, bitcast=True)


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def as_u8(mask: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    """Bool masks are read as uint8 (same bytes); ``dummy`` stands in for None."""
    if mask is None:
        return dummy
    return mask.contiguous().view(torch.uint8)


def loadable(t: torch.Tensor) -> torch.Tensor:
    """Contiguous, with bool viewed as uint8 (Triton has no bool pointers in the interpreter)."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.dtype == torch.bool else t


@triton.jit
def finite(x):
    """True where x is neither NaN nor +-Inf."""
    return tl.abs(x) < float("inf")


@triton.jit
def add_histogram(ptr, h, n, NB: tl.constexpr):
    """Adds a program's int32 histogram ``h`` (``NB`` bins) into the float64
    state ``ptr[0:n]``: one relaxed atomic per non-empty bin."""
    bins = tl.arange(0, NB)
    tl.atomic_add(ptr + bins, h.to(tl.float64), mask=(bins < n) & (h > 0), sem="relaxed")


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def rows_kept(t_ptr, m_ptr, rows, n, C, ignore, HAS_M: tl.constexpr, HAS_IGNORE: tl.constexpr):
    """Per row index of ``rows``: its class target, kept (a row of the input, not
    masked out, not ``ignore_index``) and 'target in [0, C)'."""
    inb = rows < n
    t = tl.load(t_ptr + rows, mask=inb, other=0)
    keep = inb
    if HAS_M:
        keep = keep & (tl.load(m_ptr + rows, mask=inb, other=0) != 0)
    if HAS_IGNORE:
        keep = keep & (t != ignore)
    return t, keep, (t >= 0) & (t < C)
