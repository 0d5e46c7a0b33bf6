// moments_recenter and moments_center on CUDA: one thread per entry, one
// launch each (a storage holds a few entries). Specification:
// d9d_kernels/reference.py::moments_recenter, ::moments_center.
#include <torch/library.h>

#include "../kernels/moments_pivot.h"
#include "../kernels/moments_pivot_checks.h"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

__global__ void recenter_kernel(double* m, double* p, const double* q, int64_t b) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e < b) recenter_entry(m + e * kMomentsSize, p + 2 * e, q + 2 * e);
}

__global__ void center_kernel(const double* m, const double* p, bool paired, double threshold, double* c, bool* off,
                              int64_t b) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e < b && center_entry(m + e * kMomentsSize, p + 2 * e, paired, threshold, c + 2 * e)) *off = true;
}

unsigned grid_of(int64_t b) { return static_cast<unsigned>((b + kThreads - 1) / kThreads); }

void moments_recenter_cuda(const at::Tensor& moments, const at::Tensor& pivot, const at::Tensor& new_pivot) {
  const int64_t b = check_moments_pivot("moments_recenter", moments, pivot, new_pivot, "new_pivot");
  if (b == 0) return;
  const at::cuda::CUDAGuard guard(moments.device());
  recenter_kernel<<<grid_of(b), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      moments.data_ptr<double>(), pivot.data_ptr<double>(), new_pivot.const_data_ptr<double>(), b);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void moments_center_cuda(const at::Tensor& moments, const at::Tensor& pivot, bool paired, double threshold,
                         const at::Tensor& centre, const at::Tensor& off) {
  const int64_t b = check_moments_pivot("moments_center", moments, pivot, centre, "centre");
  check_off(off, moments);
  if (b == 0) return;
  const at::cuda::CUDAGuard guard(moments.device());
  center_kernel<<<grid_of(b), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      moments.const_data_ptr<double>(), pivot.const_data_ptr<double>(), paired, threshold,
      centre.data_ptr<double>(), off.data_ptr<bool>(), b);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) {
  m.impl("moments_recenter", &d9d::cuda::moments_recenter_cuda);
  m.impl("moments_center", &d9d::cuda::moments_center_cuda);
}
