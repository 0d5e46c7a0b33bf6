// class_stats on CUDA.
//  * index preds: one thread per row; counts in a per-block shared-memory
//    histogram (stats [3, C] + confmat [C, C]) when it fits, else global atomics.
//  * score rows: one warp per row. Pass 0 over the row checks validity,
//    folds the online log-sum-exp and selects the best class; top-k takes
//    k - 1 more selection passes ("best class ranked behind the previous
//    pick", the tie rule of ranks_ahead), so no per-row sort or buffer is
//    needed; counts go to global memory with atomics (a few per row).
// Specification: d9d_kernels/reference.py::class_stats.
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include "../kernels/class_stats_checks.h"
#include "../kernels/class_stats.h"
#include "common.cuh"

namespace d9d {
namespace cuda {
namespace {

struct Rows {
  const int64_t* target;
  int64_t st;
  const bool* mask;
  int64_t sm;
  int64_t n, C;
  bool has_ignore;
  int64_t ignore_index;
  __device__ bool keep(int64_t i, int64_t t) const {
    return kept(mask == nullptr || mask[i * sm], has_ignore, t, ignore_index);
  }
};

// top_ks by value: a kernel parameter, no host-to-device copy per call.
struct TopKs {
  int64_t k[kWarp];
};

struct Out {
  double* stats;
  double* confmat;
  double* extras;
  double* bad;
};

__global__ void indices_kernel(Rows r, const int64_t* preds, int64_t sp, Out o, bool shared_hist) {
  extern __shared__ double sh[];
  const int64_t C = r.C;
  const int64_t n_stats = 3 * C, n_conf = o.confmat ? C * C : 0;
  double* s_stats = shared_hist ? sh : o.stats;
  double* s_conf = shared_hist ? sh + n_stats : o.confmat;
  if (shared_hist) shared_zero(sh, n_stats + n_conf);
  double rows = 0.0, bad = 0.0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < r.n; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = r.target[i * r.st];
    if (!r.keep(i, t)) continue;
    const int64_t p = preds[i * sp];
    if (!class_in_range(t, C) || !class_in_range(p, C)) {
      bad += 1.0;
      continue;
    }
    if (p == t) atomicAdd(s_stats + stats_tp(0, t, C), 1.0);
    atomicAdd(s_stats + stats_pred(0, p, C), 1.0);
    atomicAdd(s_stats + stats_target(0, t, C), 1.0);
    if (s_conf) atomicAdd(s_conf + t * C + p, 1.0);
    rows += 1.0;
  }
  if (shared_hist) {
    shared_flush(sh, o.stats, n_stats);
    if (n_conf) shared_flush(sh + n_stats, o.confmat, n_conf);
  }
  __shared__ double scratch[kThreads / kWarp];
  rows = block_sum(rows, scratch);
  bad = block_sum(bad, scratch);
  if (threadIdx.x == 0) {
    if (rows != 0.0) atomicAdd(o.extras, rows);
    if (bad != 0.0) atomicAdd(o.bad, bad);
  }
}

// The best of two candidates (score, class); class -1 = none.
__device__ inline void pick_better(double& s, int64_t& j, double s2, int64_t j2) {
  if (j2 >= 0 && (j < 0 || ranks_ahead(s2, j2, s, j))) {
    s = s2;
    j = j2;
  }
}

__device__ inline void warp_pick(double& s, int64_t& j) {
  for (int o = kWarp / 2; o > 0; o /= 2) {
    const double s2 = __shfl_xor_sync(0xffffffffu, s, o);
    const int64_t j2 = __shfl_xor_sync(0xffffffffu, j, o);
    pick_better(s, j, s2, j2);
  }
}

template <class T>
__global__ void scores_kernel(Rows r, const T* preds, int64_t row_stride, TopKs top_ks, int K, int kmax,
                              bool nll, Out o) {
  const int lane = threadIdx.x % kWarp;
  const int64_t C = r.C;
  const auto target = [&](int64_t i) { return r.target[i * r.st]; };
  const auto keep = [&](int64_t i, int64_t t) { return r.keep(i, t); };
  for_kept_warp_rows(r.n, target, keep, [&](int64_t i, int64_t t) {
    if (!class_in_range(t, C)) {
      if (lane == 0) atomicAdd(o.bad, 1.0);
      return true;
    }
    const T* row = preds + i * row_stride;
    // pass 0: validity (no NaN/+Inf, not all -Inf), online lse, best class
    bool finite = true;
    Lse l = lse_init();
    double bs = 0.0;
    int64_t bj = -1;
    for (int64_t j = lane; j < C; j += kWarp) {
      const double v = static_cast<double>(row[j]);
      finite &= score_ok(v);
      if (nll) lse_add(l, v);
      pick_better(bs, bj, v, j);
    }
    finite = __all_sync(0xffffffffu, finite);
    warp_pick(bs, bj);  // every lane: the row's best (bs = -Inf: all scores masked)
    if (!finite || bs == -INFINITY) {
      if (lane == 0) atomicAdd(o.bad, 1.0);
      return true;
    }
    if (nll) {
      for (int off = kWarp / 2; off > 0; off /= 2) {
        Lse other{__shfl_xor_sync(0xffffffffu, l.m, off), __shfl_xor_sync(0xffffffffu, l.s, off)};
        lse_merge(l, other);
      }
    }
    int rank_t = kmax;
    const int64_t argmax = bj;
    for (int rk = 0; rk < kmax; ++rk) {
      if (rk > 0) {  // best class ranked behind the previous pick (bs, bj)
        const double ps = bs;
        const int64_t pj = bj;
        bs = 0.0;
        bj = -1;
        for (int64_t j = lane; j < C; j += kWarp) {
          const double v = static_cast<double>(row[j]);
          if (ranks_ahead(ps, pj, v, j)) pick_better(bs, bj, v, j);
        }
        warp_pick(bs, bj);
      }
      if (bj == t) rank_t = rk;
      if (lane < K && rk < top_ks.k[lane]) atomicAdd(o.stats + stats_pred(lane, bj, C), 1.0);
    }
    if (lane < K) {
      if (rank_t < top_ks.k[lane]) atomicAdd(o.stats + stats_tp(lane, t, C), 1.0);
      atomicAdd(o.stats + stats_target(lane, t, C), 1.0);
    }
    if (lane == 0) {
      if (o.confmat) atomicAdd(o.confmat + t * C + argmax, 1.0);
      atomicAdd(o.extras, 1.0);
      if (nll) atomicAdd(o.extras + 1, lse_value(l) - static_cast<double>(row[t]));
    }
    return true;
  });
}

void class_stats_cuda(const at::Tensor& preds_in, const at::Tensor& target, const std::optional<at::Tensor>& mask,
                      int64_t num_classes, std::optional<int64_t> ignore_index, at::IntArrayRef top_ks, bool nll,
                      const at::Tensor& stats, const std::optional<at::Tensor>& confmat, const at::Tensor& extras,
                      const at::Tensor& bad) {
  check_class_stats(preds_in, target, mask, num_classes, top_ks, nll, stats, confmat, extras, bad);
  const int64_t n = target.size(0), C = num_classes;
  if (n == 0) return;
  const at::cuda::CUDAGuard guard(target.device());
  auto stream = at::cuda::getCurrentCUDAStream();
  Rows r{target.data_ptr<int64_t>(), target.stride(0), mask_ptr(mask), mask.has_value() ? mask->stride(0) : 0,
         n, C, ignore_index.has_value(), ignore_index.value_or(0)};
  Out o{stats.data_ptr<double>(), confmat.has_value() ? confmat->data_ptr<double>() : nullptr,
        extras.data_ptr<double>(), bad.data_ptr<double>()};
  if (!at::isFloatingType(preds_in.scalar_type())) {
    const int64_t slots = 3 * C + (confmat.has_value() ? C * C : 0);
    const bool shared_hist = slots <= kSharedSlots;
    indices_kernel<<<blocks_for(n), kThreads, shared_hist ? slots * sizeof(double) : 0, stream>>>(
        r, preds_in.data_ptr<int64_t>(), preds_in.stride(0), o, shared_hist);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  // A warp per row reads 32 consecutive scores per step.
  const at::Tensor preds = preds_in.stride(1) == 1 ? preds_in : preds_in.contiguous();
  const int K = static_cast<int>(top_ks.size());
  TORCH_CHECK(K <= kWarp, "d9d_kernels.class_stats: argument 'top_ks' holds at most ", kWarp,
              " values on CUDA, got ", K);
  const int kmax = top_ks.empty() ? 1 : static_cast<int>(*std::max_element(top_ks.begin(), top_ks.end()));
  TopKs ks{};
  for (int i = 0; i < K; ++i) ks.k[i] = top_ks[i];
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, preds.scalar_type(), "class_stats_cuda", [&] {
    scores_kernel<scalar_t><<<blocks_for(n * kWarp), kThreads, 0, stream>>>(
        r, preds.data_ptr<scalar_t>(), preds.stride(0), ks, K, kmax, nll, o);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace
}  // namespace cuda
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CUDA, m) { m.impl("class_stats", &d9d::cuda::class_stats_cuda); }
