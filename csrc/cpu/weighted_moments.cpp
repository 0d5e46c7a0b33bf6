// weighted_moments on CPU: one pass, thread-private Moments per chunk.
// Specification: d9d_kernels/reference.py::weighted_moments.
#include "../kernels/weighted_moments.h"

#include <ATen/Dispatch.h>

#include "common.h"
#include "../kernels/weighted_moments_checks.h"

namespace d9d {
namespace {

// 32k elements per chunk: ~50-100 us of work at the ~3 ns/element measured
// by bench/bench_kernels.py, well above a thread hand-off (estimate, not swept).
constexpr int64_t kGrain = 1 << 15;

template <class T, bool HasY>
void run(const at::Tensor& x, const std::optional<at::Tensor>& y, const std::optional<at::Tensor>& w,
         const std::optional<at::Tensor>& mask, bool skip_bad, double* state, double* bad, double* pivot) {
  const int64_t n = x.size(0);
  const auto xs = strided1<T>(x);
  const Strided1<T> ys = HasY ? strided1<T>(*y) : Strided1<T>{nullptr, 0};
  const bool has_w = w.has_value();
  const Strided1<T> ws = has_w ? strided1<T>(*w) : Strided1<T>{nullptr, 0};
  const bool has_m = mask.has_value();
  const Strided1<bool> ms = has_m ? strided1<bool>(*mask) : Strided1<bool>{nullptr, 0};
  auto wt = [&](int64_t i) { return has_w ? static_cast<double>(ws[i]) : 1.0; };
  auto yv = [&](int64_t i) { return HasY ? static_cast<double>(ys[i]) : 0.0; };

  double px = 0.0, py = 0.0;
  if (pivot != nullptr) {
    // An unset (NaN) pivot takes the first good element, in index order.
    if (is_nan(pivot[0]) || (HasY && is_nan(pivot[1]))) {
      for (int64_t i = 0; i < n; ++i) {
        if (has_m && !ms[i]) continue;
        const double xi = static_cast<double>(xs[i]);
        if (moments_good<HasY>(xi, yv(i), wt(i))) {
          if (is_nan(pivot[0])) pivot[0] = xi;
          if (HasY && is_nan(pivot[1])) pivot[1] = yv(i);
          break;
        }
      }
    }
    px = pivot_value(pivot[0]);
    py = pivot_value(pivot[1]);
  }

  const int64_t chunks = num_chunks(n, kGrain);
  Moments local[64];  // chunks <= threads; more threads than 64 fall back below
  const int64_t nc = std::min<int64_t>(chunks, 64);
  for (int64_t c = 0; c < nc; ++c) moments_zero(local[c]);
  for_chunks(n, nc, [&](int64_t c, int64_t b, int64_t e) {
    Moments m;
    moments_zero(m);
    for (int64_t i = b; i < e; ++i) {
      if (has_m && !ms[i]) continue;
      moments_add<HasY>(m, static_cast<double>(xs[i]), yv(i), wt(i), skip_bad, px, py);
    }
    local[c] = m;
  });
  Moments total;
  moments_zero(total);
  for (int64_t c = 0; c < nc; ++c) moments_merge(total, local[c]);
  for (int i = 0; i < kMomentsSize; ++i) {
    if (HasY || i < 3 || i == 8) state[i] += total.v[i];
  }
  bad[0] += total.bad;
}

void weighted_moments_cpu(const at::Tensor& x, const std::optional<at::Tensor>& y,
                          const std::optional<at::Tensor>& weights, const std::optional<at::Tensor>& mask,
                          bool skip_bad, const at::Tensor& state, const at::Tensor& bad,
                          const std::optional<at::Tensor>& pivot) {
  check_weighted_moments(x, y, weights, mask, state, bad, pivot);
  // Mixed dtypes are promoted; integer inputs (a token count) compute as float64, exactly.
  auto dtype = real_dtype(x.scalar_type());
  if (y.has_value()) dtype = c10::promoteTypes(dtype, real_dtype(y->scalar_type()));
  if (weights.has_value()) dtype = c10::promoteTypes(dtype, real_dtype(weights->scalar_type()));
  const at::Tensor xx = x.scalar_type() == dtype ? x : x.to(dtype);
  std::optional<at::Tensor> yy = y, ww = weights;
  if (yy.has_value() && yy->scalar_type() != dtype) yy = yy->to(dtype);
  if (ww.has_value() && ww->scalar_type() != dtype) ww = ww->to(dtype);
  double* piv = pivot.has_value() ? pivot->data_ptr<double>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "weighted_moments_cpu", [&] {
    if (yy.has_value()) {
      run<scalar_t, true>(xx, yy, ww, mask, skip_bad, state.data_ptr<double>(), bad.data_ptr<double>(), piv);
    } else {
      run<scalar_t, false>(xx, yy, ww, mask, skip_bad, state.data_ptr<double>(), bad.data_ptr<double>(), piv);
    }
  });
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) { m.impl("weighted_moments", &d9d::weighted_moments_cpu); }
