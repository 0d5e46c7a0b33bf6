// The score-row loops of class_stats whose speed rests on the vector width:
// rows_small (all-pairs ranks, lane = class), for_rows, which calls it per
// row (the row body must be compiled for the same target as the loop to be
// inlined), and topk_scan (the best k of a long row; also the vocab-parallel
// partials, vocab_partials.cpp).
//
// Contract of this -inl.h: include it once per width right after
// lanes-inl.h, in the same namespace and with the same D9D_VEC_BYTES (see
// lanes-inl.h; no include guard, on purpose). The headers below must
// already be included outside any target region; they name what it uses
// (Args, Out, Cmp, count_row, nll_of and the row limits of
// class_stats_cpu.h; Strided1 of common.h; the half/bfloat16 bit
// conversions of half_bits.h).

#include <algorithm>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "class_stats_cpu.h"
#include "common.h"
#include "half_bits.h"

#if !defined(D9D_VEC_BYTES)
#error "class_stats_rows-inl.h: include lanes-inl.h first, with D9D_VEC_BYTES defined"
#endif

// The C scores at src as V: src itself, or converted into buf (C entries).
template <class V, class T>
inline const V* row_as(const T* src, int64_t C, V* buf) {
  if constexpr (std::is_same_v<T, V>) {
    return src;
  } else if constexpr (std::is_same_v<T, at::Half>) {
    for (int64_t j = half_bits_to_float(reinterpret_cast<const uint16_t*>(src), buf, C); j < C; ++j) {
      buf[j] = static_cast<float>(src[j]);
    }
    return buf;
  } else {
    for (int64_t j = 0; j < C; ++j) buf[j] = static_cast<V>(src[j]);
    return buf;
  }
}

// Calls f(i, t, row) for each kept row of [b, e) with target t in [0, C),
// row = its C scores as V; counts the kept rows with another target in bad[0]
// (f counts the rows whose scores are bad in bad[1]).
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
    const V* row = row_as<V>(src, C, buf.data());
    if constexpr (!convert) {
      if (end - src < C + pad) {
        std::copy(src, src + C, buf.begin());
        row = buf.data();
      }
    }
    f(i, t, row);
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

// kPerVec scores at p as V; float16/bfloat16 converted 4 lanes at a time
// (half_bits.h), two halves joined for 32 bytes.
template <class T>
inline VecOf<typename Cmp<T>::type> load_as(const T* p) {
  if constexpr (std::is_same_v<T, typename Cmp<T>::type>) {
    return load_vec(p);
  } else {
    auto four = [](const uint16_t* h) {
      return std::is_same_v<T, at::Half> ? half_bits_to_float4(h) : bf16_bits_to_float4(h);
    };
    const auto h = reinterpret_cast<const uint16_t*>(p);
    if constexpr (kVecBytes == 16) {
      return four(h);
    } else {
      return __builtin_shufflevector(four(h), four(h + 4), 0, 1, 2, 3, 4, 5, 6, 7);
    }
  }
}

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
  // On the stack, not in a std::vector: the default-target allocator aligns a
  // 32-byte vector type to 16 only (aligned AVX2 stores then fault). K <= C.
  Mask kv[kSmallC], cnt[(2 * kSmallC + 1) * U] = {};  // per k: pred[U], tp[U]; then targets[U]
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
    for (int j = 0; j < (2 * K + 1) * U; ++j) cnt[j] = Mask{};
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
        o.bad[1] += 1.0;
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
        if (lane_sum(sum) != no_ties) {
          for (int i2 = 0; i2 < C; ++i2) {
            const Vec si = splat(x[i2]);
            for (int u = 0; u < U; ++u) r[u] -= (si == s[u]) & (idx[u] > i2);
          }
        }
        const auto tv = static_cast<typename L::Int>(t);
        Mask is_t[U];
        uint32_t top1 = 0;  // bit j: class j has rank 0 (exactly one, the first max)
        for (int u = 0; u < U; ++u) {
          is_t[u] = idx[u] == tv;
          top1 |= uint32_t(lane_bits((r[u] == Mask{}) & live[u])) << (u * P);
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
        argmax = __builtin_ctz(top1);
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

// Top-1 of m adjacent rows whose classes are cs apart (lane = row): for
// rows [0, m) at x, best[i] = the row's max as V, top[i] = its lowest class,
// ok[i] = no NaN / +Inf in the row (the -Inf-only test is the caller's).
// A strictly greater score replaces the best, so ties keep the lower class.
template <class T>
void column_best(const T* x, int64_t cs, int64_t C, int64_t m, typename Cmp<T>::type* best, int32_t* top, bool* ok) {
  using V = typename Cmp<T>::type;
  using L = Lanes<V>;
  using Int = typename L::Int;
  typedef Int IntVec __attribute__((vector_size(kVecBytes)));
  const typename L::Vec inf = splat(std::numeric_limits<V>::infinity());
  int64_t i0 = 0;
  for (; i0 + L::P <= m; i0 += L::P) {
    typename L::Vec b = load_as(x + i0);
    typename L::Mask good = b < inf;
    IntVec t = IntVec{};
    for (int64_t j = 1; j < C; ++j) {
      const typename L::Vec v = load_as(x + j * cs + i0);
      const typename L::Mask gt = v > b;
      good &= v < inf;
      b = gt ? v : b;
      t = gt ? (static_cast<Int>(j) - IntVec{}) : t;
    }
    for (int l = 0; l < L::P; ++l) {
      best[i0 + l] = b[l];
      top[i0 + l] = static_cast<int32_t>(t[l]);
      ok[i0 + l] = good[l] != 0;
    }
  }
  for (int64_t i = i0; i < m; ++i) {  // the rows past the last whole vector
    V bi = static_cast<V>(x[i]);
    int32_t ti = 0;
    bool oi = score_ok(bi);
    for (int64_t j = 1; j < C; ++j) {
      const V v = static_cast<V>(x[j * cs + i]);
      oi = oi && score_ok(v);
      if (v > bi) {
        bi = v;
        ti = static_cast<int32_t>(j);
      }
    }
    best[i] = bi;
    top[i] = ti;
    ok[i] = oi;
  }
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
