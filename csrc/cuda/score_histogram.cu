// score_histogram on CUDA: per-block shared-memory [2, L, B] histograms when
// they fit in 48 KiB, else global atomics. Binary/multilabel: grid-stride over
// entries; multiclass: one warp per row (max, sum of exp, then binning).
// INPUT_AUTO raises a device flag in a first kernel (no host sync).
// Specification: d9d_kernels/reference.py::score_histogram.
#include <ATen/Dispatch.h>

#include "../cpu/binary_checks.h"
#include "../kernels/binary_stats.h"
#include "binary_entries.cuh"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

__device__ inline bool logits_of(const int* flag, bool fixed) { return flag ? (*flag != 0) : fixed; }

template <class T>
__global__ void entries_kernel(Entries<T> in, int64_t B, const int* flag, bool logits_fixed, bool shared_hist,
                               double* hist, double* bad) {
  extern __shared__ double sh[];
  const int64_t slots = 2 * in.L * B;
  double* h = shared_hist ? sh : hist;
  if (shared_hist) shared_zero(sh, slots);
  const bool logits = logits_of(flag, logits_fixed);
  double nbad = 0.0;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < in.n * in.L;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / in.L, j = e % in.L;
    const int64_t t = in.t(i, j);
    if (!in.keep(i, j, t)) continue;
    const double v = in.p(i, j);
    if (!binary_entry_ok(t, v)) {
      nbad += 1.0;
      continue;
    }
    atomicAdd(h + hist_slot(t == 1, j, bin_of(to_prob(v, logits), B), in.L, B), 1.0);
  }
  if (shared_hist) shared_flush(sh, hist, slots);
  __shared__ double scratch[kThreads / kWarp];
  nbad = block_sum(nbad, scratch);
  if (threadIdx.x == 0 && nbad != 0.0) atomicAdd(bad, nbad);
}

// Row i is valid: kept, target in [0, L), all scores finite (warp-uniform).
template <class T>
__device__ inline bool row_valid(const Entries<T>& in, int64_t i, int64_t t, int lane, double& mx, bool& outside) {
  bool finite = t >= 0 && t < in.L;
  mx = -INFINITY;
  outside = false;
  for (int64_t j = lane; finite && j < in.L; j += kWarp) {
    const double v = in.p(i, j);
    finite &= is_finite(v);
    outside |= outside_unit(v);
    mx = v > mx ? v : mx;
  }
  finite = __all_sync(0xffffffffu, finite);
  outside = __any_sync(0xffffffffu, outside);
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const double m2 = __shfl_xor_sync(0xffffffffu, mx, o);
    mx = m2 > mx ? m2 : mx;
  }
  return finite;
}

template <class T>
__global__ void any_logit_rows_kernel(Entries<T> in, int* flag) {
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; i < in.n; i += warps) {
    const int64_t t = in.t(i, 0);
    if (!in.keep(i, 0, t)) continue;
    double mx;
    bool outside;
    if (row_valid(in, i, t, lane, mx, outside) && outside) {
      if (lane == 0) *flag = 1;
      return;
    }
  }
}

template <class T>
__global__ void rows_kernel(Entries<T> in, int64_t B, const int* flag, bool logits_fixed, bool shared_hist,
                            double* hist, double* bad) {
  extern __shared__ double sh[];
  const int64_t slots = 2 * in.L * B;
  double* h = shared_hist ? sh : hist;
  if (shared_hist) shared_zero(sh, slots);
  const bool logits = logits_of(flag, logits_fixed);
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; i < in.n; i += warps) {
    const int64_t t = in.t(i, 0);
    if (!in.keep(i, 0, t)) continue;
    double mx;
    bool outside;
    if (!row_valid(in, i, t, lane, mx, outside)) {
      if (lane == 0) atomicAdd(bad, 1.0);
      continue;
    }
    double inv = 1.0;
    if (logits) {  // softmax as torch: exp(v - max) * (1 / sum)
      double sum = 0.0;
      for (int64_t j = lane; j < in.L; j += kWarp) sum += exp(in.p(i, j) - mx);
      inv = 1.0 / warp_sum(sum);
    }
    for (int64_t j = lane; j < in.L; j += kWarp) {
      const double v = in.p(i, j);
      const double prob = logits ? exp(v - mx) * inv : v;
      atomicAdd(h + hist_slot(j == t, j, bin_of(prob, B), in.L, B), 1.0);
    }
  }
  if (shared_hist) shared_flush(sh, hist, slots);
}

void score_histogram_cuda(const at::Tensor& preds, const at::Tensor& target, const std::optional<at::Tensor>& mask,
                          std::optional<int64_t> ignore_index, int64_t input_kind, bool multiclass,
                          const at::Tensor& hist, const at::Tensor& bad) {
  check_score_histogram(preds, target, mask, input_kind, multiclass, hist, bad);
  if (preds.numel() == 0) return;
  const at::cuda::CUDAGuard guard(preds.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t B = hist.size(2);
  const int64_t slots = 2 * preds.size(1) * B;
  const bool shared_hist = slots <= kSharedSlots;
  const size_t smem = shared_hist ? slots * sizeof(double) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, preds.scalar_type(), "score_histogram_cuda", [&] {
    const auto in = make_entries<scalar_t>(preds, target, mask, ignore_index);
    at::Tensor flag;
    if (input_kind == kInputAuto) flag = at::zeros({1}, target.options().dtype(at::kInt));
    int* fl = flag.defined() ? flag.data_ptr<int>() : nullptr;
    const bool fixed = input_kind == kInputLogits;
    if (multiclass) {
      const int blocks = blocks_for(in.n * kWarp);
      if (fl) {
        any_logit_rows_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(in, fl);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      rows_kernel<scalar_t><<<blocks, kThreads, smem, stream>>>(in, B, fl, fixed, shared_hist,
                                                                hist.data_ptr<double>(), bad.data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      const int blocks = blocks_for(in.n * in.L);
      if (fl) {
        any_logit_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(in, fl);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      entries_kernel<scalar_t><<<blocks, kThreads, smem, stream>>>(in, B, fl, fixed, shared_hist,
                                                                   hist.data_ptr<double>(), bad.data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("score_histogram", &d9d::cuda::score_histogram_cuda); }
