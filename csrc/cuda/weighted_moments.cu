// weighted_moments on CUDA: a one-block kernel sets unset pivots (first good
// element in index order), then a grid-stride pass with per-thread Moments,
// block reductions and one atomicAdd per slot per block.
// Specification: d9d_kernels/reference.py::weighted_moments.
#include <ATen/Dispatch.h>

#include "../cpu/weighted_moments_checks.h"
#include "../kernels/weighted_moments.h"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

template <class T>
struct In {
  const T* x;
  const T* y;
  const T* w;
  const bool* m;
  int64_t sx, sy, sw, sm, n;
  __device__ double xv(int64_t i) const { return static_cast<double>(x[i * sx]); }
  __device__ double yv(int64_t i) const { return y ? static_cast<double>(y[i * sy]) : 0.0; }
  __device__ double wv(int64_t i) const { return w ? static_cast<double>(w[i * sw]) : 1.0; }
  __device__ bool valid(int64_t i) const { return m == nullptr || m[i * sm]; }
};

// One block: scans tiles of blockDim elements until a tile holds a good element.
template <class T, bool HasY>
__global__ void set_pivot_kernel(In<T> in, double* pivot) {
  __shared__ int64_t first;
  const bool need_x = is_nan(pivot[0]);
  const bool need_y = HasY && is_nan(pivot[1]);
  if (!need_x && !need_y) return;
  for (int64_t base = 0; base < in.n; base += blockDim.x) {
    if (threadIdx.x == 0) first = in.n;
    __syncthreads();
    const int64_t i = base + threadIdx.x;
    if (i < in.n && in.valid(i) && moments_good<HasY>(in.xv(i), in.yv(i), in.wv(i))) {
      atomicMin(reinterpret_cast<unsigned long long*>(&first), static_cast<unsigned long long>(i));
    }
    __syncthreads();
    const int64_t f = first;
    if (f < in.n) {
      if (threadIdx.x == 0) {
        if (need_x) pivot[0] = in.xv(f);
        if (need_y) pivot[1] = in.yv(f);
      }
      return;
    }
    __syncthreads();
  }
}

template <class T, bool HasY>
__global__ void moments_kernel(In<T> in, bool skip_bad, const double* pivot, double* state, double* bad) {
  __shared__ double scratch[kThreads / kWarp];
  const double px = pivot ? pivot_value(pivot[0]) : 0.0;
  const double py = pivot ? pivot_value(pivot[1]) : 0.0;
  Moments m;
  moments_zero(m);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < in.n; i += int64_t(gridDim.x) * blockDim.x) {
    if (!in.valid(i)) continue;
    moments_add<HasY>(m, in.xv(i), in.yv(i), in.wv(i), skip_bad, px, py);
  }
  for (int s = 0; s < kMomentsSize; ++s) {
    if (!HasY && s >= 3 && s < 8) continue;
    const double v = block_sum(m.v[s], scratch);
    if (threadIdx.x == 0 && v != 0.0) atomicAdd(state + s, v);
  }
  const double b = block_sum(m.bad, scratch);
  if (threadIdx.x == 0 && b != 0.0) atomicAdd(bad, b);
}

void weighted_moments_cuda(const at::Tensor& x, const std::optional<at::Tensor>& y,
                           const std::optional<at::Tensor>& weights, const std::optional<at::Tensor>& mask,
                           bool skip_bad, const at::Tensor& state, const at::Tensor& bad,
                           const std::optional<at::Tensor>& pivot) {
  check_weighted_moments(x, y, weights, mask, state, bad, pivot);
  const int64_t n = x.size(0);
  if (n == 0) return;
  const at::cuda::CUDAGuard guard(x.device());
  auto dtype = x.scalar_type();
  if (y.has_value()) dtype = c10::promoteTypes(dtype, y->scalar_type());
  if (weights.has_value()) dtype = c10::promoteTypes(dtype, weights->scalar_type());
  const at::Tensor xx = x.to(dtype);
  const std::optional<at::Tensor> yy = y.has_value() ? std::optional<at::Tensor>(y->to(dtype)) : std::nullopt;
  const std::optional<at::Tensor> ww =
      weights.has_value() ? std::optional<at::Tensor>(weights->to(dtype)) : std::nullopt;
  auto stream = at::cuda::getCurrentCUDAStream();
  double* piv = pivot.has_value() ? pivot->data_ptr<double>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "weighted_moments_cuda", [&] {
    In<scalar_t> in{xx.data_ptr<scalar_t>(),
                    yy ? yy->data_ptr<scalar_t>() : nullptr,
                    ww ? ww->data_ptr<scalar_t>() : nullptr,
                    mask_ptr(mask),
                    xx.stride(0),
                    yy ? yy->stride(0) : 0,
                    ww ? ww->stride(0) : 0,
                    mask.has_value() ? mask->stride(0) : 0,
                    n};
    const int blocks = blocks_for(n);
    if (yy.has_value()) {
      if (piv) {
        set_pivot_kernel<scalar_t, true><<<1, kThreads, 0, stream>>>(in, piv);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      moments_kernel<scalar_t, true><<<blocks, kThreads, 0, stream>>>(in, skip_bad, piv, state.data_ptr<double>(),
                                                                      bad.data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      if (piv) {
        set_pivot_kernel<scalar_t, false><<<1, kThreads, 0, stream>>>(in, piv);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      moments_kernel<scalar_t, false><<<blocks, kThreads, 0, stream>>>(in, skip_bad, piv, state.data_ptr<double>(),
                                                                       bad.data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("weighted_moments", &d9d::cuda::weighted_moments_cuda); }
