// moments_recenter and moments_center on CUDA: one thread per table entry,
// one launch each (a storage holds a few entries). The table is built by
// the library: a row outside the buffers is skipped, not checked on the
// host (that would read the table back). Specification:
// d9d_kernels/reference.py::moments_recenter, ::moments_center.
#include <torch/library.h>

#include "../kernels/moments_pivot.h"
#include "../kernels/moments_pivot_checks.h"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

struct Buffers {
  int64_t n_sums, n_pivots;
  __device__ bool inside(int64_t mo, int64_t po) const {
    return mo >= 0 && mo + kMomentsSize <= n_sums && po >= 0 && po + 2 <= n_pivots;
  }
};

__global__ void recenter_kernel(double* m, double* p, const double* q, const int64_t* t, int64_t b, Buffers n) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e < b && n.inside(t[3 * e], t[3 * e + 1])) recenter_entry(m + t[3 * e], p + t[3 * e + 1], q + t[3 * e + 1]);
}

__global__ void center_kernel(const double* m, const double* p, const int64_t* t, double threshold, double* c,
                              bool* off, int64_t b, Buffers n) {
  const int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (e >= b || !n.inside(t[3 * e], t[3 * e + 1])) return;
  const int64_t po = t[3 * e + 1];
  if (center_entry(m + t[3 * e], p + po, t[3 * e + 2] != 0, threshold, c + po)) *off = true;
}

unsigned grid_of(int64_t b) { return static_cast<unsigned>((b + kThreads - 1) / kThreads); }

void moments_recenter_cuda(const at::Tensor& sums, const at::Tensor& pivots, const at::Tensor& new_pivots,
                           const at::Tensor& table) {
  const int64_t b = check_moments_pivot("moments_recenter", sums, pivots, new_pivots, "new_pivots", table);
  if (b == 0) return;
  const at::cuda::CUDAGuard guard(sums.device());
  recenter_kernel<<<grid_of(b), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      sums.data_ptr<double>(), pivots.data_ptr<double>(), new_pivots.const_data_ptr<double>(),
      table.const_data_ptr<int64_t>(), b, Buffers{sums.numel(), pivots.numel()});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void moments_center_cuda(const at::Tensor& sums, const at::Tensor& pivots, const at::Tensor& table, double threshold,
                         const at::Tensor& centre, const at::Tensor& off) {
  const int64_t b = check_moments_pivot("moments_center", sums, pivots, centre, "centre", table);
  check_off(off, sums);
  if (b == 0) return;
  const at::cuda::CUDAGuard guard(sums.device());
  center_kernel<<<grid_of(b), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
      sums.const_data_ptr<double>(), pivots.const_data_ptr<double>(), table.const_data_ptr<int64_t>(), threshold,
      centre.data_ptr<double>(), off.data_ptr<bool>(), b, Buffers{sums.numel(), pivots.numel()});
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) {
  m.impl("moments_recenter", &d9d::cuda::moments_recenter_cuda);
  m.impl("moments_center", &d9d::cuda::moments_center_cuda);
}
