// Types and per-row helpers of the CPU class_stats kernel shared by
// class_stats.cpp and the row loops it builds once per vector width
// (class_stats_rows-inl.h): where a chunk accumulates (Out), the call's
// arguments (Args), how a ranked row is counted, and the row-length limits.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../kernels/class_stats.h"
#include "class_stats_nll.h"
#include "common.h"

namespace d9d {
namespace class_stats_detail {

// Where one chunk accumulates: the state itself (single chunk) or a private slice.
struct Out {
  double* stats;
  double* confmat;  // nullptr without confmat or with cells
  int64_t* cells;   // several chunks: cells[i] = t * C + argmax of valid row i
  double* extras;
  double* bad;  // [2]: a target out of range, bad scores
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

// Counts a valid row with target t whose classes best-first are top[0..kmax)
// and whose target is at rank rank_t (kmax when not among them).
template <class I>
inline void count_row(const Args& a, const Out& o, int64_t i, int64_t t, const I* top, int rank_t) {
  for (int ki = 0; ki < a.K; ++ki) {
    const int64_t k = a.top_ks[ki];
    for (int64_t r = 0; r < k; ++r) o.stats[stats_pred(ki, top[r], a.C)] += 1.0;
    o.stats[stats_tp(ki, t, a.C)] += rank_t < k ? 1.0 : 0.0;  // no branch: a coin flip at C = 10
    o.stats[stats_target(ki, t, a.C)] += 1.0;
  }
  const int64_t cell = t * a.C + top[0];
  if (o.confmat != nullptr) o.confmat[cell] += 1.0;
  if (o.cells != nullptr) o.cells[i] = cell;
  o.extras[0] += 1.0;
}

template <class I>
inline int rank_in(const I* top, int kmax, int64_t t) {
  int r = 0;
  while (r < kmax && top[r] != t) ++r;
  return r;
}

// Score rows are compared as V: float for float/half/bfloat16 (exact
// conversion, same order), double for double.
template <class T>
struct Cmp {
  using type = float;
};
template <>
struct Cmp<double> {
  using type = double;
};

// Rows up to kSmallC classes take the all-pairs ranking of rows_small; double
// rows (2 lanes a vector) only up to 24: at C = 32 the scan is faster than
// the ranking for float64 (bench/bench_kernels.py).
constexpr int kSmallC = 32;
constexpr int kSmallCDouble = 24;
// Row scans of longer rows work on blocks of kLanes scores.
constexpr int kLanes = 16;
// Rows between two flushes of the int32 counters of rows_small.
constexpr int64_t kFlushRows = int64_t(1) << 30;

// logsumexp(row) - row[t] in double (max = the argmax score): one exp per
// score, 8 at a time for float rows (class_stats_nll.cpp).
template <class V>
inline double nll_of(const V* x, int64_t C, int64_t argmax, int64_t t) {
  const double m = static_cast<double>(x[argmax]);
  if constexpr (std::is_same_v<V, float>) {
    if (nll_vec_ok()) return m + log(nll_vec_sum_exp(x, C, x[argmax])) - static_cast<double>(x[t]);
  }
  double s = 1.0;  // exp(0) of the argmax: one exp fewer per row
  for (int64_t j = 0; j < argmax; ++j) s += exp(static_cast<double>(x[j]) - m);
  for (int64_t j = argmax + 1; j < C; ++j) s += exp(static_cast<double>(x[j]) - m);
  return lse_value(Lse{m, s}) - static_cast<double>(x[t]);
}

}  // namespace class_stats_detail
}  // namespace d9d
