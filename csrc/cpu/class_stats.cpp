// class_stats on CPU: rows split into chunks, each with private counts
// (stats [K,3,C], extras, bad) merged at the end. With several chunks the
// confusion matrix is not privatised: each row records its cell and one
// serial pass adds them, so a large C still splits over threads (a private
// [C, C] per chunk would force C = 1000 onto one thread).
// Score rows: up to 32 classes (24 for float64), branch-free all-pairs
// ranks with per-class counts in vector lanes (rows_small); longer rows, a
// two-pass threshold scan that offers ~k scores to a top-k buffer
// (rows_scan); the log-sum-exp only with nll (class_stats_nll.cpp). Float /
// half / bfloat16 compare in float. rows_small has a 32-byte (AVX2) build
// beside the 16-byte one: same loop, twice the lanes. Measured figures:
// bench/analysis.md.
// Specification: d9d_kernels/reference.py::class_stats.
#include "../kernels/class_stats.h"

#include <ATen/Dispatch.h>
#include <ATen/Version.h>

#if defined(__SSE2__)
#include <immintrin.h>  // before the AVX2 region (target_region.h)
#endif

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "../kernels/class_stats_checks.h"
#include "class_stats_cpu.h"
#include "class_stats_nll.h"
#include "common.h"
#include "half_bits.h"
#include "target_region.h"

namespace d9d {
namespace {

using namespace class_stats_detail;

// Rows per chunk for index preds: chunks of >= ~100 us at the 3-5 ns/row
// measured by bench/bench_kernels.py, well above a thread hand-off.
constexpr int64_t kGrainRows = 1 << 16;
// Score rows per chunk: >= kGrainNs of work at ~(10 + C / 5) ns per float32
// row (14 ns at C = 10, 220 ns at C = 1000, bench/bench_kernels.py). An
// estimate, not swept: the bench machine gains nothing from a 2nd thread.
constexpr int64_t kGrainNs = 50000;

void rows_indices(const Args& a, const Out& o, const Strided1<int64_t>& pr, const Strided1<int64_t>& tg,
                  const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  for (int64_t i = b; i < e; ++i) {
    if (has_m && !ms[i]) continue;
    const int64_t t = tg[i];
    if (!kept(true, a.has_ignore, t, a.ignore_index)) continue;
    const int64_t p = pr[i];
    if (!class_in_range(t, a.C) || !class_in_range(p, a.C)) {
      o.bad[0] += 1.0;  // a label mistake, as a target out of range
      continue;
    }
    count_row(a, o, i, t, &p, p == t ? 0 : 1);
  }
}


// 16-byte lanes: every x86-64 and arm64 CPU.
namespace vec16 {
#define D9D_VEC_BYTES 16
#include "lanes-inl.h"
#include "class_stats_rows-inl.h"
#undef D9D_VEC_BYTES
}  // namespace vec16

// 32-byte lanes (AVX2) for rows_small, taken after a runtime check (use_vec32).
#if defined(D9D_HAS_TARGET_REGION)
#define D9D_VEC32 1
D9D_TARGET_BEGIN("avx2")
namespace vec32 {
#define D9D_VEC_BYTES 32
#include "lanes-inl.h"
#include "class_stats_rows-inl.h"
#undef D9D_VEC_BYTES
}  // namespace vec32
D9D_TARGET_END

// The CPU has AVX2 and torch may use it too: ATEN_CPU_CAPABILITY=default
// turns off both (the tests run the 16-byte path that way).
bool use_vec32() {
  static const bool yes = __builtin_cpu_supports("avx2") && at::get_cpu_capability() != "DEFAULT";
  return yes;
}
#endif

// Longer rows: 16-byte lanes everywhere.
using namespace vec16;

template <class V, class T>
void rows_scan(const Args& a, const Out& o, const T* preds, int64_t rs, const T* end, const Strided1<int64_t>& tg,
               const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  V sc[kTopKBuffer];
  int32_t top[kTopKBuffer];
  for_rows<V>(a, o, preds, rs, end, 0, tg, ms, has_m, b, e, [&](int64_t i, int64_t t, const V* x) {
    if (!topk_scan(x, a.C, a.kmax, sc, top)) {
      o.bad[1] += 1.0;
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
      o.bad[1] += 1.0;
      return;
    }
    std::iota(order.begin(), order.end(), int64_t(0));
    std::partial_sort(order.begin(), order.begin() + a.kmax, order.end(),
                      [&](int64_t p, int64_t q) { return ranks_ahead(static_cast<double>(x[p]), p, static_cast<double>(x[q]), q); });
    count_row(a, o, i, t, order.data(), rank_in(order.data(), a.kmax, t));
    if (a.nll) o.extras[1] += nll_of(x, C, order[0], t);
  });
}

// C = 1 (top_ks = [1]): every finite row is a hit on class 0, its NLL 0 (a
// -Inf row is all masked: bad, as a NaN/+Inf one); cheaper than ranking a
// one-class row in rows_small.
template <class V, class T>
void rows_one(const Args& a, const Out& o, const T* preds, int64_t rs, const T* end, const Strided1<int64_t>& tg,
              const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  double valid = 0.0;
  for_rows<T>(a, o, preds, rs, end, 0, tg, ms, has_m, b, e, [&](int64_t i, int64_t, const T* row) {
    const V v = static_cast<V>(row[0]);
    if (!(v - v == V(0))) {
      o.bad[1] += 1.0;
      return;
    }
    valid += 1.0;
    if (o.cells != nullptr) o.cells[i] = 0;
  });
  for (int part = 0; part < 3; ++part) o.stats[part] += valid;
  if (o.confmat != nullptr) o.confmat[0] += valid;
  o.extras[0] += valid;
}

// No top_ks and no confusion matrix (Perplexity alone): the NLL only, on the
// scores' own type (no float copy of a half row): the row max, then the sum of
// exp, 8 scores at a time where nll_vec_ok().
template <class T>
void rows_nll(const Args& a, const Out& o, const T* preds, int64_t rs, const T* end, const Strided1<int64_t>& tg,
              const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  const int64_t C = a.C;
  const bool vec = !std::is_same_v<T, double> && nll_vec_ok();
  for_rows<T>(a, o, preds, rs, end, 0, tg, ms, has_m, b, e, [&](int64_t, int64_t t, const T* x) {
    double m = -std::numeric_limits<double>::infinity(), s = 0.0;
    bool ok = true;
    if (vec) {
      if constexpr (!std::is_same_v<T, double>) {
        float mf;
        ok = nll_vec_max(x, C, &mf);
        m = mf;
        if (ok) s = nll_vec_sum_exp(x, C, mf);
      }
    } else {
      for (int64_t j = 0; j < C; ++j) {
        const double v = static_cast<double>(x[j]);
        ok &= score_ok(v);
        m = v > m ? v : m;
      }
      ok &= m > -std::numeric_limits<double>::infinity();
      if (ok) {
        for (int64_t j = 0; j < C; ++j) s += exp(static_cast<double>(x[j]) - m);
      }
    }
    if (!ok) {
      o.bad[1] += 1.0;
      return;
    }
    o.extras[0] += 1.0;
    o.extras[1] += m + log(s) - static_cast<double>(x[t]);
  });
}

template <class T>
void rows_scores(const Args& a, const Out& o, const T* preds, int64_t rs, const T* end, const Strided1<int64_t>& tg,
                 const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  using V = typename Cmp<T>::type;
  if (a.K == 0 && o.confmat == nullptr && o.cells == nullptr) {
    rows_nll(a, o, preds, rs, end, tg, ms, has_m, b, e);
  } else if (a.C == 1) {
    rows_one<V>(a, o, preds, rs, end, tg, ms, has_m, b, e);
  } else if (a.kmax > kTopKBuffer) {
    rows_sort<V>(a, o, preds, rs, end, tg, ms, has_m, b, e);
  } else if (a.C <= (std::is_same_v<V, double> ? kSmallCDouble : kSmallC)) {
#if defined(D9D_VEC32)
    if (use_vec32()) {
      vec32::rows_small_dispatch<V>(a, o, preds, rs, end, tg, ms, has_m, b, e);
      return;
    }
#endif
    vec16::rows_small_dispatch<V>(a, o, preds, rs, end, tg, ms, has_m, b, e);
  } else {
    rows_scan<V>(a, o, preds, rs, end, tg, ms, has_m, b, e);
  }
}

// Bytes of score rows staged per tile of a strided input (L1-sized).
constexpr int64_t kTileBytes = 32 << 10;
// Rows ranked together by rows_columns (their running best lives on the stack).
constexpr int64_t kColumnRows = 256;

// Top-1 of rows [b, e) whose scores are adjacent along the rows (row stride
// 1, class stride cs: one sample of a channel-first [N, C, H, W] batch):
// column_best ranks kColumnRows rows at once, one class after another, with
// a lane per row, so every load is a contiguous run of one class. Same rules
// as the row loops (ties keep the lower class; NaN or +Inf anywhere, or only
// -Inf, make the row bad).
template <class T>
void rows_columns(const Args& a, const Out& o, const T* preds, int64_t cs, const Strided1<int64_t>& tg,
                  const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  using V = typename Cmp<T>::type;
  V best[kColumnRows];
  int32_t top[kColumnRows];
  bool ok[kColumnRows];
#if defined(D9D_VEC32)
  const bool wide = use_vec32();
#endif
  for (int64_t rb = b; rb < e; rb += kColumnRows) {
    const int64_t m = std::min(kColumnRows, e - rb);
#if defined(D9D_VEC32)
    if (wide) {
      vec32::column_best(preds + rb, cs, a.C, m, best, top, ok);
    } else
#endif
    {
      vec16::column_best(preds + rb, cs, a.C, m, best, top, ok);
    }
    for (int64_t i = 0; i < m; ++i) {
      const int64_t r = rb + i;
      const int64_t t = tg[r];
      if (!kept(!has_m || ms[r], a.has_ignore, t, a.ignore_index)) continue;
      if (!class_in_range(t, a.C)) {
        o.bad[0] += 1.0;
        continue;
      }
      if (!ok[i] || !(best[i] > -std::numeric_limits<V>::infinity())) {
        o.bad[1] += 1.0;
        continue;
      }
      count_row(a, o, r, t, top + i, top[i] == t ? 0 : 1);
    }
  }
}

// Rows [b, e) of scores whose classes are not adjacent (preds [R, C] with
// stride(1) != 1: channel-first [N, C, H, W] seen as [H*W, C] per sample).
// Top-1 alone of adjacent rows: rows_columns. Otherwise tiles of rows are
// transposed into a small contiguous buffer, reading each class's run of
// rows in order, and rows_scores runs on the tile. The results are those of
// a contiguous copy, without the copy of the input.
template <class T>
void rows_strided(const Args& a, const Out& o, const T* preds, int64_t rs, int64_t cs, const Strided1<int64_t>& tg,
                  const Strided1<bool>& ms, bool has_m, int64_t b, int64_t e) {
  if (rs == 1 && a.K == 1 && a.kmax == 1 && !a.nll) {
    rows_columns<T>(a, o, preds, cs, tg, ms, has_m, b, e);
    return;
  }
  const int64_t C = a.C;
  const int64_t rows = std::max<int64_t>(8, kTileBytes / (C * int64_t(sizeof(T))));
  std::vector<T> tile(static_cast<size_t>(std::min(rows, std::max<int64_t>(e - b, 1)) * C));
  for (int64_t tb = b; tb < e; tb += rows) {
    const int64_t m = std::min(rows, e - tb);
    for (int64_t j = 0; j < C; ++j) {
      const T* src = preds + tb * rs + j * cs;
      T* dst = tile.data() + j;
      for (int64_t i = 0; i < m; ++i) dst[i * C] = src[i * rs];
    }
    // the tile's rows are rows [tb, tb + m): targets, mask and cells shifted to match
    Out ot = o;
    if (ot.cells != nullptr) ot.cells += tb;
    const Strided1<int64_t> tt{tg.p + tb * tg.s, tg.s};
    const Strided1<bool> mt{has_m ? ms.p + tb * ms.s : nullptr, ms.s};
    rows_scores<T>(a, ot, tile.data(), C, tile.data() + m * C, tt, mt, has_m, 0, m);
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
         top_ks.empty() ? 1 : static_cast<int>(*std::max_element(top_ks.begin(), top_ks.end())), nll && scores};
  const auto tg = strided1<int64_t>(target);
  const bool has_m = mask.has_value();
  const Strided1<bool> ms = has_m ? strided1<bool>(*mask) : Strided1<bool>{nullptr, 0};

  // Private slice: stats | extras | bad.
  const int64_t n_stats = a.K * 3 * C;
  const int64_t slice = n_stats + 4;
  // A chunk must at least do as much work as zeroing + merging its slice.
  const int64_t grain = scores ? std::max<int64_t>(kGrainNs / (10 + C / 5), slice / C + 1)
                               : std::max<int64_t>(kGrainRows, slice);
  const int64_t chunks = num_chunks(n, grain, slice * int64_t(sizeof(double)));
  std::vector<double> priv(chunks > 1 ? chunks * slice : 0, 0.0);
  std::vector<int64_t> cells(chunks > 1 && confmat.has_value() ? n : 0, int64_t(-1));
  // The extras (NLL sums) are not integers: the batch's total is added to the state once, so the state
  // is the same bits whether the update runs on it or on a zeroed scratch folded in after (forward).
  double batch_extras[2] = {0.0, 0.0};
  auto out_of = [&](int64_t c) -> Out {
    if (chunks == 1) {
      return Out{stats.data_ptr<double>(), confmat.has_value() ? confmat->data_ptr<double>() : nullptr, nullptr,
                 batch_extras, bad.data_ptr<double>()};
    }
    double* s = priv.data() + c * slice;
    return Out{s, nullptr, cells.empty() ? nullptr : cells.data(), s + n_stats, s + n_stats + 2};
  };

  if (!scores) {
    const auto pr = strided1<int64_t>(preds_in);
    for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) { rows_indices(a, out_of(c), pr, tg, ms, has_m, b, e); });
  } else if (preds_in.stride(1) == 1 || C == 1) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, preds_in.scalar_type(), "class_stats_cpu", [&] {
      const scalar_t* p = preds_in.data_ptr<scalar_t>();
      const int64_t rs = preds_in.stride(0);
      const scalar_t* end = n > 0 ? p + (n - 1) * rs + C : p;
      for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
        rows_scores<scalar_t>(a, out_of(c), p, rs, end, tg, ms, has_m, b, e);
      });
    });
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, preds_in.scalar_type(), "class_stats_cpu", [&] {
      for_chunks(n, chunks, [&](int64_t c, int64_t b, int64_t e) {
        rows_strided<scalar_t>(a, out_of(c), preds_in.data_ptr<scalar_t>(), preds_in.stride(0), preds_in.stride(1), tg,
                               ms, has_m, b, e);
      });
    });
  }
  if (chunks > 1) {
    double* dst[3] = {stats.data_ptr<double>(), batch_extras, bad.data_ptr<double>()};
    const int64_t len[3] = {n_stats, 2, 2};
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
  double* ex = extras.data_ptr<double>();
  ex[0] += batch_extras[0];
  ex[1] += batch_extras[1];
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) { m.impl("class_stats", &d9d::class_stats_cpu); }
