// binary_stats on CUDA: one wave of blocks walks the N*L entries (16-byte
// vectors when contiguous), counts in uint32 (registers for one label,
// block-private shared memory for more) flushed once per block as float64,
// and for INPUT_AUTO a first kernel that raises a device flag ("any valid
// pred outside [0, 1]") read by the second: no host sync.
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
template <bool L1, class T, class TT>
__global__ void __launch_bounds__(kThreads) binary_kernel(Entries<T, TT> in, Walk w, const int* logit_flag,
                                                          bool logits_fixed, Threshold thr, bool shared_counts,
                                                          double* state, double* bad) {
  extern __shared__ uint32_t counts[];
  if (!L1 && shared_counts) counters_zero(counts, in.L * 4);
  const bool logits = logit_flag ? (*logit_flag != 0) : logits_fixed;
  uint32_t bad_target = 0, bad_pred = 0, c0 = 0, c1 = 0, c2 = 0, c3 = 0;
  for_each_entry<L1>(in, w, [&](int64_t j, double v, int64_t t, bool keep) {
    if (!keep) return;
    const int cause = binary_bad_cause(t, v);
    if (cause >= 0) {
      bad_target += cause == 0;
      bad_pred += cause == 1;
      return;
    }
    const int c = binary_cell(is_positive(v, logits, thr), t == 1);
    if (L1) {
      c0 += c == 0;
      c1 += c == 1;
      c2 += c == 2;
      c3 += c == 3;
    } else if (shared_counts) {
      atomicAdd(counts + j * 4 + c, 1u);
    } else {
      atomicAdd(state + j * 4 + c, 1.0);
    }
  });
  if (L1) {
    add_block_count(c0, state + 0);
    add_block_count(c1, state + 1);
    add_block_count(c2, state + 2);
    add_block_count(c3, state + 3);
  } else if (shared_counts) {
    counters_flush(counts, state, in.L * 4);
  }
  add_block_count(bad_target, bad);
  add_block_count(bad_pred, bad + 1);
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
    at::Tensor flag;
    if (input_kind == kInputAuto) {
      flag = at::zeros({1}, target.options().dtype(at::kInt));
      auto* k = any_logit_kernel<L1, T, TT>;
      k<<<one_wave(k, entries), kThreads, 0, stream>>>(in, walk, flag.data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    auto* k = binary_kernel<L1, T, TT>;
    const size_t smem = L1 ? 0 : counter_smem(k, L * 4);
    k<<<counter_blocks(k, entries, entries, smem, L1 ? 0 : L * 4), kThreads, smem, stream>>>(
        in, walk, flag.defined() ? flag.data_ptr<int>() : nullptr, input_kind == kInputLogits,
        make_threshold(threshold), smem != 0, state.data_ptr<double>(), bad.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("binary_stats", &d9d::cuda::binary_stats_cuda); }
