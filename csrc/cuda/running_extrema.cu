// running_extrema on CUDA: grid-stride pass with per-thread Extrema, a block
// reduction, then an atomic NaN-propagating max into the state.
// Specification: d9d_kernels/reference.py::running_extrema.
#include <ATen/Dispatch.h>

#include "../cpu/running_extrema_checks.h"
#include "../kernels/running_extrema.h"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

template <class T>
__global__ void extrema_kernel(const T* x, int64_t sx, const bool* m, int64_t sm, int64_t n, bool skip_bad,
                               double* state, double* bad) {
  __shared__ Extrema part[kThreads];
  Extrema a = extrema_init();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (m != nullptr && !m[i * sm]) continue;
    extrema_add(a, static_cast<double>(x[i * sx]), skip_bad);
  }
  part[threadIdx.x] = a;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) extrema_merge(part[threadIdx.x], part[threadIdx.x + s]);
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    atomic_nan_max(state, part[0].mx);
    atomic_nan_max(state + 1, part[0].nmn);
    if (part[0].bad != 0.0) atomicAdd(bad, part[0].bad);
  }
}

void running_extrema_cuda(const at::Tensor& x, const std::optional<at::Tensor>& mask, bool skip_bad,
                          const at::Tensor& state, const at::Tensor& bad) {
  check_running_extrema(x, mask, state, bad);
  const int64_t n = x.size(0);
  if (n == 0) return;
  const at::cuda::CUDAGuard guard(x.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "running_extrema_cuda", [&] {
    extrema_kernel<scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
        x.data_ptr<scalar_t>(), x.stride(0), mask_ptr(mask), mask.has_value() ? mask->stride(0) : 0, n, skip_bad,
        state.data_ptr<double>(), bad.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("running_extrema", &d9d::cuda::running_extrema_cuda); }
