// row_sum_exp on CPU: out[i] = Σ_j exp(x[i, j] - row_max[i]) in float64, one
// read of each row by the vectorised NLL pass of class_stats
// (class_stats_nll.h). An internal helper of the vocab-parallel partials
// (d9d_kernels/metrics/vocab_parallel.py), which fall back to torch ops
// without it; not one of the public ops. row_max must be the row's max (the
// exp argument is never positive) or 0 for a row without a finite max.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <type_traits>

#include "../kernels/checks.h"
#include "class_stats_nll.h"

namespace d9d {
namespace {

// Rows per task: ~64k scores, well above a thread hand-off.
constexpr int64_t kGrainScores = int64_t(1) << 16;

void row_sum_exp_cpu(const at::Tensor& x, const at::Tensor& row_max, const at::Tensor& out) {
  const char* op = "row_sum_exp";
  const auto st = x.scalar_type();
  D9D_CHECK_TYPE(st == at::kFloat || st == at::kHalf || st == at::kBFloat16, op, "x",
                 "must be float32/float16/bfloat16, got ", st);
  D9D_CHECK(x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1), op, "x",
            "must be 2-D [N, V] with contiguous rows, got shape ", x.sizes(), ", strides ", x.strides());
  const int64_t n = x.size(0), V = x.size(1);
  D9D_CHECK_TYPE(row_max.scalar_type() == at::kFloat, op, "row_max", "must be float32, got ", row_max.scalar_type());
  D9D_CHECK(row_max.dim() == 1 && row_max.size(0) == n && row_max.is_contiguous(), op, "row_max",
            "must be a contiguous [N] = [", n, "], got shape ", row_max.sizes());
  check_device(op, "row_max", row_max, x.device());
  check_state(op, "out", out, {n}, x.device());
  if (n == 0) return;
  const float* m = row_max.data_ptr<float>();
  double* o = out.data_ptr<double>();
  const bool vec = nll_vec_ok();
  const int64_t rs = x.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "row_sum_exp", [&] {
    if constexpr (!std::is_same_v<scalar_t, double>) {
      const scalar_t* p = x.data_ptr<scalar_t>();
      at::parallel_for(0, n, std::max<int64_t>(1, kGrainScores / std::max<int64_t>(V, 1)), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) {
          const scalar_t* r = p + i * rs;
          if (vec) {
            o[i] = nll_vec_sum_exp(r, V, m[i]);
            continue;
          }
          double s = 0.0;
          for (int64_t j = 0; j < V; ++j) s += std::exp(static_cast<double>(static_cast<float>(r[j]) - m[i]));
          o[i] = s;
        }
      });
    }
  });
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) { m.impl("row_sum_exp", &d9d::row_sum_exp_cpu); }
