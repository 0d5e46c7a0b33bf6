// group_values on CPU: the program's rows one after another, each class sum
// in order (csrc/kernels/group_values.h has the formulas).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../kernels/checks.h"
#include "../kernels/group_values.h"
#include "../kernels/group_values_checks.h"

namespace d9d {
namespace {
constexpr int64_t kGrain = 1 << 16;  // confusion-matrix elements per task
}

// Also called directly by the host compute of a group (csrc/cpu/group_compute.cpp).
void group_values_cpu(const at::Tensor& sum, const at::Tensor& max, const at::Tensor& replica,
                      const at::Tensor& program, const at::Tensor& beta, const at::Tensor& out) {
  using namespace group_values;
  check_group_values(sum, max, replica, program, beta, out);
  const Buffers b = buffers_of(sum, max, replica);
  const int64_t K = program.size(0), n_out = out.numel();
  const int64_t* prog = program.data_ptr<int64_t>();
  const double* beta2 = beta.data_ptr<double>();
  double* o = out.data_ptr<double>();
  for (int64_t i = 0; i < K; ++i) {
    const int64_t* r = prog + i * kCols;
    if (!row_ok(r, b, n_out)) {
      write_nan(r, o, n_out);
    } else if (r[kFormula] < kAccuracy) {
      o[r[kOut]] = scalar_value(r, b);
    } else if (r[kFormula] == kConfmat) {
      // a [1000, 1000] matrix is 8 MB to copy: every core's bandwidth
      at::parallel_for(0, out_len(r), kGrain, [&](int64_t lo, int64_t hi) {
        for (int64_t e = lo; e < hi; ++e) o[r[kOut] + e] = confmat_value(r, b.sum, e);
      });
    } else {
      Partial p;
      for (int64_t c = 0; c < r[kClasses]; ++c) add_class(r, beta2[i], b.sum, c, p, o);
      finish_class(r, beta2[i], b.sum, p, o);
    }
  }
}

}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) { m.impl("group_values", &d9d::group_values_cpu); }
