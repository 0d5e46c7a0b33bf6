// group_values on CUDA: a block per program row; the class sums are strided
// over the block's threads and reduced with block_sum (csrc/kernels/
// group_values.h has the formulas, shared with the CPU op).
#include <torch/library.h>

#include "../kernels/group_values.h"
#include "../kernels/group_values_checks.h"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

using namespace group_values;

__global__ void group_values_kernel(Buffers b, const int64_t* __restrict__ prog, const double* __restrict__ beta,
                                    double* __restrict__ out, int64_t n_out) {
  __shared__ double scratch[kThreads / kWarp];
  const int64_t* r = prog + static_cast<int64_t>(blockIdx.x) * kCols;
  if (!row_ok(r, b, n_out)) {  // the same for every thread of the block
    if (threadIdx.x == 0) write_nan(r, out, n_out);
    return;
  }
  if (r[kFormula] < kAccuracy) {
    if (threadIdx.x == 0) out[r[kOut]] = scalar_value(r, b);
    return;
  }
  if (r[kFormula] == kConfmat) {
    for (int64_t e = threadIdx.x; e < out_len(r); e += blockDim.x) out[r[kOut] + e] = confmat_value(r, b.sum, e);
    return;
  }
  const double beta2 = beta[blockIdx.x];
  Partial p;
  for (int64_t c = threadIdx.x; c < r[kClasses]; c += blockDim.x) add_class(r, beta2, b.sum, c, p, out);
  Partial t;
  t.tp = block_sum(p.tp, scratch);
  t.fp = block_sum(p.fp, scratch);
  t.tn = block_sum(p.tn, scratch);
  t.fn = block_sum(p.fn, scratch);
  t.ws = block_sum(p.ws, scratch);
  t.w = block_sum(p.w, scratch);
  __syncthreads();  // the "none" scores are written before a NaN propagation overwrites them
  if (threadIdx.x == 0) finish_class(r, beta2, b.sum, t, out);
}

void group_values_cuda(const at::Tensor& sum, const at::Tensor& max, const at::Tensor& replica,
                       const at::Tensor& program, const at::Tensor& beta, const at::Tensor& out) {
  check_group_values(sum, max, replica, program, beta, out);
  const int64_t K = program.size(0);
  if (K == 0) return;
  const at::cuda::CUDAGuard guard(out.device());
  group_values_kernel<<<static_cast<unsigned>(K), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      buffers_of(sum, max, replica), program.data_ptr<int64_t>(), beta.data_ptr<double>(), out.data_ptr<double>(),
      out.numel());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("group_values", &d9d::cuda::group_values_cuda); }
