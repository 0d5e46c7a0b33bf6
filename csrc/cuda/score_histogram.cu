// score_histogram on CUDA: block-private uint32 [2, L, B] histograms in
// shared memory (opt-in beyond 48 KiB: 2 x 10k bins fit), flushed once per
// block as float64, else global atomics. Binary/multilabel: the entries walk
// of binary_entries.cuh; multiclass: one warp per row.
// INPUT_AUTO raises a device flag in a first kernel (no host sync).
// Specification: d9d_kernels/reference.py::score_histogram.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "../kernels/binary_checks.h"
#include "../kernels/binary_stats.h"
#include "binary_entries.cuh"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

__device__ inline bool logits_of(const int* flag, bool fixed) { return flag ? (*flag != 0) : fixed; }

// Counters: block-private uint32 [2, L, B] histograms in (opt-in) shared
// memory flushed once per block, else float64 global atomics.
__device__ inline void count_bin(uint32_t* sh, double* hist, bool shared_hist, int64_t slot) {
  if (shared_hist) {
    atomicAdd(sh + slot, 1u);
  } else {
    atomicAdd(hist + slot, 1.0);
  }
}

template <bool L1, class T, class TT>
__global__ void __launch_bounds__(kThreads) entries_kernel(Entries<T, TT> in, Walk w, int64_t B, const int* flag,
                                                           bool logits_fixed, bool shared_hist, double* hist,
                                                           double* bad) {
  extern __shared__ uint32_t sh[];
  const int64_t L = L1 ? 1 : in.L;
  const int64_t slots = 2 * L * B;
  if (shared_hist) counters_zero(sh, slots);
  const bool logits = logits_of(flag, logits_fixed);
  uint32_t bad_target = 0, bad_pred = 0;
  for_each_entry<L1>(in, w, [&](int64_t j, double v, int64_t t, bool keep) {
    if (!keep || binary_count_bad(t, v, bad_target, bad_pred)) return;
    count_bin(sh, hist, shared_hist, hist_slot(t == 1, j, bin_of(to_prob(v, logits), B), L, B));
  });
  if (shared_hist) counters_flush(sh, hist, slots);
  add_block_count(bad_target, bad);
  add_block_count(bad_pred, bad + 1);
}

// Row i is valid: kept, target in [0, L), all scores finite (warp-uniform).
template <class T, class TT>
__device__ inline bool row_valid(const Entries<T, TT>& in, int64_t i, int64_t t, int lane, double& mx,
                                 bool& outside) {
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

template <class T, class TT>
__global__ void __launch_bounds__(kThreads) any_logit_rows_kernel(Entries<T, TT> in, int* flag) {
  const int lane = threadIdx.x % kWarp;
  const auto target = [&](int64_t i) { return in.t(i, 0); };
  const auto keep = [&](int64_t i, int64_t t) { return in.keep(i, 0, t); };
  for_kept_warp_rows(in.n, target, keep, [&](int64_t i, int64_t t) {
    double mx;
    bool outside;
    if (row_valid(in, i, t, lane, mx, outside) && outside) {
      if (lane == 0) *flag = 1;
      return false;
    }
    return true;
  });
}

// Multiclass: one warp per row (max, sum of exp, then binning).
template <class T, class TT>
__global__ void __launch_bounds__(kThreads) rows_kernel(Entries<T, TT> in, int64_t B, const int* flag,
                                                        bool logits_fixed, bool shared_hist, double* hist,
                                                        double* bad) {
  extern __shared__ uint32_t sh[];
  const int64_t slots = 2 * in.L * B;
  if (shared_hist) counters_zero(sh, slots);
  const bool logits = logits_of(flag, logits_fixed);
  const int lane = threadIdx.x % kWarp;
  // bad rows by cause in one register pair: bad targets in the low word, bad
  // scores in the high one (the row loop keeps one captured counter in
  // registers; two put its state on the stack, test_sass)
  uint64_t nbad = 0;
  const auto target = [&](int64_t i) { return in.t(i, 0); };
  const auto keep = [&](int64_t i, int64_t t) { return in.keep(i, 0, t); };
  for_kept_warp_rows(in.n, target, keep, [&](int64_t i, int64_t t) {
    double mx;
    bool outside;
    if (!row_valid(in, i, t, lane, mx, outside)) {  // a bad target is counted as that, whatever the scores hold
      if (lane == 0) nbad += t >= 0 && t < in.L ? uint64_t(1) << 32 : uint64_t(1);
      return true;
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
      count_bin(sh, hist, shared_hist, hist_slot(j == t, j, bin_of(prob, B), in.L, B));
    }
    return true;
  });
  if (shared_hist) counters_flush(sh, hist, slots);
  add_block_count(static_cast<uint32_t>(nbad), bad);
  add_block_count(static_cast<uint32_t>(nbad >> 32), bad + 1);
}

void score_histogram_cuda(const at::Tensor& preds, const at::Tensor& target, const std::optional<at::Tensor>& mask,
                          std::optional<int64_t> ignore_index, int64_t input_kind, bool multiclass,
                          const at::Tensor& hist, const at::Tensor& bad) {
  check_score_histogram(preds, target, mask, input_kind, multiclass, hist, bad, native_target(target.scalar_type()));
  if (preds.numel() == 0) return;
  const at::cuda::CUDAGuard guard(preds.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const int64_t B = hist.size(2);
  const int64_t slots = 2 * preds.size(1) * B;
  // L = 1 only matters for the entries walk; rows always have L >= 1 labels.
  D9D_DISPATCH_ENTRIES(preds.scalar_type(), target.scalar_type(), !multiclass && preds.size(1) == 1,
                       "score_histogram_cuda", [&] {
    const auto in = make_entries<T, TT>(preds, target, mask, ignore_index);
    const int64_t entries = in.n * in.L;
    at::Tensor flag;
    if (input_kind == kInputAuto) flag = at::zeros({1}, target.options().dtype(at::kInt));
    int* fl = flag.defined() ? flag.data_ptr<int>() : nullptr;
    const bool fixed = input_kind == kInputLogits;
    if (multiclass) {
      if (L1) return;  // not instantiated for rows: multiclass never takes the L1 branch
      if (fl) {
        auto* k = any_logit_rows_kernel<T, TT>;
        k<<<one_wave(k, in.n * kWarp), kThreads, 0, stream>>>(in, fl);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      auto* k = rows_kernel<T, TT>;
      const size_t smem = counter_smem(k, slots);
      k<<<counter_blocks(k, in.n * kWarp, entries, smem, slots), kThreads, smem,
          stream>>>(in, B, fl, fixed, smem != 0, hist.data_ptr<double>(), bad.data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      const Walk walk = make_walk<T, TT>(preds, target, mask);
      if (fl) {
        auto* k = any_logit_kernel<L1, T, TT>;
        k<<<one_wave(k, entries), kThreads, 0, stream>>>(in, walk, fl);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      auto* k = entries_kernel<L1, T, TT>;
      const size_t smem = counter_smem(k, slots);
      k<<<counter_blocks(k, entries, entries, smem, slots), kThreads, smem, stream>>>(
          in, walk, B, fl, fixed, smem != 0, hist.data_ptr<double>(), bad.data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("score_histogram", &d9d::cuda::score_histogram_cuda); }
