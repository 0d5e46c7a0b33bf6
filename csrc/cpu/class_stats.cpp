// class_stats on CPU: rows split into chunks, each with private counts
// (stats [K,3,C], extras, bad) merged at the end. With several chunks the
// confusion matrix is not privatised: each row records its cell and one
// serial pass adds them: a private [C, C] per chunk had forced C = 1000 onto
// one thread (logits [1024, 1000], top-1/5 + confmat, 2 threads: 2.40 ->
// 1.58 ms, the cost without a confusion matrix).
// Score rows: up to 32 classes (24 for float64), branch-free all-pairs
// ranks with per-class counts in vector lanes (rows_small); longer rows, a
// two-pass threshold scan that offers ~k scores to a top-k buffer
// (rows_scan); the log-sum-exp only with nll. Float/half/bfloat16 compare
// in float. Logits, top-1/5 + confmat, float32, 2 threads on the bench
// machine (2 shared cores, no gain from the 2nd thread), before -> after:
//   [1024, 10] 31.6 -> 16 us; [16384, 10] 1866 -> 225 us;
//   [32, 1000] 41.8 -> 8.0 us; [1024, 1000] 1600 -> 224 us;
//   [16384, 1000] 25.9 -> 5.7 ms (torch.topk + bincount: 1020 us, 86 us,
//   750 us, 12.6 ms on the same shapes).
// Specification: d9d_kernels/reference.py::class_stats.
#include "../kernels/class_stats.h"

#include <ATen/Dispatch.h>

#include <algorithm>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "class_stats_checks.h"
#include "common.h"
#include "lanes.h"

namespace d9d {
namespace {

// Rows per chunk for index preds: chunks of >= ~100 us at the 3-5 ns/row
// measured by bench/bench_kernels.py, well above a thread hand-off.
constexpr int64_t kGrainRows = 1 << 16;
// Score rows per chunk: >= kGrainNs of work at ~(10 + C / 5) ns per float32
// row (measured 14 ns at C = 10, 220 ns at C = 1000). Was 32768 scores a
// chunk: 3277 -> 4166 rows at C = 10, 33 -> 238 at C = 1000. An estimate,
// not swept: the bench machine gains nothing from a 2nd thread (at [64,
// 1000] a 2nd chunk took 13.3 -> 16.9 us there).
constexpr int64_t kGrainNs = 50000;

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
    count_row(a, o, i, t, &p, p == t ? 0 : 1);
  }
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
// rows (2 lanes a vector) only up to 24: at C = 32, top-1/5 + confmat,
// [16384, 32] float64, the scan took 2.06 ms, the ranking 2.89 ms.
constexpr int kSmallC = 32;
constexpr int kSmallCDouble = 24;
// Row scans of longer rows work on blocks of kLanes scores.
constexpr int kLanes = 16;
// Rows between two flushes of the int32 counters of rows_small.
constexpr int64_t kFlushRows = int64_t(1) << 30;

// logsumexp(row) - row[t] in double (max = the argmax score): one exp per score.
template <class V>
inline double nll_of(const V* x, int64_t C, int64_t argmax, int64_t t) {
  const double m = static_cast<double>(x[argmax]);
  double s = 1.0;  // exp(0) of the argmax: one exp fewer per row
  for (int64_t j = 0; j < argmax; ++j) s += exp(static_cast<double>(x[j]) - m);
  for (int64_t j = argmax + 1; j < C; ++j) s += exp(static_cast<double>(x[j]) - m);
  return lse_value(Lse{m, s}) - static_cast<double>(x[t]);
}

// Calls f(i, t, row) for each kept row of [b, e) with target t in [0, C),
// row = its C scores as V; counts the kept rows with another target as bad.
// row[C .. C + pad) may be read too (values of no meaning): `end` is one past
// the last score of the last row, beyond which a short row is copied.
template <class V, class T, class F>
void for_rows(const Args& a, const Out& o, const T* preds, int64_t rs, const T* end, int pad,
              const Strided1<int64_t>& tg, const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e, const F& f) {
  constexpr bool convert = !std::is_same_v<T, V>;
  const int64_t C = a.C;
  std::vector<V> buf(convert ? C + pad : (pad > 0 ? C + pad : 0), V(0));
  for (int64_t i = b; i < e; ++i) {
    if (has_m && !ms[i]) continue;
    const int64_t t = tg[i];
    if (!kept(true, a.has_ignore, t, a.ignore_index)) continue;
    if (!class_in_range(t, C)) {
      o.bad[0] += 1.0;
      continue;
    }
    const T* src = preds + i * rs;
    const V* row;
    if constexpr (convert && std::is_same_v<T, at::Half>) {
      for (int64_t j = half_bits_to_float(reinterpret_cast<const uint16_t*>(src), buf.data(), C); j < C; ++j) {
        buf[j] = static_cast<float>(src[j]);
      }
      row = buf.data();
    } else if constexpr (convert) {
      for (int64_t j = 0; j < C; ++j) buf[j] = static_cast<V>(src[j]);
      row = buf.data();
    } else {
      row = src;
      if (end - src < C + pad) {
        std::copy(src, src + C, buf.begin());
        row = buf.data();
      }
    }
    f(i, t, row);
  }
}

// kPerVec scores at p as V.
template <class T>
inline VecOf<typename Cmp<T>::type> load_as(const T* p) {
  if constexpr (std::is_same_v<T, at::Half>) {
    return half_bits_to_float4(reinterpret_cast<const uint16_t*>(p));
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return bf16_bits_to_float4(reinterpret_cast<const uint16_t*>(p));
  } else {
    return load_vec(p);
  }
}

// Scores of rows of C <= kSmallC classes in U vectors of P lanes (lane = class).
template <class V>
struct Lanes {
  static constexpr int P = kPerVec<V>;
  using Vec = VecOf<V>;
  using Mask = MaskOf<V>;
  using Int = std::remove_cv_t<std::remove_reference_t<decltype(Mask{}[0])>>;
};

// Rows of C <= U * P classes: every class's rank from all pairs, with no
// data-dependent branch and no per-class scatter. (A best-first insertion
// buffer mispredicts on most offers of a C = 10 row; adding 1 at
// stats[top[r]] stalls on addresses known late. At C = 10, top-1/5: 114 ->
// 14 ns/row.) rank[l] = #{i : s_i > s_l} is the rank when no two scores are
// equal: then the ranks sum to C(C-1)/2; a smaller sum (ties) takes a second
// pass that adds the equal scores of lower classes. Per-class counts are
// integer lanes (pred and tp per k, targets), flushed to `stats` every
// kFlushRows. top_ks = [1] needs only the first lane holding the row max.
template <class V, int U, class T>
void rows_small(const Args& a, const Out& o, const T* preds, int64_t rs, const T* end, const Strided1<int64_t>& tg,
                const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  using L = Lanes<V>;
  using Vec = typename L::Vec;
  using Mask = typename L::Mask;
  constexpr int P = L::P;
  const int C = static_cast<int>(a.C);
  const int K = a.K;
  constexpr V inf = std::numeric_limits<V>::infinity();
  Mask idx[U], live[U], init[U];
  for (int u = 0; u < U; ++u) {
    for (int l = 0; l < P; ++l) idx[u][l] = u * P + l;
    live[u] = idx[u] < C;
    init[u] = ~live[u] & C;  // padding lanes rank C: in no top-k, never the argmax
  }
  const int64_t no_ties = int64_t(C) * (C - 1) / 2;
  std::vector<Mask> kv(K), cnt(size_t(2 * K + 1) * U);  // per k: pred[U], tp[U]; then targets[U]
  for (int ki = 0; ki < K; ++ki) kv[ki] = Mask{} + static_cast<typename L::Int>(a.top_ks[ki]);
  double valid = 0.0, nll = 0.0;
  auto flush = [&] {
    for (int ki = 0; ki < K; ++ki) {
      for (int u = 0; u < U; ++u) {
        for (int l = 0; l < P && u * P + l < C; ++l) {
          o.stats[stats_pred(ki, u * P + l, C)] += static_cast<double>(cnt[(2 * ki) * U + u][l]);
          o.stats[stats_tp(ki, u * P + l, C)] += static_cast<double>(cnt[(2 * ki + 1) * U + u][l]);
          o.stats[stats_target(ki, u * P + l, C)] += static_cast<double>(cnt[2 * K * U + u][l]);
        }
      }
    }
    std::fill(cnt.begin(), cnt.end(), Mask{});
    o.extras[0] += valid;
    o.extras[1] += nll;
    valid = nll = 0.0;
  };
  for (int64_t bb = b; bb < e; bb += kFlushRows) {
    for_rows<T>(a, o, preds, rs, end, U * P - C, tg, ms, has_m, bb, std::min(e, bb + kFlushRows),
                [&](int64_t i, int64_t t, const T* row) {
      V conv[U * P];  // half/bfloat16 converted in lanes (no scalar stores); else the row itself
      const V* x;
      if constexpr (std::is_same_v<T, V>) {
        x = row;  // a copy cost 12% at [16384, 10]
      } else {
        x = conv;
      }
      Vec s[U];
      Mask r[U], nonfinite{}, unmasked{};
      for (int u = 0; u < U; ++u) {
        const Vec v = load_as(row + u * P);
        if constexpr (!std::is_same_v<T, V>) std::memcpy(conv + u * P, &v, sizeof v);
        nonfinite |= ~(v < splat(inf)) & live[u];  // NaN or +Inf (score_ok)
        unmasked |= (v > splat(-inf)) & live[u];    // a row of only -Inf is bad too
        s[u] = v;
        r[u] = init[u];
      }
      if (any_lane(nonfinite) || !any_lane(unmasked)) {
        o.bad[0] += 1.0;
        return;
      }
      int64_t argmax;
      if (a.kmax == 1) {  // top_ks = [1]: the first lane holding the row max, counted in place
        Vec m = live[0] ? s[0] : splat(-inf);
        for (int u = 1; u < U; ++u) m = (live[u] & (s[u] > m)) ? s[u] : m;
        V best = m[0];
        for (int l = 1; l < P; ++l) best = m[l] > best ? m[l] : best;
        const Vec vb = splat(best);
        uint32_t bits = 0;
        for (int u = 0; u < U; ++u) bits |= uint32_t(lane_bits((s[u] == vb) & live[u])) << (u * P);
        argmax = __builtin_ctz(bits);
        o.stats[stats_pred(0, argmax, C)] += 1.0;
        o.stats[stats_tp(0, t, C)] += argmax == t ? 1.0 : 0.0;
        o.stats[stats_target(0, t, C)] += 1.0;
      } else {
        for (int i2 = 0; i2 < C; ++i2) {
          const Vec si = splat(x[i2]);
          for (int u = 0; u < U; ++u) r[u] -= si > s[u];
        }
        Mask sum{};
        for (int u = 0; u < U; ++u) sum += r[u] & live[u];
        int64_t total = 0;
        for (int l = 0; l < P; ++l) total += sum[l];
        if (total != no_ties) {
          for (int i2 = 0; i2 < C; ++i2) {
            const Vec si = splat(x[i2]);
            for (int u = 0; u < U; ++u) r[u] -= (si == s[u]) & (idx[u] > i2);
          }
        }
        const auto tv = static_cast<typename L::Int>(t);
        Mask is_t[U], top1{};
        for (int u = 0; u < U; ++u) {
          is_t[u] = idx[u] == tv;
          top1 += (r[u] == Mask{}) & idx[u];
        }
        for (int ki = 0; ki < K; ++ki) {
          Mask* pred = &cnt[(2 * ki) * U];
          Mask* tp = pred + U;
          for (int u = 0; u < U; ++u) {
            const Mask in_top = r[u] < kv[ki];
            pred[u] -= in_top;
            tp[u] -= in_top & is_t[u];
          }
        }
        for (int u = 0; u < U; ++u) cnt[2 * K * U + u] -= is_t[u];
        argmax = 0;
        for (int l = 0; l < P; ++l) argmax += top1[l];
      }
      const int64_t cell = t * C + argmax;
      if (o.confmat != nullptr) o.confmat[cell] += 1.0;
      if (o.cells != nullptr) o.cells[i] = cell;
      valid += 1.0;
      if (a.nll) nll += nll_of(x, C, argmax, t);
    });
    flush();
  }
}

// The kmax best classes of a row of C > kSmallC scores (kmax <= kTopKBuffer)
// in two passes. Pass 1 keeps the max of each lane column (j mod kLanes):
// the kmax-th largest column max `lo` is <= the kmax-th best score (the
// column maxima are kmax distinct elements). Pass 2 offers, in class order,
// only the scores >= lo: a block of kLanes with none is skipped after one
// vector test, which also flags NaN/+Inf (!(v < lo)). At C = 1000, k = 5:
// ~6 of 63 blocks, ~6 offers. A NaN may leave a column max of fewer scores
// or NaN, so `lo` too high: harmless, as pass 2 never skips the NaN and the
// row is bad. -Inf scores (masked logits) are valid: skipped like any score
// below lo, else offered (lo = -Inf).
// Returns false for a row with a NaN/+Inf or only -Inf; else top[0..kmax)
// best first.
template <class V>
inline bool topk_scan(const V* x, int64_t C, int kmax, V* sc, int32_t* top) {
  using L = Lanes<V>;
  using Vec = typename L::Vec;
  using Mask = typename L::Mask;
  constexpr int P = L::P, U = kLanes / P;
  constexpr V inf = std::numeric_limits<V>::infinity();
  Vec mx[U];
  for (int u = 0; u < U; ++u) mx[u] = splat(-inf);
  const int64_t full = C - C % kLanes;
  for (int64_t j = 0; j < full; j += kLanes) {
    for (int u = 0; u < U; ++u) {
      const Vec v = load_vec(x + j + u * P);
      mx[u] = mx[u] > v ? mx[u] : v;  // maxps in place. A NaN v replaces the max:
                                      // still a max of distinct scores
    }
  }
  if (full < C) {  // the tail, padded with NaN, which this form skips
    V tail[kLanes];
    std::fill(tail, tail + kLanes, std::numeric_limits<V>::quiet_NaN());
    std::copy(x + full, x + C, tail);
    for (int u = 0; u < U; ++u) {
      const Vec v = load_vec(tail + u * P);
      mx[u] = v > mx[u] ? v : mx[u];
    }
  }
  V lo = -inf;
  if (kmax <= kLanes) {  // lo = the smallest column max with fewer than kmax maxima above it
    V cm[kLanes];
    std::memcpy(cm, mx, sizeof cm);
    Mask above[U];
    for (int u = 0; u < U; ++u) above[u] = Mask{};
    for (int i = 0; i < kLanes; ++i) {
      const Vec c = splat(cm[i]);
      for (int u = 0; u < U; ++u) above[u] -= c > mx[u];
    }
    Vec best = splat(inf);
    const Mask kv = Mask{} + kmax;
    for (int u = 0; u < U; ++u) best = ((above[u] < kv) & (mx[u] < best)) ? mx[u] : best;
    lo = best[0];
    for (int l = 1; l < P; ++l) lo = best[l] < lo ? best[l] : lo;
  }
  int filled = 0;
  Vec vlo = splat(lo);
  auto take = [&](int64_t j) {  // false: NaN or +Inf
    const V v = x[j];
    if (!(v < inf)) return false;  // score_ok
    topk_offer(sc, top, filled, kmax, v, static_cast<int32_t>(j));
    return true;
  };
  for (int64_t j = 0; j < full; j += kLanes) {
    Mask lt[U], all_lt = ~Mask{};
    for (int u = 0; u < U; ++u) {
      lt[u] = load_vec(x + j + u * P) < vlo;
      all_lt &= lt[u];
    }
    if (lane_bits(all_lt) == (1 << P) - 1) continue;
    int bits = 0;  // lanes >= lo (or NaN): few, visited in class order
    for (int u = 0; u < U; ++u) bits |= (lane_bits(lt[u]) ^ ((1 << P) - 1)) << (u * P);
    for (; bits != 0; bits &= bits - 1) {
      if (!take(j + __builtin_ctz(bits))) return false;
    }
    if (filled == kmax) {  // only a larger score enters now
      lo = sc[kmax - 1];
      vlo = splat(lo);
    }
  }
  for (int64_t j = full; j < C; ++j) {
    if (!(x[j] < lo) && !take(j)) return false;
  }
  return sc[0] > -inf;  // the row max is always offered (>= lo)
}

template <class V, class T>
void rows_scan(const Args& a, const Out& o, const T* preds, int64_t rs, const T* end, const Strided1<int64_t>& tg,
               const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  V sc[kTopKBuffer];
  int32_t top[kTopKBuffer];
  for_rows<V>(a, o, preds, rs, end, 0, tg, ms, has_m, b, e, [&](int64_t i, int64_t t, const V* x) {
    if (!topk_scan(x, a.C, a.kmax, sc, top)) {
      o.bad[0] += 1.0;
      return;
    }
    count_row(a, o, i, t, top, rank_in(top, a.kmax, t));
    if (a.nll) o.extras[1] += nll_of(x, a.C, top[0], t);
  });
}

// max(top_ks) > kTopKBuffer: a partial sort of each row.
template <class V, class T>
void rows_sort(const Args& a, const Out& o, const T* preds, int64_t rs, const T* end, const Strided1<int64_t>& tg,
               const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  const int64_t C = a.C;
  std::vector<int64_t> order(C);
  for_rows<V>(a, o, preds, rs, end, 0, tg, ms, has_m, b, e, [&](int64_t i, int64_t t, const V* x) {
    bool ok = true, unmasked = false;
    for (int64_t j = 0; j < C; ++j) {
      ok &= score_ok(x[j]);
      unmasked |= x[j] > -std::numeric_limits<V>::infinity();
    }
    if (!ok || !unmasked) {
      o.bad[0] += 1.0;
      return;
    }
    std::iota(order.begin(), order.end(), int64_t(0));
    std::partial_sort(order.begin(), order.begin() + a.kmax, order.end(),
                      [&](int64_t p, int64_t q) { return ranks_ahead(x[p], p, x[q], q); });
    count_row(a, o, i, t, order.data(), rank_in(order.data(), a.kmax, t));
    if (a.nll) o.extras[1] += nll_of(x, C, order[0], t);
  });
}

// rows_small with U = ceil(C / P) vectors.
template <class V, class T, int U = (std::is_same_v<V, double> ? kSmallCDouble : kSmallC) / Lanes<V>::P>
void rows_small_dispatch(const Args& a, const Out& o, const T* preds, int64_t rs, const T* end,
                         const Strided1<int64_t>& tg, const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  if constexpr (U > 1) {
    if (a.C <= (U - 1) * Lanes<V>::P) {
      rows_small_dispatch<V, T, U - 1>(a, o, preds, rs, end, tg, ms, has_m, b, e);
      return;
    }
  }
  rows_small<V, U>(a, o, preds, rs, end, tg, ms, has_m, b, e);
}

// C = 1 (top_ks = [1]): every finite row is a hit on class 0, its NLL 0 (a
// -Inf row is all masked: bad, as a NaN/+Inf one)
// (rows_small cost 6.0 -> 7.7 ns/row on [16384, 1]).
template <class V, class T>
void rows_one(const Args& a, const Out& o, const T* preds, int64_t rs, const T* end, const Strided1<int64_t>& tg,
              const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  double valid = 0.0;
  for_rows<T>(a, o, preds, rs, end, 0, tg, ms, has_m, b, e, [&](int64_t i, int64_t, const T* row) {
    const V v = static_cast<V>(row[0]);
    if (!(v - v == V(0))) {
      o.bad[0] += 1.0;
      return;
    }
    valid += 1.0;
    if (o.cells != nullptr) o.cells[i] = 0;
  });
  for (int part = 0; part < 3; ++part) o.stats[part] += valid;
  if (o.confmat != nullptr) o.confmat[0] += valid;
  o.extras[0] += valid;
}

template <class T>
void rows_scores(const Args& a, const Out& o, const T* preds, int64_t rs, const T* end, const Strided1<int64_t>& tg,
                 const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  using V = typename Cmp<T>::type;
  if (a.C == 1) {
    rows_one<V>(a, o, preds, rs, end, tg, ms, has_m, b, e);
  } else if (a.kmax > kTopKBuffer) {
    rows_sort<V>(a, o, preds, rs, end, tg, ms, has_m, b, e);
  } else if (a.C <= (std::is_same_v<V, double> ? kSmallCDouble : kSmallC)) {
    rows_small_dispatch<V>(a, o, preds, rs, end, tg, ms, has_m, b, e);
  } else {
    rows_scan<V>(a, o, preds, rs, end, tg, ms, has_m, b, e);
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
  const int64_t grain = scores ? std::max<int64_t>(kGrainNs / (10 + C / 5), slice / C + 1)
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
      const scalar_t* end = n > 0 ? p + (n - 1) * rs + C : p;
      for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
        rows_scores<scalar_t>(a, out_of(c), p, rs, end, tg, ms, has_m, b, e);
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
