// The vocab-parallel partials on CPU (d9d_kernels/metrics/vocab_parallel.py).
// vocab_partials: per row of one tensor-parallel rank's vocabulary shard
// x [N, size] (vocabulary columns [start, start + size)), row i of
// out [N, P] (float64, P = 2 + sumexp + 2 * kmax):
//   max, target logit (-Inf when the target is not in the shard),
//   [Σ exp(x - max)], kmax values best first, their kmax global indices,
// with ties to the lower index and -Inf / kPast padding where the shard has
// fewer than kmax columns. A row with a NaN or +Inf has that max (bad once
// combined) and padding for its top-k; a row of only -Inf keeps max -Inf
// and its first columns as top-k (another rank may hold finite scores).
// One read of each row from memory: it is converted to float once
// (bfloat16/float16) and scanned from cache by topk_scan and the exp pass.
// vocab_class_stats (below): the tp ranks' gathered partials combined per
// row and added to the class_stats state.
// Specification: vocab_parallel._local_partials, _combine and _add_rows
// (torch ops, the fallback where these ops do not run). Internal, not public ops.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__SSE2__)
#include <immintrin.h>  // lanes-inl.h's movemask
#endif

#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../kernels/checks.h"
#include "class_stats_cpu.h"
#include "class_stats_nll.h"
#include "common.h"
#include "half_bits.h"

namespace d9d {
namespace {

using namespace class_stats_detail;

namespace vec16 {
#define D9D_VEC_BYTES 16
#include "lanes-inl.h"
#include "class_stats_rows-inl.h"
#undef D9D_VEC_BYTES
}  // namespace vec16
using namespace vec16;

// Rows per task: ~64k scores, well above a thread hand-off.
constexpr int64_t kGrainScores = int64_t(1) << 16;
// The index of padding candidates, ranked after every real column of any
// vocabulary (vocab_parallel.PAST).
constexpr double kPast = 4503599627370496.0;  // 2^52

// The row's max as V, NaN when it holds a NaN (+Inf for a +Inf).
template <class V, class T>
V max_or_nan(const T* x, int64_t C) {
  V m = -std::numeric_limits<V>::infinity();
  for (int64_t j = 0; j < C; ++j) {
    const V v = static_cast<V>(x[j]);
    if (is_nan(v)) return v;
    m = v > m ? v : m;
  }
  return m;
}

// Σ_j exp(x[j] - m) in double; m finite and the row's max. row: the scores
// as V when already converted (read from cache), else nullptr.
template <class V, class T>
double sum_exp(const T* x, const V* row, int64_t C, V m, bool vec) {
  if constexpr (!std::is_same_v<V, double>) {
    if (vec) return row != nullptr ? nll_vec_sum_exp(row, C, m) : nll_vec_sum_exp(x, C, m);
  }
  double s = 0.0;
  for (int64_t j = 0; j < C; ++j) s += std::exp(static_cast<double>(row[j] - m));
  return s;
}

template <class T>
void partials(const T* x, int64_t rs, const int64_t* tg, int64_t ts, int64_t n, int64_t C, int64_t start, int kmax,
              bool with_sum, double* out) {
  using V = typename Cmp<T>::type;
  constexpr V inf = std::numeric_limits<V>::infinity();
  const int P = 2 + int(with_sum) + 2 * kmax;
  const int kk = static_cast<int>(std::min<int64_t>(kmax, C));
  const bool vec = !std::is_same_v<T, double> && nll_vec_ok();
  at::parallel_for(0, n, std::max<int64_t>(1, kGrainScores / std::max<int64_t>(C, 1)), [&](int64_t b, int64_t e) {
    std::vector<V> buf(std::is_same_v<T, V> ? 0 : C);
    V sc[kTopKBuffer];
    int32_t top[kTopKBuffer];
    V m_good = V(0);
    for (int64_t i = b; i < e; ++i) {
      const T* src = x + i * rs;
      double* o = out + i * P;
      const V* row = (kmax > 0 || !vec) ? row_as<V>(src, C, buf.data()) : nullptr;
      bool good = false;  // true: m is the row's max, finite
      if (kmax > 0) {
        good = topk_scan(row, C, kk, sc, top);  // false: NaN / +Inf, or only -Inf (top-k still complete)
        m_good = sc[0];
      } else if (vec) {
        if constexpr (!std::is_same_v<T, double>) good = nll_vec_max(src, C, &m_good);
      }
      const V m = good ? m_good : max_or_nan<V>(src, C);
      const bool bad = !(m < inf);  // NaN or +Inf
      o[0] = static_cast<double>(m);
      const int64_t tl = tg[i * ts] - start;
      o[1] = tl >= 0 && tl < C ? static_cast<double>(static_cast<V>(src[tl])) : -std::numeric_limits<double>::infinity();
      int c = 2;
      if (with_sum) {
        o[2] = m - m == V(0) ? sum_exp(src, row, C, m, vec) : 0.0;
        c = 3;
      }
      for (int r = 0; r < kmax; ++r) {
        const bool real = r < kk && !bad;
        o[c + r] = real ? static_cast<double>(sc[r]) : -std::numeric_limits<double>::infinity();
        o[c + kmax + r] = real ? static_cast<double>(top[r] + start) : kPast;
      }
    }
  });
}

void vocab_partials_cpu(const at::Tensor& x, const at::Tensor& target, int64_t start, int64_t kmax, bool sumexp,
                        const at::Tensor& out) {
  const char* op = "vocab_partials";
  check_floating(op, "x", x);
  D9D_CHECK(x.dim() == 2 && x.size(1) >= 1 && (x.size(1) == 1 || x.stride(1) == 1), op, "x",
            "must be 2-D [N, size >= 1] with contiguous rows, got shape ", x.sizes(), ", strides ", x.strides());
  const int64_t n = x.size(0), C = x.size(1);
  check_index(op, "target", target);
  D9D_CHECK(target.dim() == 1 && target.size(0) == n, op, "target", "must be [N] = [", n, "], got shape ",
            target.sizes());
  check_device(op, "target", target, x.device());
  D9D_CHECK(start >= 0, op, "start", "must be >= 0, got ", start);
  D9D_CHECK(kmax >= 0 && kmax <= kTopKBuffer, op, "kmax", "must be in [0, ", kTopKBuffer, "], got ", kmax);
  check_state(op, "out", out, {n, 2 + int64_t(sumexp) + 2 * kmax}, x.device());
  if (n == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "vocab_partials", [&] {
    partials(x.data_ptr<scalar_t>(), x.stride(0), target.data_ptr<int64_t>(), target.stride(0), n, C, start,
             static_cast<int>(kmax), sumexp, out.data_ptr<double>());
  });
}

// max(a, b) as torch.amax takes it: NaN if either is.
inline double max_nan(double a, double b) {
  return is_nan(a) || is_nan(b) ? std::numeric_limits<double>::quiet_NaN() : (b > a ? b : a);
}

// One row of the tp ranks' gathered partials g [W, N, P] (rows as
// vocab_partials writes them) combined: row max = max over ranks (NaN
// propagates), target logit = max over ranks (-Inf but on the target's rank),
// lse = M + log Σ_r s_r exp(m_r - M) (M the row max, 0 if not finite) when
// sumexp, top = the kmax best global indices of the merged lists by (value
// desc, index asc). Each rank's list is already in that order and the ranks'
// columns are disjoint, so a W-way merge of the list heads gives the order
// torch's two stable sorts give (vocab_parallel._combine). head: W slots.
struct Combined {
  double max, target_logit, lse;
};

Combined combine_row(const double* p, int64_t W, int64_t n, int64_t P, int64_t i, int kmax, bool sumexp,
                     int64_t* head, int64_t* top) {
  Combined c{-std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(), 0.0};
  for (int64_t r = 0; r < W; ++r) {
    const double* q = p + (r * n + i) * P;
    c.max = max_nan(c.max, q[0]);
    c.target_logit = max_nan(c.target_logit, q[1]);
  }
  const bool finite = c.max - c.max == 0.0;
  if (sumexp) {
    const double ms = finite ? c.max : 0.0;
    double s = 0.0;
    for (int64_t r = 0; r < W; ++r) {
      const double* q = p + (r * n + i) * P;
      s += q[2] * std::exp(q[0] - ms);
    }
    c.lse = ms + std::log(s);
  }
  if (!finite) return c;  // a bad row: its top is never read
  const int first = 2 + int(sumexp);
  std::fill(head, head + W, int64_t(0));
  for (int j = 0; j < kmax; ++j) {
    int64_t best = -1;
    double bv = 0.0, bi = 0.0;
    for (int64_t r = 0; r < W; ++r) {
      if (head[r] == kmax) continue;
      const double* q = p + (r * n + i) * P + first;
      const double v = q[head[r]], ix = q[kmax + head[r]];
      if (best < 0 || v > bv || (v == bv && ix < bi)) {
        best = r;
        bv = v;
        bi = ix;
      }
    }
    top[j] = static_cast<int64_t>(bi);
    ++head[best];
  }
  return c;
}

// vocab_class_stats: the gathered partials g [W, N, P] combined per row
// (combine_row) and added to the class_stats state exactly as
// vocab_parallel.add_vocab_class_stats' torch ops add them (its
// specification): rows kept by mask and ignore_index; bad[0] += kept rows
// whose target is outside [0, num_classes), bad[1] += kept rows with a good
// target whose scores have no finite max (or, rows_by_lse, whose lse is not
// finite); the rest are valid: extras[0] += 1, per k of top_ks stats[k]
// (tp, predicted, target) and confmat[target, top-1]. NLL: lse - target
// logit over the valid rows, or with lse given, lse - target logit over the
// kept rows with a good target and a finite lse. Rows are added in order on
// one thread: a few thousand rows of a few ranks cost microseconds.
void vocab_class_stats_cpu(const at::Tensor& g, const at::Tensor& target, const std::optional<at::Tensor>& mask,
                           std::optional<int64_t> ignore_index, const std::optional<at::Tensor>& lse,
                           int64_t num_classes, at::IntArrayRef top_ks, bool nll, bool rows_by_lse,
                           const at::Tensor& stats, const at::Tensor& extras, const at::Tensor& bad,
                           const std::optional<at::Tensor>& confmat) {
  const char* op = "vocab_class_stats";
  const int64_t C = num_classes, K = static_cast<int64_t>(top_ks.size());
  D9D_CHECK(C >= 1, op, "num_classes", "must be >= 1, got ", C);
  int64_t kmax = confmat.has_value() ? 1 : 0;
  for (const int64_t k : top_ks) {
    D9D_CHECK(k >= 1 && k <= kTopKBuffer, op, "top_ks", "must be in [1, ", kTopKBuffer, "], got ", top_ks);
    kmax = std::max(kmax, k);
  }
  const bool sumexp = nll && !lse.has_value();
  D9D_CHECK(!rows_by_lse || lse.has_value(), op, "rows_by_lse", "needs lse");
  const int64_t P = 2 + int64_t(sumexp) + 2 * kmax;
  D9D_CHECK_TYPE(g.scalar_type() == at::kDouble, op, "g", "must be float64, got ", g.scalar_type());
  D9D_CHECK(g.dim() == 3 && g.size(0) >= 1 && g.size(2) == P && g.is_contiguous(), op, "g",
            "must be a contiguous [W >= 1, N, ", P, "], got shape ", g.sizes());
  const int64_t W = g.size(0), n = g.size(1);
  const at::Device dev = g.device();
  check_index(op, "target", target);
  D9D_CHECK(target.dim() == 1 && target.size(0) == n, op, "target", "must be [N] = [", n, "], got shape ",
            target.sizes());
  check_device(op, "target", target, dev);
  check_mask(op, mask, {n}, dev);
  if (mask.has_value()) D9D_CHECK(mask->is_contiguous(), op, "mask", "must be contiguous");
  if (lse.has_value()) check_state(op, "lse", *lse, {n}, dev);
  check_state(op, "stats", stats, {K, 3, C}, dev);
  check_state(op, "extras", extras, {2}, dev);
  check_state(op, "bad", bad, {2}, dev);
  if (confmat.has_value()) check_state(op, "confmat", *confmat, {C, C}, dev);

  const double* p = g.data_ptr<double>();
  const int64_t* t = target.data_ptr<int64_t>();
  const int64_t ts = target.stride(0);
  const bool* keep_mask = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  const double* l = lse.has_value() ? lse->data_ptr<double>() : nullptr;
  double *st = stats.data_ptr<double>(), *ex = extras.data_ptr<double>(), *bd = bad.data_ptr<double>();
  double* cm = confmat.has_value() ? confmat->data_ptr<double>() : nullptr;
  std::vector<int64_t> head(W), top(std::max<int64_t>(kmax, 1));
  double valid = 0.0, nll_sum = 0.0, bad_target = 0.0, bad_preds = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t y = t[i * ts];
    if ((keep_mask != nullptr && !keep_mask[i]) || (ignore_index.has_value() && y == *ignore_index)) continue;
    if (y < 0 || y >= C) {
      bad_target += 1.0;
      continue;
    }
    const Combined c = combine_row(p, W, n, P, i, static_cast<int>(kmax), sumexp, head.data(), top.data());
    const bool lse_finite = l != nullptr && l[i] - l[i] == 0.0;
    if (nll && l != nullptr && lse_finite) nll_sum += l[i] - c.target_logit;
    if (!(rows_by_lse ? lse_finite : c.max - c.max == 0.0)) {
      bad_preds += 1.0;
      continue;
    }
    valid += 1.0;
    if (sumexp) nll_sum += c.lse - c.target_logit;
    for (int64_t k = 0; k < K; ++k) {
      double* s = st + k * 3 * C;
      bool hit = false;
      for (int64_t j = 0; j < top_ks[k]; ++j) {
        hit = hit || top[j] == y;
        s[C + top[j]] += 1.0;
      }
      s[y] += hit ? 1.0 : 0.0;
      s[2 * C + y] += 1.0;
    }
    if (cm != nullptr) cm[y * C + top[0]] += 1.0;
  }
  ex[0] += valid;
  if (nll) ex[1] += nll_sum;
  bd[0] += bad_target;
  bd[1] += bad_preds;
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) {
  m.impl("vocab_partials", &d9d::vocab_partials_cpu);
  m.impl("vocab_class_stats", &d9d::vocab_class_stats_cpu);
}
