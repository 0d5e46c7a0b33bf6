// Device helpers of the CUDA kernels: launch geometry, warp/block reductions,
// double atomics. Per-element math lives in csrc/kernels/*.h (shared with CPU).
#pragma once

#include <ATen/cuda/CUDAContext.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include "../kernels/common.h"

namespace d9d {
namespace cuda {

constexpr int kThreads = 256;
constexpr int kWarp = 32;

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

// Calls f(i, t) for each row i of [0, n) kept by mask / ignore_index
// (keep(i, t), t = target(i)): one warp per row, rows grid-strided over the
// warps of the launch, every lane of the warp in the call. f returns false
// to end this warp's loop.
template <class Target, class Keep, class F>
__device__ inline void for_kept_warp_rows(int64_t n, const Target& target, const Keep& keep, F&& f) {
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; i < n; i += warps) {
    const int64_t t = target(i);
    if (keep(i, t) && !f(i, t)) return;
  }
}

// Sum of a per-thread count over the block, added once to *g (a float64 state).
__device__ inline void add_block_count(uint32_t c, double* g) {
  __shared__ uint32_t total;  // callers bound a block's items below 2^32; a native 32-bit shared atomic
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  for (int o = kWarp / 2; o > 0; o /= 2) c += __shfl_xor_sync(0xffffffffu, c, o);
  if (threadIdx.x % kWarp == 0 && c != 0u) atomicAdd(&total, c);
  __syncthreads();
  if (threadIdx.x == 0 && total != 0u) atomicAdd(g, static_cast<double>(total));
}

// Resident blocks per SM of `kernel` (occupancy API, host-only: no sync and
// capturable), cached per (kernel, device, smem).
inline int blocks_per_sm(const void* kernel, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, int, size_t>, int> cache;
  const auto key = std::make_tuple(kernel, static_cast<int>(c10::cuda::current_device()), threads, smem);
  const std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem));
  cache.emplace(key, per_sm);
  return per_sm;
}

// Blocks of one full wave of `kernel`, capped by the blocks `work` items
// need: a grid-stride loop then runs every block to the end, no tail wave.
template <class K>
inline int one_wave(K kernel, int64_t work, int threads = kThreads, size_t smem = 0) {
  const int per_sm = blocks_per_sm(reinterpret_cast<const void*>(kernel), threads, smem);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = (work + threads - 1) / threads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, sms * std::max(per_sm, 1))));
}

// Elements per block are bounded so that uint32 counters cannot overflow.
constexpr int64_t kMaxPerBlock = int64_t(1) << 31;

// Block-private uint32 counters in dynamic shared memory (native ATOMS.ADD,
// not the float64 CAS loop), flushed into the float64 state once per block.
__device__ inline void counters_zero(uint32_t* s, int64_t n) {
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) s[k] = 0u;
  __syncthreads();
}

__device__ inline void counters_flush(const uint32_t* s, double* g, int64_t n) {
  __syncthreads();
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    if (s[k] != 0u) atomicAdd(g + k, static_cast<double>(s[k]));
  }
}

// Shared bytes for `slots` uint32 counters, or 0 when they do not fit the
// opt-in limit (the kernel then adds into the global state). The limits bound
// the kernel's static plus dynamic shared memory, so near them the static size
// is read; past the default 48 KiB the kernel's dynamic limit is raised.
template <class K>
inline size_t counter_smem(K kernel, int64_t slots) {
  const int64_t bytes = slots * static_cast<int64_t>(sizeof(uint32_t));
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  const int64_t fits = static_cast<int64_t>(prop->sharedMemPerBlock) - 1024;  // static smem is far below 1 KiB
  if (bytes <= fits) return static_cast<size_t>(bytes);
  cudaFuncAttributes attr;
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, reinterpret_cast<const void*>(kernel)));
  const int64_t total = bytes + static_cast<int64_t>(attr.sharedSizeBytes);
  if (total > static_cast<int64_t>(prop->sharedMemPerBlockOptin)) return 0;
  if (total > static_cast<int64_t>(prop->sharedMemPerBlock)) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  }
  return static_cast<size_t>(bytes);
}

// Blocks of one wave for `work` threads, at least enough that no block sees
// kMaxPerBlock entries, and (private counters) each block reads about as many
// entries as it flushes.
template <class K>
inline int counter_blocks(K kernel, int64_t work, int64_t entries, size_t smem, int64_t slots) {
  int blocks = one_wave(kernel, work, kThreads, smem);
  if (smem) blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, entries / std::max<int64_t>(slots, 1))));
  return static_cast<int>(std::max<int64_t>(blocks, (entries + kMaxPerBlock - 1) / kMaxPerBlock));
}

// 16-byte vectors of a 1-D input: [0, head) and [body_end, n) are scalar,
// [head, body_end) is `nv` aligned vectors of kVec<T> elements. Every stream
// that joins the vector loop must share x's alignment in elements, else
// head = body_end = n (all scalar, the strided path).
template <class T>
constexpr int kVec = 16 / sizeof(T);

struct VecSplit {
  int64_t head, nv, body_end;
  __host__ __device__ int64_t n_scalar(int64_t n) const { return head + (n - body_end); }
  // The k-th scalar index.
  __device__ int64_t scalar_index(int64_t k) const { return k < head ? k : body_end + (k - head); }
};

// Elements before the first 16-byte boundary of `p` (n if `p` is not even
// element-aligned).
template <class T>
inline int64_t head_of(const void* p, int64_t n) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  if (a % sizeof(T)) return n;
  return std::min<int64_t>(n, static_cast<int64_t>(((16 - a % 16) % 16) / sizeof(T)));
}

// `p` (element size `bytes`, may be null) sits at the same offset modulo
// `align` bytes as the vector start `head` of x: vector loads of it line up.
inline bool lines_up(const void* p, int64_t head, int64_t bytes, int64_t align) {
  return p == nullptr || (reinterpret_cast<uintptr_t>(p) + head * bytes) % align == 0;
}

template <class T>
inline VecSplit vec_split(const T* x, int64_t n, bool vector_ok) {
  if (!vector_ok) return VecSplit{n, 0, n};
  const int64_t head = head_of<T>(x, n);
  const int64_t nv = (n - head) / kVec<T>;
  return VecSplit{head, nv, head + nv * kVec<T>};
}

// One aligned 16-byte load (LDG.E.128) as kVec<T> elements.
template <class T>
__device__ inline void load_vec(const T* p, T (&out)[kVec<T>]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  static_assert(sizeof(raw) == sizeof(out), "16-byte vector");
  memcpy(&out, &raw, sizeof(raw));
}

// The kV mask bytes of one vector in a single load (kV = 2, 4, 8 or 16).
template <int kV>
__device__ inline void load_mask(const bool* m, bool (&out)[kV]) {
  if constexpr (kV == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(m);
    memcpy(&out, &raw, 16);
  } else if constexpr (kV == 8) {
    const uint2 raw = *reinterpret_cast<const uint2*>(m);
    memcpy(&out, &raw, 8);
  } else if constexpr (kV == 4) {
    const uint32_t raw = *reinterpret_cast<const uint32_t*>(m);
    memcpy(&out, &raw, 4);
  } else {
    const uint16_t raw = *reinterpret_cast<const uint16_t*>(m);
    memcpy(&out, &raw, 2);
  }
}

inline const bool* mask_ptr(const std::optional<at::Tensor>& m) {
  return m.has_value() ? m->data_ptr<bool>() : nullptr;
}

}  // namespace cuda
}  // namespace d9d
