// running_extrema on CUDA: one wave of blocks streams x in aligned 16-byte
// vectors (scalar head/tail, or all scalar when x/mask are strided), keeps
// max / -min in x's own precision (float for half/bfloat16: exact) with NaN
// as a separate flag, then one NaN-propagating double max per block.
// Specification: d9d_kernels/reference.py::running_extrema.
#include <ATen/Dispatch.h>
#include <torch/library.h>
#include <ATen/OpMathType.h>

#include "../kernels/running_extrema_checks.h"
#include "../kernels/running_extrema.h"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

// Per-thread extrema in the compute type A of x. fmax ignores NaN, so NaN is
// a flag applied at the end (torch.maximum: any NaN makes the result NaN).
template <class A>
struct Ext {
  A mx = -INFINITY, nmn = -INFINITY;
  bool nan = false;
  uint32_t bad = 0;  // at most elements per thread (< 2^32 by the grid-stride bound)
  __device__ void add(A v) {
    bad += (v - v == A(0)) ? 0u : 1u;
    nan |= v != v;
    mx = fmax(mx, v);
    nmn = fmax(nmn, -v);
  }
  __device__ void merge_lane(int o) {
    mx = fmax(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    nmn = fmax(nmn, __shfl_xor_sync(0xffffffffu, nmn, o));
    nan |= __shfl_xor_sync(0xffffffffu, static_cast<int>(nan), o) != 0;
    bad += __shfl_xor_sync(0xffffffffu, bad, o);
  }
};

// Vectors in flight per thread and loop trip (independent 16-byte loads).
constexpr int kUnroll = 4;

template <class T>
__global__ void __launch_bounds__(kThreads) extrema_kernel(const T* x, int64_t sx, const bool* m, int64_t sm,
                                                           int64_t n, VecSplit split, bool skip_bad, double* state,
                                                           double* bad) {
  using A = at::opmath_type<T>;
  constexpr int V = kVec<T>;
  Ext<A> e;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t gid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const T* xv = x + split.head;
  const bool* mv = m ? m + split.head : nullptr;
  int64_t v = gid;
  for (; v + (kUnroll - 1) * stride < split.nv; v += kUnroll * stride) {
    T buf[kUnroll][V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load_vec(xv + (v + u * stride) * V, buf[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      bool keep[V];
      if (mv) load_mask<V>(mv + (v + u * stride) * V, keep);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if (!mv || keep[k]) e.add(static_cast<A>(buf[u][k]));
      }
    }
  }
  for (; v < split.nv; v += stride) {
    T buf[V];
    load_vec(xv + v * V, buf);
    bool keep[V];
    if (mv) load_mask<V>(mv + v * V, keep);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      if (!mv || keep[k]) e.add(static_cast<A>(buf[k]));
    }
  }
  for (int64_t k = gid; k < split.n_scalar(n); k += stride) {
    const int64_t i = split.scalar_index(k);
    if (m && !m[i * sm]) continue;
    e.add(static_cast<A>(x[i * sx]));
  }
  for (int o = kWarp / 2; o > 0; o /= 2) e.merge_lane(o);
  __shared__ Ext<A> part[kThreads / kWarp];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) part[warp] = e;
  __syncthreads();
  if (threadIdx.x == 0) {
    Ext<A> t = part[0];
    uint64_t nbad = t.bad;
    for (int w = 1; w < kThreads / kWarp; ++w) {
      t.mx = fmax(t.mx, part[w].mx);
      t.nmn = fmax(t.nmn, part[w].nmn);
      t.nan |= part[w].nan;
      nbad += part[w].bad;
    }
    const bool nan = t.nan && !skip_bad;
    atomic_nan_max(state, nan ? NAN : static_cast<double>(t.mx));
    atomic_nan_max(state + 1, nan ? NAN : static_cast<double>(t.nmn));
    if (nbad != 0) atomicAdd(bad, static_cast<double>(nbad));
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
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const bool* mp = mask_ptr(mask);
    const int64_t sm = mask.has_value() ? mask->stride(0) : 0;
    const bool contiguous = x.stride(0) == 1 && (mp == nullptr || sm == 1);
    const int64_t head = head_of<scalar_t>(xp, n);
    const VecSplit split = vec_split(xp, n, contiguous && lines_up(mp, head, 1, kVec<scalar_t>));
    const int64_t work = std::max<int64_t>((split.nv + kUnroll - 1) / kUnroll, split.n_scalar(n));
    const int blocks = one_wave(extrema_kernel<scalar_t>, work);
    extrema_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(xp, x.stride(0), mp, sm, n, split, skip_bad,
                                                              state.data_ptr<double>(), bad.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("running_extrema", &d9d::cuda::running_extrema_cuda); }
