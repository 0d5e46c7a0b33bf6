// running_extrema on CPU: thread-private (max, -min, bad) per chunk.
// Specification: d9d_kernels/reference.py::running_extrema.
#include "../kernels/running_extrema.h"

#include <ATen/Dispatch.h>

#include "common.h"
#include "../kernels/running_extrema_checks.h"

namespace d9d {

namespace {

constexpr int64_t kGrain = 1 << 15;

void running_extrema_cpu(const at::Tensor& x, const std::optional<at::Tensor>& mask, bool skip_bad,
                         const at::Tensor& state, const at::Tensor& bad) {
  check_running_extrema(x, mask, state, bad);
  const int64_t n = x.size(0);
  const int64_t chunks = std::min<int64_t>(num_chunks(n, kGrain), 64);
  Extrema part[64];
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "running_extrema_cpu", [&] {
    const auto xs = strided1<scalar_t>(x);
    const bool has_m = mask.has_value();
    const Strided1<bool> ms = has_m ? strided1<bool>(*mask) : Strided1<bool>{nullptr, 0};
    for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
      Extrema a = extrema_init();
      for (int64_t i = b; i < e; ++i) {
        if (has_m && !ms[i]) continue;
        extrema_add(a, static_cast<double>(xs[i]), skip_bad);
      }
      part[c] = a;
    });
  });
  Extrema total = extrema_init();
  for (int64_t c = 0; c < chunks; ++c) extrema_merge(total, part[c]);
  double* s = state.data_ptr<double>();
  s[0] = nan_maximum(s[0], total.mx);
  s[1] = nan_maximum(s[1], total.nmn);
  bad.data_ptr<double>()[0] += total.bad;
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) { m.impl("running_extrema", &d9d::running_extrema_cpu); }
