"""linear_logits: per-row reductions of ``hidden @ weight.T`` (+ bias, soft-cap)
without materialising the logits.

For each row: the max, ``Σ exp(z - max)``, the target's logit, the number of
columns ranked ahead of the target (``class_stats``' tie rule: ``z_j > z_t``,
or ``z_j == z_t`` and ``j < t``) and the argmax. The target is in the top-k
iff fewer than k columns rank ahead of it, so one pass answers every top-k,
the NLL (``max + log Σ - z_t``) and the argmax. ``reference.linear_logits``
is the specification (the logits eager PyTorch materialises in the inputs'
dtype).

Backends: ``"triton"`` (``d9d_kernels/triton/linear_logits.py``: tiled
``tl.dot`` with the reductions in the epilogue; the default on CUDA for
16/32-bit inputs) and ``"torch"`` (``_rows_torch`` below: ``torch.mm`` over
blocks of rows x vocabulary columns into a bounded scratch, then the
reductions of each block: on CPU all of it in one C++ call,
``torch.ops.d9d_kernels.linear_logits_rows`` (one parallel region, its
threads taking tasks of rows, each task's blocks matmul + pass on one
thread), elsewhere torch ops per block, its specification). The matmul is
torch.mm's: on CPU that is the floor.
"""

from __future__ import annotations

import os

import torch

from d9d_kernels import _extension
from d9d_kernels.ops._common import FLOATS, check, fail
from d9d_kernels.reference import LINEAR_ROWS

OP = "linear_logits"

#: bytes of the scratch blocks of one call together (the mm output, its
#: float32 copy for 16-bit inputs, the compare buffer, the column mask):
#: with the target rows' gather and the per-row vectors, 1.5 % of the float32
#: logits of [2048, 32000] (bench/bench_lm.py --hidden)
SCRATCH_BYTES = 3 << 20
#: vocabulary columns per torch.mm call: from 256 on, chunked torch.mm runs
#: at the speed of one whole-vocabulary call (bench/bench_lm.py --hidden)
MIN_COLS = 256
MAX_COLS = 4096
#: rows of one task of the CPU pass (``linear_logits_rows``), a thread's
#: block ``[rows, cols]`` of the scratch: at most N / (TASKS_PER_THREAD *
#: threads), so that a thread slowed by another process leaves tasks to the
#: others; at least MIN_TASK_ROWS (below it the per-call cost of the block
#: matmul shows, bfloat16 first: bench/analysis.md, "LinearLogits with a busy core")
TASKS_PER_THREAD = 2
MIN_TASK_ROWS = 256
#: bytes of the gathered target rows of weight (the target logits) at once
#: (float32: up to 3 such buffers live, the rows, hidden's copy, the product)
TARGET_BYTES = 1 << 18


def linear_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    target_logit: torch.Tensor | None = None,
    *,
    start: int = 0,
    softcap: float | None = None,
    sumexp: bool = True,
    backend: str | None = None,
) -> torch.Tensor:
    """Per-row ``[N, 5]`` float64 reductions of ``z = hidden @ weight.T (+ bias)``.

    Args:
        hidden: ``[N, D]`` float16 / bfloat16 / float32 / float64.
        weight: ``[V, D]``, hidden's dtype and device (vocabulary ids
            ``[start, start + V)``: the whole head or a tensor-parallel shard).
        bias: ``[V]`` or None.
        target: ``[N]`` integer global class ids (any value: out of range
            gives a -inf target logit).
        target_logit: float64 ``[N]`` or None: the target logits when the
            target may be in another shard (``reference.linear_logits``).
        start: the global id of ``weight``'s row 0.
        softcap: None or > 0: ``z = softcap * tanh(z / softcap)``.
        sumexp: also ``Σ exp(z - max)`` (False when the loss's logsumexp is given).
        backend: ``"triton"`` or ``"torch"``; default triton on CUDA for
            16/32-bit inputs, else torch (``D9D_KERNELS_BACKEND=triton|torch`` too).

    Returns:
        float64 ``[N, 5]``: row max, ``Σ exp(z - max)`` (0 without
        ``sumexp``), target logit, columns ranked ahead of the target, argmax
        (global ids as floats).

    Example:
        >>> import torch, d9d_kernels as dk
        >>> h, w = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1.0, 1.0], [2.0, 0.0], [0.0, 3.0]])
        >>> dk.ops.linear_logits(h, w, None, torch.tensor([0, 1]))[:, 3].tolist()  # rows [1, 2, 0], [1, 0, 3]
        [1.0, 2.0]
    """
    for arg, t in (("hidden", hidden), ("weight", weight)):
        check(isinstance(t, torch.Tensor), OP, arg, f"must be a torch.Tensor, got {type(t).__name__}", TypeError)
    check(hidden.dtype in FLOATS, OP, "hidden", f"must be floating (f16/bf16/f32/f64), got {hidden.dtype}", TypeError)
    check(hidden.dim() == 2, OP, "hidden", f"must be [N, D], got shape {tuple(hidden.shape)}")
    check(weight.dtype == hidden.dtype, OP, "weight", f"must have hidden's dtype {hidden.dtype}, got {weight.dtype}",
          TypeError)
    check(weight.dim() == 2 and weight.shape[1] == hidden.shape[1], OP, "weight",
          f"must be [V, D] with D = {hidden.shape[1]}, got shape {tuple(weight.shape)}")
    check(weight.device == hidden.device, OP, "weight", f"must be on hidden's device {hidden.device}")
    N, V = hidden.shape[0], weight.shape[0]
    if bias is not None:
        check(isinstance(bias, torch.Tensor) and bias.dtype == hidden.dtype, OP, "bias",
              f"must be a tensor of hidden's dtype {hidden.dtype}", TypeError)
        check(tuple(bias.shape) == (V,) and bias.device == hidden.device, OP, "bias",
              f"must be [V] = [{V}] on {hidden.device}, got shape {tuple(bias.shape)} on {bias.device}")
    check(isinstance(target, torch.Tensor) and not target.is_floating_point() and not target.is_complex(), OP,
          "target", "must be an integer tensor", TypeError)
    check(tuple(target.shape) == (N,) and target.device == hidden.device, OP, "target",
          f"must be [N] = [{N}] on {hidden.device}, got shape {tuple(target.shape)} on {target.device}")
    if target_logit is not None:
        check(isinstance(target_logit, torch.Tensor) and tuple(target_logit.shape) == (N,)
              and target_logit.dtype == torch.float64 and target_logit.device == hidden.device, OP, "target_logit",
              f"must be float64 [N] = [{N}] on {hidden.device}")
    if softcap is not None:
        check(isinstance(softcap, (int, float)) and not isinstance(softcap, bool) and softcap > 0, OP, "softcap",
              f"must be None or a float > 0, got {softcap!r}")
        softcap = float(softcap)
    check(isinstance(start, int) and start >= 0, OP, "start", f"must be an int >= 0, got {start!r}")
    out = torch.empty(N, LINEAR_ROWS, dtype=torch.float64, device=hidden.device)
    impl = raw(hidden.device, hidden.dtype, backend)
    impl(hidden, weight, bias, target.to(torch.int64), target_logit, start, softcap, bool(sumexp), out)
    return out


def pick(device: torch.device, dtype: torch.dtype, backend: str | None = None) -> str:
    """``"triton"`` or ``"torch"`` (a forced ``"cpp"`` / ``"cuda"`` runs torch: no compiled kernel here)."""
    forced = backend or os.environ.get("D9D_KERNELS_BACKEND") or None
    if forced == "triton":
        if not _extension.triton_usable(device):
            fail(OP, "backend", f"'triton' can't run on {device} (CUDA, or CPU under TRITON_INTERPRET=1)", RuntimeError)
        if dtype == torch.float64:
            fail(OP, "backend", "'triton' takes float16 / bfloat16 / float32 inputs, got float64", RuntimeError)
        return "triton"
    if forced not in (None, "torch", "cpp", "cuda"):
        fail(OP, "backend", f"must be one of ('cpp', 'cuda', 'triton', 'torch'), got {forced!r}")
    if forced is None and device.type == "cuda" and _extension.HAS_TRITON and dtype != torch.float64:
        return "triton"
    return "torch"


def raw(device: torch.device, dtype: torch.dtype, backend: str | None = None):
    """The unchecked implementation (``reference.linear_logits``'s arguments) for ``device`` / ``dtype``."""
    if pick(torch.device(device), dtype, backend) == "triton":
        from d9d_kernels.triton.linear_logits import linear_logits as launcher

        return launcher
    return _rows_torch


def scratch_per_element(dtype: torch.dtype) -> int:
    """Scratch bytes per block element: mm output, float32 copy (16-bit inputs), compare buffer, bool mask."""
    item = 8 if dtype == torch.float64 else 4
    return 2 * item + (0 if dtype in (torch.float32, torch.float64) else dtype.itemsize) + 1


def scratch_bytes(N: int, D: int, V: int, dtype: torch.dtype) -> int:
    """Peak scratch of one ``_rows_torch`` call: the blocks, the target rows'
    gather (three float32 ``[rows, D]`` buffers) and the per-row vectors."""
    rows, cols = blocks(N, V, dtype)
    step = min(N, max(1, TARGET_BYTES // max(1, D * 4)))
    return rows * cols * scratch_per_element(dtype) + 3 * step * D * 4 + N * 96


def blocks(N: int, V: int, dtype: torch.dtype) -> tuple[int, int]:
    """(rows, columns) of the scratch blocks of ``_rows_torch``: within
    ``SCRATCH_BYTES`` together, at least ``MIN_COLS`` columns (fewer rows then)."""
    per = scratch_per_element(dtype)
    elems = max(SCRATCH_BYTES // per, MIN_COLS)
    cols = min(max(elems // max(N, 1), MIN_COLS), MAX_COLS, max(V, 1))
    rows = max(1, min(N, elems // cols))
    return rows, cols


def task_rows(N: int, V: int, dtype: torch.dtype, threads: int) -> int:
    """Rows of one task of ``linear_logits_rows`` with ``threads`` threads
    (``TASKS_PER_THREAD``, ``MIN_TASK_ROWS``): the threads' blocks together
    within the rows of ``blocks``, so within ``scratch_bytes``."""
    rows, _ = blocks(N, V, dtype)
    threads = max(1, threads)
    return max(1, min(max(-(-N // (TASKS_PER_THREAD * threads)), MIN_TASK_ROWS), rows // threads))


def softcapped(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(z / softcap)`` in place, rounded to z's dtype after each op as eager torch does."""
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def target_logits(hidden, weight, bias, target, start: int, softcap: float | None) -> torch.Tensor:
    """``z[target - start]`` per row in the accumulation dtype (float32, float64
    for float64 inputs), -inf where the target is not in ``[start, start + V)``:
    the gathered weight rows dotted with ``hidden`` in float32, rounded to the
    inputs' dtype (as ``torch.mm`` rounds its float32 accumulator), bias and
    soft-cap as in the logits. A different summation order than the matmul's:
    it may differ from the materialised logit in the last bit. On CPU the
    logits before the soft-cap are one C++ call where the extension has it,
    ``torch.ops.d9d_kernels.linear_logits_target`` (one parallel region; the
    dot summed in order)."""
    N, D = hidden.shape
    V = weight.shape[0]
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    tl = target - start
    here = (tl >= 0) & (tl < V)
    native = _native(hidden.device, "linear_logits_target")
    if native is not None:
        out = torch.empty(N, dtype=acc, device=hidden.device)
        native(hidden, weight, bias, target, start, out)
        if softcap is None:
            return out
        return torch.where(here, softcapped(out.to(hidden.dtype), softcap).to(acc), float("-inf"))
    idx = torch.where(here, tl, 0)
    out = torch.empty(N, dtype=acc, device=hidden.device)
    step = max(1, TARGET_BYTES // max(1, D * 4))
    for i in range(0, N, step):
        j = min(N, i + step)
        w = weight.index_select(0, idx[i:j]).to(acc)
        z = torch.linalg.vecdot(hidden[i:j].to(acc), w)
        if bias is not None:
            z += bias.index_select(0, idx[i:j]).to(acc)
        out[i:j] = softcapped(z.to(hidden.dtype), softcap).to(acc)
    return torch.where(here, out, float("-inf"))


def _block_logits(h, wt, bias, c0: int, c: int, out: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Columns ``[c0, c0 + c)`` of the logits of rows ``h`` into ``out`` (torch.mm's rounding), soft-capped."""
    if bias is None:
        torch.mm(h, wt[:, c0 : c0 + c], out=out)
    else:
        torch.addmm(bias[c0 : c0 + c], h, wt[:, c0 : c0 + c], out=out)
    return softcapped(out, softcap)


def _native(device: torch.device, name: str):
    """``torch.ops.d9d_kernels.<name>`` (csrc/cpu/linear_logits.cpp) on CPU where
    the extension has it, else None: the torch ops here, its specification, run."""
    if device.type != "cpu" or _extension.CPP_ERROR is not None:
        return None
    op = getattr(torch.ops.d9d_kernels, name, None)
    return None if op is None else op.default


def _native_rows(device: torch.device):
    """``linear_logits_rows`` (every block's matmul and pass in one parallel region) or None."""
    return _native(device, "linear_logits_rows")


def _rows_torch(hidden, weight, bias, target, target_logit, start, softcap, sumexp, out) -> None:
    """``reference.linear_logits`` by blocks: ``torch.mm`` of ``rows`` hidden rows
    against ``cols`` weight rows into a scratch block (float32 accumulation, the
    dtype's rounding: torch.mm's own), then on the block (float32, float64 for
    float64 inputs): max + argmax (``torch.max``: the first maximum), the
    online log-sum-exp, and the columns ahead of the target, counted as
    ``z > thr`` with ``thr`` the target logit from the target's column on and
    its predecessor (``nextafter`` towards -inf) before it, so ties before the
    target count; the target's own column is taken back out."""
    N, D = hidden.shape
    V = weight.shape[0]
    if N == 0:
        return
    dev, dt = hidden.device, hidden.dtype
    acc = torch.float64 if dt == torch.float64 else torch.float32
    zt_all = target_logits(hidden, weight, bias, target, start, softcap) if target_logit is None \
        else target_logit.to(acc)
    rows, cols = blocks(N, V, dt)
    native = _native_rows(dev)
    if native is not None:  # the blocks' matmuls and reductions in one C++ call: one parallel region
        st = torch.empty(N, 4, dtype=torch.float64, device=dev)
        native(hidden, weight, bias, zt_all, (target - start).contiguous(), cols,
               task_rows(N, V, dt, torch.get_num_threads()), softcap, sumexp, st)
        out[:, 0:2] = st[:, 0:2]
        out[:, 2] = zt_all
        out[:, 3] = st[:, 2]
        out[:, 4] = st[:, 3] + start
        return
    zbuf = torch.empty(rows * cols, dtype=dt, device=dev)
    wt = weight.t()
    fbuf = zbuf if dt == acc else torch.empty(rows * cols, dtype=acc, device=dev)
    ebuf = torch.empty(rows * cols, dtype=acc, device=dev)
    cbuf = torch.empty(rows * cols, dtype=torch.bool, device=dev)
    colidx = torch.arange(cols, device=dev)
    for r0 in range(0, N, rows):
        n = min(rows, N - r0)
        h = hidden[r0 : r0 + n]
        zt = zt_all[r0 : r0 + n]
        ztp = torch.nextafter(zt, torch.full_like(zt, float("-inf")))
        tloc = target[r0 : r0 + n] - start
        M = torch.full((n,), float("-inf"), dtype=acc, device=dev)
        S = torch.zeros(n, dtype=torch.float64, device=dev)
        R = torch.zeros(n, dtype=torch.float64, device=dev)
        A = torch.zeros(n, dtype=torch.int64, device=dev)
        for c0 in range(0, V, cols):
            c = min(cols, V - c0)
            zb = _block_logits(h, wt, bias, c0, c, zbuf[: n * c].view(n, c), softcap)
            z = zb if dt == acc else fbuf[: n * c].view(n, c).copy_(zb)
            cm, ci = torch.max(z, 1)  # first maximum of the block (torch.max's documented tie rule)
            A = torch.where(cm > M, ci + c0, A)  # strict: an earlier block keeps a tie
            M_new = torch.maximum(M, cm)  # NaN propagates: the row is bad
            if sumexp:
                safe = torch.where(torch.isfinite(M_new), M_new, 0.0)
                e = ebuf[: n * c].view(n, c)
                block = torch.sub(z, safe[:, None], out=e).exp_().sum(1)
                S = S * torch.exp((M - safe).double()) + block.double()
            M = M_new
            # ahead of the target: z > ztp before its column (ties there rank ahead), z > zt from it on
            before = torch.lt(colidx[:c] + c0, tloc[:, None], out=cbuf[: n * c].view(n, c))
            thr = torch.where(before, ztp[:, None], zt[:, None], out=ebuf[: n * c].view(n, c))
            R += torch.gt(z, thr, out=thr).sum(1)
            inside = (tloc >= c0) & (tloc < c0 + c)
            own = z.gather(1, (tloc - c0).clamp(0, c - 1)[:, None])[:, 0]
            R -= (inside & (own > zt)).double()  # the target's own column, where its logit exceeds zt
        o = out[r0 : r0 + n]
        o[:, 0] = M
        o[:, 1] = S
        o[:, 2] = zt
        o[:, 3] = R
        o[:, 4] = A + start


__all__ = ["linear_logits", "pick", "raw", "blocks", "task_rows", "scratch_bytes", "target_logits", "OP"]
