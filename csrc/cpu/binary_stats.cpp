// binary_stats on CPU: rows split into chunks with private [L, 4] counts.
// Specification: d9d_kernels/reference.py::binary_stats.
#include "../kernels/binary_stats.h"

#include <ATen/Dispatch.h>

#include <vector>

#include "../kernels/binary_checks.h"
#include "common.h"
#include "input_kind.h"

namespace d9d {
namespace {

// Entries per chunk: ~100 us at ~3 ns/entry (bench/bench_kernels.py), well
// above a thread hand-off (estimate, not swept).
constexpr int64_t kGrainElems = 1 << 15;

template <class T>
void run(const at::Tensor& preds, const at::Tensor& target, const std::optional<at::Tensor>& mask, double threshold,
         std::optional<int64_t> ignore_index, int64_t input_kind, double* state, double* bad) {
  const int64_t n = preds.size(0), L = preds.size(1);
  const auto p = strided2<T>(preds);
  const auto t = strided2<int64_t>(target);
  const bool has_m = mask.has_value();
  const Strided2<bool> m = has_m ? strided2<bool>(*mask) : Strided2<bool>{nullptr, 0, 0};
  const bool has_ig = ignore_index.has_value();
  const int64_t ig = ignore_index.value_or(0);
  const int64_t grain = std::max<int64_t>(1, kGrainElems / std::max<int64_t>(L, 1));
  const Threshold thr = make_threshold(threshold);
  bool logits = input_kind == kInputLogits;
  if (input_kind == kInputAuto) logits = any_logit_entries<T>(p, t, m, has_m, has_ig, ig, n, L, grain);

  const int64_t slice = L * 4 + 2;  // counts | bad[2]
  const int64_t chunks = num_chunks(n, std::max<int64_t>(grain, slice / std::max<int64_t>(L, 1)),
                                    slice * int64_t(sizeof(double)));
  std::vector<double> priv(chunks > 1 ? chunks * slice : 0, 0.0);
  for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
    double* st = chunks > 1 ? priv.data() + c * slice : state;
    double* bd = chunks > 1 ? st + L * 4 : bad;
    for (int64_t i = b; i < e; ++i) {
      for (int64_t j = 0; j < L; ++j) {
        const int64_t tv = t(i, j);
        if (!kept(!has_m || m(i, j), has_ig, tv, ig)) continue;
        const double v = static_cast<double>(p(i, j));
        const int cause = binary_bad_cause(tv, v);
        if (cause >= 0) {
          bd[cause] += 1.0;
          continue;
        }
        st[j * 4 + binary_cell(is_positive(v, logits, thr), tv == 1)] += 1.0;
      }
    }
  });
  for (int64_t c = 0; c < (chunks > 1 ? chunks : 0); ++c) {
    const double* s = priv.data() + c * slice;
    for (int64_t j = 0; j < L * 4; ++j) state[j] += s[j];
    bad[0] += s[L * 4];
    bad[1] += s[L * 4 + 1];
  }
}

void binary_stats_cpu(const at::Tensor& preds_in, const at::Tensor& target, const std::optional<at::Tensor>& mask,
                      double threshold, std::optional<int64_t> ignore_index, int64_t input_kind,
                      const at::Tensor& state, const at::Tensor& bad) {
  check_binary_stats(preds_in, target, mask, input_kind, state, bad);
  // Integer / bool preds are 0/1 probabilities (as in the reference).
  const bool is_float = at::isFloatingType(preds_in.scalar_type());
  const at::Tensor preds = is_float ? preds_in : preds_in.to(at::kFloat);
  if (!is_float) input_kind = kInputProbs;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, preds.scalar_type(), "binary_stats_cpu", [&] {
    run<scalar_t>(preds, target, mask, threshold, ignore_index, input_kind, state.data_ptr<double>(),
                  bad.data_ptr<double>());
  });
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) { m.impl("binary_stats", &d9d::binary_stats_cpu); }
