// class_stats on CPU: rows split into chunks, each with private counts
// (stats [K,3,C], extras, bad) merged at the end; one pass over each score
// row for argmax, every top-k and the online log-sum-exp. With several
// chunks the confusion matrix is not privatised: each row records its cell
// and one serial pass adds them: a private [C, C] per chunk had forced
// C = 1000 onto one thread (logits [1024, 1000], top-1/5 + confmat, 2
// threads: 2.40 -> 1.58 ms, the cost without a confusion matrix).
// Specification: d9d_kernels/reference.py::class_stats.
#include "../kernels/class_stats.h"

#include <ATen/Dispatch.h>

#include <algorithm>
#include <numeric>
#include <vector>

#include "class_stats_checks.h"
#include "common.h"

namespace d9d {
namespace {

// Rows per chunk for index preds, elements per chunk for score rows: chunks of
// >= ~100 us at the 3-5 ns/row and ~4 ns/score measured by
// bench/bench_kernels.py, well above a thread hand-off (estimate, not swept).
constexpr int64_t kGrainRows = 1 << 16;
constexpr int64_t kGrainElems = 1 << 15;

// Where one chunk accumulates: the state itself (single chunk) or a private slice.
struct Out {
  double* stats;
  double* confmat;  // nullptr without confmat or with cells
  int64_t* cells;   // several chunks: cells[i] = t * C + argmax of valid row i
  double* extras;
  double* bad;
};

struct Args {
  int64_t C;
  bool has_ignore;
  int64_t ignore_index;
  const int64_t* top_ks;
  int K;
  int kmax;
  bool nll;
};

// Counts a valid row with target t whose classes best-first are top[0..kmax).
inline void count_row(const Args& a, const Out& o, int64_t i, int64_t t, const int64_t* top) {
  int rank_t = a.kmax;  // rank of the target among the kmax best, kmax if absent
  for (int r = 0; r < a.kmax; ++r) {
    if (top[r] == t) {
      rank_t = r;
      break;
    }
  }
  for (int ki = 0; ki < a.K; ++ki) {
    const int64_t k = a.top_ks[ki];
    for (int64_t r = 0; r < k; ++r) o.stats[stats_pred(ki, top[r], a.C)] += 1.0;
    if (rank_t < k) o.stats[stats_tp(ki, t, a.C)] += 1.0;
    o.stats[stats_target(ki, t, a.C)] += 1.0;
  }
  if (o.confmat != nullptr) o.confmat[t * a.C + top[0]] += 1.0;
  if (o.cells != nullptr) o.cells[i] = t * a.C + top[0];
  o.extras[0] += 1.0;
}

void rows_indices(const Args& a, const Out& o, const Strided1<int64_t>& pr, const Strided1<int64_t>& tg,
                  const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    if (has_m && !ms[i]) continue;
    const int64_t t = tg[i];
    if (!kept(true, a.has_ignore, t, a.ignore_index)) continue;
    const int64_t p = pr[i];
    if (!class_in_range(t, a.C) || !class_in_range(p, a.C)) {
      o.bad[0] += 1.0;
      continue;
    }
    count_row(a, o, i, t, &p);
  }
}

template <class T>
void rows_scores(const Args& a, const Out& o, const T* preds, int64_t row_stride, const Strided1<int64_t>& tg,
                 const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  const int64_t C = a.C;
  double sc[kTopKBuffer];
  int64_t ix[kTopKBuffer];
  const bool big_k = a.kmax > kTopKBuffer;
  std::vector<double> vals(big_k ? C : 0);
  std::vector<int64_t> order(big_k ? C : 0);
  for (int64_t i = b; i < e; ++i) {
    if (has_m && !ms[i]) continue;
    const int64_t t = tg[i];
    if (!kept(true, a.has_ignore, t, a.ignore_index)) continue;
    if (!class_in_range(t, C)) {
      o.bad[0] += 1.0;
      continue;
    }
    const T* row = preds + i * row_stride;
    bool finite = true;
    Lse l = lse_init();
    const int64_t* top = ix;
    if (!big_k) {
      int filled = 0;
      for (int64_t j = 0; j < C; ++j) {
        const double v = static_cast<double>(row[j]);
        finite &= is_finite(v);
        topk_offer(sc, ix, filled, a.kmax, v, j);
        if (a.nll) lse_add(l, v);
      }
    } else {
      for (int64_t j = 0; j < C; ++j) {
        const double v = static_cast<double>(row[j]);
        finite &= is_finite(v);
        vals[j] = v;
        if (a.nll) lse_add(l, v);
      }
      if (finite) {
        std::iota(order.begin(), order.end(), int64_t(0));
        std::partial_sort(order.begin(), order.begin() + a.kmax, order.end(), [&](int64_t x, int64_t y) {
          return ranks_ahead(vals[x], x, vals[y], y);
        });
        top = order.data();
      }
    }
    if (!finite) {
      o.bad[0] += 1.0;
      continue;
    }
    count_row(a, o, i, t, top);
    if (a.nll) o.extras[1] += lse_value(l) - static_cast<double>(row[t]);
  }
}

void class_stats_cpu(const at::Tensor& preds_in, const at::Tensor& target, const std::optional<at::Tensor>& mask,
                     int64_t num_classes, std::optional<int64_t> ignore_index, at::IntArrayRef top_ks, bool nll,
                     const at::Tensor& stats, const std::optional<at::Tensor>& confmat, const at::Tensor& extras,
                     const at::Tensor& bad) {
  check_class_stats(preds_in, target, mask, num_classes, top_ks, nll, stats, confmat, extras, bad);
  const int64_t C = num_classes;
  const int64_t n = target.size(0);
  const bool scores = at::isFloatingType(preds_in.scalar_type());
  Args a{C, ignore_index.has_value(), ignore_index.value_or(0), top_ks.data(), static_cast<int>(top_ks.size()),
         static_cast<int>(*std::max_element(top_ks.begin(), top_ks.end())), nll && scores};
  const auto tg = strided1<int64_t>(target);
  const bool has_m = mask.has_value();
  const Strided1<bool> ms = has_m ? strided1<bool>(*mask) : Strided1<bool>{nullptr, 0};

  // Private slice: stats | extras | bad.
  const int64_t n_stats = a.K * 3 * C;
  const int64_t slice = n_stats + 3;
  // A chunk must at least do as much work as zeroing + merging its slice.
  const int64_t grain = scores ? std::max<int64_t>((kGrainElems + C - 1) / C, slice / C + 1)
                               : std::max<int64_t>(kGrainRows, slice);
  const int64_t chunks = num_chunks(n, grain, slice * int64_t(sizeof(double)));
  std::vector<double> priv(chunks > 1 ? chunks * slice : 0, 0.0);
  std::vector<int64_t> cells(chunks > 1 && confmat.has_value() ? n : 0, int64_t(-1));
  auto out_of = [&](int64_t c) -> Out {
    if (chunks == 1) {
      return Out{stats.data_ptr<double>(), confmat.has_value() ? confmat->data_ptr<double>() : nullptr, nullptr,
                 extras.data_ptr<double>(), bad.data_ptr<double>()};
    }
    double* s = priv.data() + c * slice;
    return Out{s, nullptr, cells.empty() ? nullptr : cells.data(), s + n_stats, s + n_stats + 2};
  };

  if (!scores) {
    const auto pr = strided1<int64_t>(preds_in);
    for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) { rows_indices(a, out_of(c), pr, tg, ms, has_m, b, e); });
  } else {
    const at::Tensor preds = preds_in.stride(1) == 1 ? preds_in : preds_in.contiguous();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, preds.scalar_type(), "class_stats_cpu", [&] {
      const scalar_t* p = preds.data_ptr<scalar_t>();
      const int64_t rs = preds.stride(0);
      for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
        rows_scores<scalar_t>(a, out_of(c), p, rs, tg, ms, has_m, b, e);
      });
    });
  }
  if (chunks > 1) {
    double* dst[3] = {stats.data_ptr<double>(), extras.data_ptr<double>(), bad.data_ptr<double>()};
    const int64_t len[3] = {n_stats, 2, 1};
    for (int64_t c = 0; c < chunks; ++c) {
      const double* s = priv.data() + c * slice;
      for (int part = 0; part < 3; ++part) {
        for (int64_t j = 0; j < len[part]; ++j) dst[part][j] += s[j];
        s += len[part];
      }
    }
    if (!cells.empty()) {
      double* cm = confmat->data_ptr<double>();
      for (const int64_t cell : cells) {
        if (cell >= 0) cm[cell] += 1.0;
      }
    }
  }
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) { m.impl("class_stats", &d9d::class_stats_cpu); }
