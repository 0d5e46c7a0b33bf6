// binary_stats on CUDA: grid-stride over the N*L entries, per-block
// shared-memory [L, 4] counts (global atomics when L is too large), and for
// INPUT_AUTO a first kernel that raises a device flag ("any valid pred
// outside [0, 1]") read by the second: no host sync.
// Specification: d9d_kernels/reference.py::binary_stats.
#include <ATen/Dispatch.h>

#include "../cpu/binary_checks.h"
#include "../kernels/binary_stats.h"
#include "binary_entries.cuh"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

template <class T>
__global__ void binary_kernel(Entries<T> in, const int* logit_flag, bool logits_fixed, Threshold thr,
                              bool shared_counts, double* state, double* bad) {
  extern __shared__ double sh[];
  double* counts = shared_counts ? sh : state;
  if (shared_counts) shared_zero(sh, in.L * 4);
  const bool logits = logit_flag ? (*logit_flag != 0) : logits_fixed;
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
    atomicAdd(counts + j * 4 + binary_cell(is_positive(v, logits, thr), t == 1), 1.0);
  }
  if (shared_counts) shared_flush(sh, state, in.L * 4);
  __shared__ double scratch[kThreads / kWarp];
  nbad = block_sum(nbad, scratch);
  if (threadIdx.x == 0 && nbad != 0.0) atomicAdd(bad, nbad);
}

void binary_stats_cuda(const at::Tensor& preds_in, const at::Tensor& target, const std::optional<at::Tensor>& mask,
                       double threshold, std::optional<int64_t> ignore_index, int64_t input_kind,
                       const at::Tensor& state, const at::Tensor& bad) {
  check_binary_stats(preds_in, target, mask, input_kind, state, bad);
  if (preds_in.numel() == 0) return;
  const at::cuda::CUDAGuard guard(preds_in.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  const bool is_float = at::isFloatingType(preds_in.scalar_type());
  const at::Tensor preds = is_float ? preds_in : preds_in.to(at::kFloat);
  if (!is_float) input_kind = kInputProbs;
  const int64_t L = preds.size(1);
  const bool shared_counts = L * 4 <= kSharedSlots;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, preds.scalar_type(), "binary_stats_cuda", [&] {
    const auto in = make_entries<scalar_t>(preds, target, mask, ignore_index);
    const int blocks = blocks_for(in.n * in.L);
    at::Tensor flag;
    if (input_kind == kInputAuto) {
      flag = at::zeros({1}, target.options().dtype(at::kInt));
      any_logit_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(in, flag.data_ptr<int>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    binary_kernel<scalar_t><<<blocks, kThreads, shared_counts ? L * 4 * sizeof(double) : 0, stream>>>(
        in, flag.defined() ? flag.data_ptr<int>() : nullptr, input_kind == kInputLogits, make_threshold(threshold), shared_counts,
        state.data_ptr<double>(), bad.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("binary_stats", &d9d::cuda::binary_stats_cuda); }
