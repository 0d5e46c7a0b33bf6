// weighted_moments on CUDA: unset pivots are set first (first good element
// in index order), then one wave of blocks streams the inputs in 16-byte
// vectors with per-thread Moments, block reductions and one atomicAdd per slot
// per block. A one-block wave sets the pivots itself; a larger one is preceded
// by a one-block pivot kernel.
// Specification: d9d_kernels/reference.py::weighted_moments.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "../kernels/weighted_moments_checks.h"
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

// One block's threads together: scans tiles of blockDim elements until a
// tile holds a good element. Every exit is taken by the whole block.
template <class T, bool HasY>
__device__ void set_pivot(const In<T>& in, double* pivot) {
  __shared__ int first;  // offset in the tile: a native 32-bit shared atomicMin
  const bool need_x = is_nan(pivot[0]);
  const bool need_y = HasY && is_nan(pivot[1]);
  if (!need_x && !need_y) return;
  for (int64_t base = 0; base < in.n; base += blockDim.x) {
    if (threadIdx.x == 0) first = blockDim.x;
    __syncthreads();
    const int64_t i = base + threadIdx.x;
    if (i < in.n && in.valid(i) && moments_good<HasY>(in.xv(i), in.yv(i), in.wv(i))) {
      atomicMin(&first, static_cast<int>(threadIdx.x));
    }
    __syncthreads();
    const int f = first;
    if (f < static_cast<int>(blockDim.x)) {
      if (threadIdx.x == 0) {
        if (need_x) pivot[0] = in.xv(base + f);
        if (need_y) pivot[1] = in.yv(base + f);
      }
      return;
    }
    __syncthreads();
  }
}

template <class T, bool HasY>
__global__ void set_pivot_kernel(In<T> in, double* pivot) {
  set_pivot<T, HasY>(in, pivot);
}

// Vectors in flight per thread and loop trip (x, y, w: up to 6 16-byte loads).
constexpr int kUnroll = 2;

// The sums: one wave of blocks streams x / y / w (and the mask) in aligned
// 16-byte vectors, per-element math in double as the reference (float64
// sums), scalar head/tail; `split` is all-scalar when a stream is strided.
// Weights of stride 0 (a broadcast scalar) are one load. A one-block grid
// sets unset pivots itself (`own_pivot`): one launch instead of two for the
// small inputs (a 0-d loss) that most updates pass.
template <class T, bool HasY>
__global__ void __launch_bounds__(kThreads) moments_kernel(In<T> in, VecSplit split, bool skip_bad, bool own_pivot,
                                                           double* pivot, double* state, double* bad) {
  __shared__ double scratch[kThreads / kWarp];
  constexpr int V = kVec<T>;
  if (own_pivot) {
    set_pivot<T, HasY>(in, pivot);
    __syncthreads();  // thread 0's pivot writes are visible to the block
  }
  const double px = pivot ? pivot_value(pivot[0]) : 0.0;
  const double py = pivot ? pivot_value(pivot[1]) : 0.0;
  const bool w_vec = in.w != nullptr && in.sw == 1;
  const double w0 = in.w != nullptr && in.sw == 0 ? static_cast<double>(in.w[0]) : 1.0;
  Moments m;
  moments_zero(m);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t gid = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t h = split.head;
  int64_t v = gid;
  for (; v < split.nv; v += kUnroll * stride) {
    T xs[kUnroll][V], ys[kUnroll][V], ws[kUnroll][V];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t at = h + (v + u * stride) * V;
      if (v + u * stride < split.nv) {
        load_vec(in.x + at, xs[u]);
        if (HasY) load_vec(in.y + at, ys[u]);
        if (w_vec) load_vec(in.w + at, ws[u]);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t at = h + (v + u * stride) * V;
      if (v + u * stride >= split.nv) break;
      bool keep[V];
      if (in.m) load_mask<V>(in.m + at, keep);
#pragma unroll
      for (int k = 0; k < V; ++k) {
        if (in.m && !keep[k]) continue;
        moments_add<HasY>(m, static_cast<double>(xs[u][k]), HasY ? static_cast<double>(ys[u][k]) : 0.0,
                          w_vec ? static_cast<double>(ws[u][k]) : w0, skip_bad, px, py);
      }
    }
  }
  for (int64_t k = gid; k < split.n_scalar(in.n); k += stride) {
    const int64_t i = split.scalar_index(k);
    if (!in.valid(i)) continue;
    moments_add<HasY>(m, in.xv(i), in.yv(i), in.wv(i), skip_bad, px, py);
  }
  for (int s = 0; s < kMomentsSize; ++s) {
    if (!HasY && s >= 3 && s < 8) continue;
    const double t = block_sum(m.v[s], scratch);
    if (threadIdx.x == 0 && t != 0.0) atomicAdd(state + s, t);
  }
  const double b = block_sum(m.bad, scratch);
  if (threadIdx.x == 0 && b != 0.0) atomicAdd(bad, b);
}

template <class T, bool HasY>
void launch_moments(const In<T>& in, bool skip_bad, double* piv, double* state, double* bad, cudaStream_t stream) {
  // Vector loads need every stream contiguous (weights may be one broadcast
  // value) and at x's alignment; else the whole pass is the strided loop.
  constexpr int V = kVec<T>;
  const int64_t head = head_of<T>(in.x, in.n);
  const bool vec = in.sx == 1 && (!HasY || in.sy == 1) && (in.w == nullptr || in.sw <= 1) &&
                   (in.m == nullptr || in.sm == 1) && lines_up(HasY ? in.y : nullptr, head, sizeof(T), 16) &&
                   lines_up(in.sw == 1 ? in.w : nullptr, head, sizeof(T), 16) && lines_up(in.m, head, 1, V);
  const VecSplit split = vec_split(in.x, in.n, vec);
  const int64_t work = std::max<int64_t>((split.nv + kUnroll - 1) / kUnroll, split.n_scalar(in.n));
  const int blocks = one_wave(moments_kernel<T, HasY>, work);
  const bool own_pivot = piv != nullptr && blocks == 1;
  if (piv != nullptr && !own_pivot) {  // every block must read the same pivot
    set_pivot_kernel<T, HasY><<<1, kThreads, 0, stream>>>(in, piv);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  moments_kernel<T, HasY><<<blocks, kThreads, 0, stream>>>(in, split, skip_bad, own_pivot, piv, state, bad);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Inputs of one dtype are read in place; mixed dtypes are converted to the
// promoted one (integers: float64), which is exact.
void weighted_moments_cuda(const at::Tensor& x, const std::optional<at::Tensor>& y,
                           const std::optional<at::Tensor>& weights, const std::optional<at::Tensor>& mask,
                           bool skip_bad, const at::Tensor& state, const at::Tensor& bad,
                           const std::optional<at::Tensor>& pivot) {
  check_weighted_moments(x, y, weights, mask, state, bad, pivot);
  const int64_t n = x.size(0);
  if (n == 0) return;
  const at::cuda::CUDAGuard guard(x.device());
  auto dtype = real_dtype(x.scalar_type());  // integer inputs (a token count) as float64, exactly
  if (y.has_value()) dtype = c10::promoteTypes(dtype, real_dtype(y->scalar_type()));
  if (weights.has_value()) dtype = c10::promoteTypes(dtype, real_dtype(weights->scalar_type()));
  auto as = [&](const at::Tensor& t) { return t.scalar_type() == dtype ? t : t.to(dtype); };
  const at::Tensor xx = as(x);
  const std::optional<at::Tensor> yy = y.has_value() ? std::optional<at::Tensor>(as(*y)) : std::nullopt;
  const std::optional<at::Tensor> ww = weights.has_value() ? std::optional<at::Tensor>(as(*weights)) : std::nullopt;
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
    if (yy.has_value()) {
      launch_moments<scalar_t, true>(in, skip_bad, piv, state.data_ptr<double>(), bad.data_ptr<double>(), stream);
    } else {
      launch_moments<scalar_t, false>(in, skip_bad, piv, state.data_ptr<double>(), bad.data_ptr<double>(), stream);
    }
  });
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("weighted_moments", &d9d::cuda::weighted_moments_cuda); }
