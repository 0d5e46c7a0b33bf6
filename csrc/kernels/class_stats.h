// Per-row math of class_stats (d9d_kernels.reference.class_stats), shared by
// csrc/cpu/class_stats.cpp and csrc/cuda/class_stats.cu: range tests, the
// top-k tie rule, a small top-k insertion buffer and the online log-sum-exp.
#pragma once

#include "common.h"

namespace d9d {

// A score row is valid when it holds no NaN or +Inf and not only -Inf: -Inf
// is a masked logit (probability 0), ranked last, ties to the lower index.
D9D_HD inline bool score_ok(double v) { return v < INFINITY; }

// Largest max(top_ks) kept in a per-row insertion buffer; larger k sort the row.
constexpr int kTopKBuffer = 64;

D9D_HD inline bool class_in_range(int64_t c, int64_t num_classes) { return c >= 0 && c < num_classes; }

// Class j ranks ahead of class i: s_j > s_i, or equal scores and j < i
// (lower index first, as torch.argmax and a stable descending sort).
D9D_HD inline bool ranks_ahead(double sj, int64_t j, double si, int64_t i) {
  return sj > si || (sj == si && j < i);
}

// The same rule in float and int32 (the CUDA single-pass rows compare <= 32-bit scores in float).
D9D_HD inline bool ranks_ahead(float sj, int32_t j, float si, int32_t i) { return sj > si || (sj == si && j < i); }

// Offers (s, j) to a buffer of the `filled` best so far, best first, kept to
// `kmax` entries. Classes must be offered in increasing j: then an equal
// score never displaces an earlier class, so `>` is the whole tie rule.
// V: score type (float or double), I: class index type.
template <class V, class I>
D9D_HD inline void topk_offer(V* sc, I* ix, int& filled, int kmax, V s, I j) {
  if (filled == kmax && !(s > sc[kmax - 1])) return;
  int p = filled < kmax ? filled : kmax - 1;
  while (p > 0 && s > sc[p - 1]) {
    sc[p] = sc[p - 1];
    ix[p] = ix[p - 1];
    --p;
  }
  sc[p] = s;
  ix[p] = j;
  if (filled < kmax) ++filled;
}

// Online log-sum-exp: one pass over a row, no softmax tensor.
struct Lse {
  double m;  // running max
  double s;  // sum of exp(v - m)
};

D9D_HD inline Lse lse_init() { return Lse{-INFINITY, 0.0}; }

D9D_HD inline void lse_add(Lse& a, double v) {
  if (v == -INFINITY) return;  // a masked logit: exp(-inf) = 0 (and -inf - -inf would be NaN)
  if (v > a.m) {
    a.s = a.s * exp(a.m - v) + 1.0;
    a.m = v;
  } else {
    a.s += exp(v - a.m);
  }
}

D9D_HD inline void lse_merge(Lse& a, const Lse& b) {
  if (b.m == -INFINITY) return;
  if (a.m == -INFINITY) {
    a = b;
    return;
  }
  if (b.m > a.m) {
    a.s = a.s * exp(a.m - b.m) + b.s;
    a.m = b.m;
  } else {
    a.s += b.s * exp(b.m - a.m);
  }
}

D9D_HD inline double lse_value(const Lse& a) { return a.m + log(a.s); }

// Offsets into the stats state [K, 3, C].
D9D_HD inline int64_t stats_tp(int64_t ki, int64_t c, int64_t C) { return (ki * 3 + 0) * C + c; }
D9D_HD inline int64_t stats_pred(int64_t ki, int64_t c, int64_t C) { return (ki * 3 + 1) * C + c; }
D9D_HD inline int64_t stats_target(int64_t ki, int64_t c, int64_t C) { return (ki * 3 + 2) * C + c; }

}  // namespace d9d
