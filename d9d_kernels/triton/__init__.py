"""Triton backend: one module per op, each with its ``@triton.jit`` kernel(s)
and a launcher named like the op taking the reference's positional arguments
(``d9d_kernels.reference`` is the specification).

Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (set
before ``import triton``). Every launcher is also a PyTorch operator,
``torch.ops.d9d_kernels.<op>_triton``, registered with
``torch.library.triton_op`` (a plain ``custom_op`` under the interpreter, see
``_common.register``), so fake tensors and ``torch.compile`` see it.
The op modules are imported lazily by ``d9d_kernels.ops`` when the
``"triton"`` backend is picked; importing this package does not import triton.
"""

from d9d_kernels._extension import OPS  # noqa: F401  (one op per module here)
