// score_histogram on CPU: rows split into chunks with private [2, L, B]
// histograms (fewer chunks when those would exceed kPrivateBudgetBytes).
// Specification: d9d_kernels/reference.py::score_histogram.
#include "../kernels/binary_stats.h"

#include <ATen/Dispatch.h>

#include <atomic>
#include <vector>

#include "../kernels/binary_checks.h"
#include "common.h"
#include "input_kind.h"

namespace d9d {
namespace {

constexpr int64_t kGrainElems = 1 << 15;

struct Ctx {
  int64_t n, L, B;
  bool has_m, has_ig;
  int64_t ig;
};

// Multiclass INPUT_AUTO: any valid row (finite, target in range) holding a
// score outside [0, 1].
template <class T>
bool any_logit_rows(const Ctx& c, const Strided2<T>& p, const Strided1<int64_t>& t, const Strided1<bool>& m,
                    int64_t grain_rows) {
  std::atomic<bool> found{false};
  for_chunks(c.n, num_chunks(c.n, grain_rows), [&](int64_t, int64_t b, int64_t e) {
    for (int64_t i = b; i < e && !found.load(std::memory_order_relaxed); ++i) {
      const int64_t tv = t[i];
      if (!kept(!c.has_m || m[i], c.has_ig, tv, c.ig) || tv < 0 || tv >= c.L) continue;
      bool finite = true, outside = false;
      for (int64_t j = 0; j < c.L; ++j) {
        const double v = static_cast<double>(p(i, j));
        finite &= is_finite(v);
        outside |= outside_unit(v);
      }
      if (finite && outside) {
        found.store(true, std::memory_order_relaxed);
        return;
      }
    }
  });
  return found.load();
}

// Logit rows keep exp(v - max) of each score for the binning pass: one exp
// per score, not two: the exps are most of a logit row's cost
// (bench/analysis.md).
template <class T>
void rows_multiclass(const Ctx& c, const Strided2<T>& p, const Strided1<int64_t>& t, const Strided1<bool>& m,
                     bool logits, double* hist, double* bad, int64_t b, int64_t e) {
  std::vector<double> ex(logits ? c.L : 0);
  for (int64_t i = b; i < e; ++i) {
    const int64_t tv = t[i];
    if (!kept(!c.has_m || m[i], c.has_ig, tv, c.ig)) continue;
    if (!(tv >= 0 && tv < c.L)) {
      bad[0] += 1.0;
      continue;
    }
    bool finite = true;
    double mx = -INFINITY;
    for (int64_t j = 0; finite && j < c.L; ++j) {
      const double v = static_cast<double>(p(i, j));
      finite &= is_finite(v);
      mx = v > mx ? v : mx;
    }
    if (!finite) {
      bad[1] += 1.0;
      continue;
    }
    double inv = 1.0;
    if (logits) {  // softmax as torch: exp(v - max) * (1 / sum)
      double sum = 0.0;
      for (int64_t j = 0; j < c.L; ++j) {
        ex[j] = exp(static_cast<double>(p(i, j)) - mx);
        sum += ex[j];
      }
      inv = 1.0 / sum;
    }
    for (int64_t j = 0; j < c.L; ++j) {
      const double prob = logits ? ex[j] * inv : static_cast<double>(p(i, j));
      hist[hist_slot(j == tv, j, bin_of(prob, c.B), c.L, c.B)] += 1.0;
    }
  }
}

template <class T>
void rows_entries(const Ctx& c, const Strided2<T>& p, const Strided2<int64_t>& t, const Strided2<bool>& m,
                  bool logits, double* hist, double* bad, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    for (int64_t j = 0; j < c.L; ++j) {
      const int64_t tv = t(i, j);
      if (!kept(!c.has_m || m(i, j), c.has_ig, tv, c.ig)) continue;
      const double v = static_cast<double>(p(i, j));
      const int cause = binary_bad_cause(tv, v);
      if (cause >= 0) {
        bad[cause] += 1.0;
        continue;
      }
      hist[hist_slot(tv == 1, j, bin_of(to_prob(v, logits), c.B), c.L, c.B)] += 1.0;
    }
  }
}

void score_histogram_cpu(const at::Tensor& preds, const at::Tensor& target, const std::optional<at::Tensor>& mask,
                         std::optional<int64_t> ignore_index, int64_t input_kind, bool multiclass,
                         const at::Tensor& hist, const at::Tensor& bad) {
  check_score_histogram(preds, target, mask, input_kind, multiclass, hist, bad);
  const Ctx c{preds.size(0), preds.size(1), hist.size(2), mask.has_value(), ignore_index.has_value(),
              ignore_index.value_or(0)};
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(c.L, 1));
  const int64_t hist_len = 2 * c.L * c.B;
  const int64_t slice = hist_len + 2;  // hist | bad[2]
  const int64_t chunks = num_chunks(c.n, std::max<int64_t>(grain, slice / std::max<int64_t>(c.L, 1)),
                                    slice * int64_t(sizeof(double)));
  std::vector<double> priv(chunks > 1 ? chunks * slice : 0, 0.0);
  double* h = hist.data_ptr<double>();
  double* bd = bad.data_ptr<double>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, preds.scalar_type(), "score_histogram_cpu", [&] {
    const auto p = strided2<scalar_t>(preds);
    bool logits = input_kind == kInputLogits;
    if (multiclass) {
      const auto t = strided1<int64_t>(target);
      const Strided1<bool> m = c.has_m ? strided1<bool>(*mask) : Strided1<bool>{nullptr, 0};
      if (input_kind == kInputAuto) logits = any_logit_rows<scalar_t>(c, p, t, m, grain);
      for_chunks(c.n, chunks, [&](int64_t k, int64_t b, int64_t e) {
        double* s = chunks > 1 ? priv.data() + k * slice : h;
        rows_multiclass<scalar_t>(c, p, t, m, logits, s, chunks > 1 ? s + hist_len : bd, b, e);
      });
    } else {
      const auto t = strided2<int64_t>(target);
      const Strided2<bool> m = c.has_m ? strided2<bool>(*mask) : Strided2<bool>{nullptr, 0, 0};
      if (input_kind == kInputAuto) logits = any_logit_entries<scalar_t>(p, t, m, c.has_m, c.has_ig, c.ig, c.n, c.L, grain);
      for_chunks(c.n, chunks, [&](int64_t k, int64_t b, int64_t e) {
        double* s = chunks > 1 ? priv.data() + k * slice : h;
        rows_entries<scalar_t>(c, p, t, m, logits, s, chunks > 1 ? s + hist_len : bd, b, e);
      });
    }
  });
  for (int64_t k = 0; k < (chunks > 1 ? chunks : 0); ++k) {
    const double* s = priv.data() + k * slice;
    for (int64_t j = 0; j < hist_len; ++j) h[j] += s[j];
    bd[0] += s[hist_len];
    bd[1] += s[hist_len + 1];
  }
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) { m.impl("score_histogram", &d9d::score_histogram_cpu); }
