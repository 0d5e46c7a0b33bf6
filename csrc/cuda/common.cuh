// Device helpers of the CUDA kernels: launch geometry, warp/block reductions,
// double atomics. Per-element math lives in csrc/kernels/*.h (shared with CPU).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "../kernels/common.h"

namespace d9d {
namespace cuda {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
// Private shared-memory accumulators per block up to this many doubles (48 KiB,
// the default dynamic shared-memory limit); larger states use global atomics.
constexpr int64_t kSharedSlots = 6144;

// Blocks for `work` items: enough to fill the GPU, grid-stride beyond that.
inline int blocks_for(int64_t work, int per_block = kThreads) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = (work + per_block - 1) / per_block;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, sms * 8)));
}

__device__ inline double warp_sum(double v) {
  for (int o = kWarp / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block, valid in thread 0. `scratch` holds kThreads / kWarp doubles.
__device__ inline double block_sum(double v, double* scratch) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = threadIdx.x < blockDim.x / kWarp ? scratch[threadIdx.x] : 0.0;
  if (warp == 0) v = warp_sum(v);
  return v;
}

// *addr = torch.maximum(*addr, v) (NaN wins), atomically.
__device__ inline void atomic_nan_max(double* addr, double v) {
  unsigned long long* a = reinterpret_cast<unsigned long long*>(addr);
  unsigned long long old = *a, assumed;
  do {
    assumed = old;
    const double cur = __longlong_as_double(static_cast<long long>(assumed));
    const double nv = (is_nan(cur) || is_nan(v)) ? NAN : (cur > v ? cur : v);
    const unsigned long long nb = static_cast<unsigned long long>(__double_as_longlong(nv));
    if (nb == assumed) return;
    old = atomicCAS(a, assumed, nb);
  } while (old != assumed);
}

// Zero `n` shared doubles, then sync.
__device__ inline void shared_zero(double* s, int64_t n) {
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s[i] = 0.0;
  __syncthreads();
}

// Add `n` shared doubles into global memory (non-zero ones only), after a sync.
__device__ inline void shared_flush(const double* s, double* g, int64_t n) {
  __syncthreads();
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    if (s[i] != 0.0) atomicAdd(g + i, s[i]);
  }
}

inline const bool* mask_ptr(const std::optional<at::Tensor>& m) {
  return m.has_value() ? m->data_ptr<bool>() : nullptr;
}

}  // namespace cuda
}  // namespace d9d
