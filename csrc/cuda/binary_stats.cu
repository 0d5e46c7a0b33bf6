// binary_stats on CUDA: one wave of blocks walks the N*L entries (16-byte
// vectors when contiguous), counts in uint32 (registers for one label,
// block-private shared memory for more) flushed once per block as float64.
// INPUT_AUTO ("logits if any valid pred lies outside [0, 1]") never syncs
// the host: one label counts both readings in the same pass and a one-warp
// kernel keeps the chosen one; more labels run a first kernel that raises a
// device flag read by the second.
// Specification: d9d_kernels/reference.py::binary_stats.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "../kernels/binary_checks.h"
#include "../kernels/binary_stats.h"
#include "binary_entries.cuh"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

// One label: the 4 counts live in registers (no atomics at all until the
// block flush). More labels: block-private uint32 [L, 4] counters in shared
// memory, or float64 global atomics when even the opt-in limit is too small.
// BOTH (one label, INPUT_AUTO): one pass counts the cells under both readings
// of the preds, probabilities and logits, into both[0:4] / both[4:8], and
// raises both[8] for a valid pred outside [0, 1]; pick_kernel then adds the
// reading the flag chose to the state (no second read of preds and target).
template <bool L1, bool BOTH, class T, class TT>
__global__ void __launch_bounds__(kThreads) binary_kernel(Entries<T, TT> in, Walk w, const int* logit_flag,
                                                          bool logits_fixed, Threshold thr, bool shared_counts,
                                                          double* state, double* bad, double* both) {
  extern __shared__ uint32_t counts[];
  if (!L1 && shared_counts) counters_zero(counts, in.L * 4);
  const bool logits = logit_flag ? (*logit_flag != 0) : logits_fixed;
  uint32_t bad_target = 0, bad_pred = 0, c[4] = {0, 0, 0, 0}, d[4] = {0, 0, 0, 0};
  bool outside = false;
  for_each_entry<L1>(in, w, [&](int64_t j, double v, int64_t t, bool keep) {
    if (!keep || binary_count_bad(t, v, bad_target, bad_pred)) return;
    if (BOTH) {
      const int cp = binary_cell(is_positive(v, false, thr), t == 1);
      const int cl = binary_cell(is_positive(v, true, thr), t == 1);
      outside |= outside_unit(v);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        c[k] += cp == k;
        d[k] += cl == k;
      }
      return;
    }
    const int cell = binary_cell(is_positive(v, logits, thr), t == 1);
    if (L1) {
#pragma unroll
      for (int k = 0; k < 4; ++k) c[k] += cell == k;
    } else if (shared_counts) {
      atomicAdd(counts + j * 4 + cell, 1u);
    } else {
      atomicAdd(state + j * 4 + cell, 1.0);
    }
  });
  if (BOTH) {
    for (int k = 0; k < 4; ++k) {
      add_block_count(c[k], both + k);
      add_block_count(d[k], both + 4 + k);
    }
    if (__syncthreads_or(outside) && threadIdx.x == 0) both[8] = 1.0;  // benign race: every writer stores 1
  } else if (L1) {
    for (int k = 0; k < 4; ++k) add_block_count(c[k], state + k);
  } else if (shared_counts) {
    counters_flush(counts, state, in.L * 4);
  }
  add_block_count(bad_target, bad);
  add_block_count(bad_pred, bad + 1);
}

// state[0:4] += the counts of the reading INPUT_AUTO chose (both[8]: logits).
__global__ void pick_kernel(const double* both, double* state) {
  const int k = threadIdx.x;
  if (k < 4) state[k] += both[(both[8] != 0.0 ? 4 : 0) + k];
}

void binary_stats_cuda(const at::Tensor& preds_in, const at::Tensor& target, const std::optional<at::Tensor>& mask,
                       double threshold, std::optional<int64_t> ignore_index, int64_t input_kind,
                       const at::Tensor& state, const at::Tensor& bad) {
  check_binary_stats(preds_in, target, mask, input_kind, state, bad, native_target(target.scalar_type()));
  if (preds_in.numel() == 0) return;
  const at::cuda::CUDAGuard guard(preds_in.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool is_float = at::isFloatingType(preds_in.scalar_type());
  const at::Tensor preds = is_float ? preds_in : preds_in.to(at::kFloat);
  if (!is_float) input_kind = kInputProbs;
  const int64_t L = preds.size(1);
  D9D_DISPATCH_ENTRIES(preds.scalar_type(), target.scalar_type(), L == 1, "binary_stats_cuda", [&] {
    const auto in = make_entries<T, TT>(preds, target, mask, ignore_index);
    const Walk walk = make_walk<T, TT>(preds, target, mask);
    const int64_t entries = in.n * in.L;
    if (L1 && input_kind == kInputAuto) {
      const at::Tensor both = at::zeros({9}, state.options());
      auto* k = binary_kernel<true, true, T, TT>;
      k<<<counter_blocks(k, entries, entries, 0, 0), kThreads, 0, stream>>>(
          in, walk, nullptr, false, make_threshold(threshold), false, state.data_ptr<double>(),
          bad.data_ptr<double>(), both.data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      pick_kernel<<<1, kWarp, 0, stream>>>(both.data_ptr<double>(), state.data_ptr<double>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
    at::Tensor flag;
    if (input_kind == kInputAuto) {
      flag = at::zeros({1}, target.options().dtype(at::kInt));
      auto* k = any_logit_kernel<L1, T, TT>;
      k<<<one_wave(k, entries), kThreads, 0, stream>>>(in, walk, flag.data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    auto* k = binary_kernel<L1, false, T, TT>;
    const size_t smem = L1 ? 0 : counter_smem(k, L * 4);
    k<<<counter_blocks(k, entries, entries, smem, L1 ? 0 : L * 4), kThreads, smem, stream>>>(
        in, walk, flag.defined() ? flag.data_ptr<int>() : nullptr, input_kind == kInputLogits,
        make_threshold(threshold), smem != 0, state.data_ptr<double>(), bad.data_ptr<double>(), nullptr);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("binary_stats", &d9d::cuda::binary_stats_cuda); }
