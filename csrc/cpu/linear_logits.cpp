// linear_logits_block on CPU: the per-row reductions of one block of logits
// z [n, c] (columns [c0, c0 + c) of the vocabulary; torch.mm's output, any
// float dtype), folded into rows [n, 4] float64 = (max, Σ exp(z - max),
// columns ranked ahead of the target, argmax), in one read of each row.
// d9d_kernels/ops/linear_logits.py calls it after each chunk's torch.mm; its
// torch ops on the block (_block_torch there) are the specification:
//   max / argmax: the first maximum, a NaN makes the max NaN (the row is bad);
//   ahead: z_j > z_t, or z_j == z_t with j < t (class_stats' tie rule), the
//   target's own column never; z_t (zt [n], float32 / float64) is the
//   target's logit and t = tloc - c0 its column in this block;
//   Σ exp: online, re-scaled to the new max (zero while it is -inf).
// Internal (CPU only, not in d9d_kernels._extension.OPS).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include "../kernels/checks.h"
#include "class_stats_nll.h"

namespace d9d {
namespace {

template <class T>
void block_row(const T* x, int64_t c, int64_t c0, double zt, int64_t t, bool sumexp, bool vec, double* st) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  constexpr Acc inf = std::numeric_limits<Acc>::infinity();
  const Acc z_t = static_cast<Acc>(zt);
  Acc cm = -inf;
  int64_t ci = 0, ahead = 0;
  bool nan = false;
  for (int64_t j = 0; j < c; ++j) {
    const Acc v = static_cast<Acc>(x[j]);
    if (v != v) {
      if (!nan) ci = j;
      nan = true;
      continue;
    }
    if (v > cm) {
      cm = v;
      if (!nan) ci = j;
    }
    ahead += j < t ? (v >= z_t) : (j > t && v > z_t);
  }
  const double m_old = st[0];
  const double m_blk = nan ? std::numeric_limits<double>::quiet_NaN() : static_cast<double>(cm);
  if (m_blk > m_old) st[3] = static_cast<double>(ci + c0);  // strict: an earlier block keeps a tie
  const double m_new = (m_old != m_old || m_blk != m_blk) ? std::numeric_limits<double>::quiet_NaN()
                                                          : (m_blk > m_old ? m_blk : m_old);
  if (sumexp) {
    const double safe = std::isfinite(m_new) ? m_new : 0.0;
    const Acc s = static_cast<Acc>(safe);
    double blk = 0.0;
    if constexpr (!std::is_same_v<T, double>) {
      if (vec && std::isfinite(m_new)) {
        blk = nll_vec_sum_exp(x, c, s);  // every z - s <= 0: s is at least the block's max
      } else {
        for (int64_t j = 0; j < c; ++j) blk += std::exp(static_cast<double>(static_cast<Acc>(x[j]) - s));
      }
    } else {
      for (int64_t j = 0; j < c; ++j) blk += std::exp(x[j] - s);
    }
    st[1] = st[1] * std::exp(m_old - safe) + blk;
  }
  st[0] = m_new;
  st[2] += static_cast<double>(ahead);
}

void linear_logits_block_cpu(const at::Tensor& z, const at::Tensor& zt, const at::Tensor& tloc, int64_t c0,
                             bool sumexp, const at::Tensor& rows) {
  const char* op = "linear_logits_block";
  check_floating(op, "z", z);
  D9D_CHECK(z.dim() == 2 && z.is_contiguous(), op, "z", "must be a contiguous [n, c] block, got shape ", z.sizes());
  const int64_t n = z.size(0), c = z.size(1);
  check_floating(op, "zt", zt);
  D9D_CHECK(zt.dim() == 1 && zt.size(0) == n && zt.is_contiguous(), op, "zt", "must be a contiguous [n] = [", n,
            "], got shape ", zt.sizes());
  check_index(op, "tloc", tloc);
  D9D_CHECK(tloc.dim() == 1 && tloc.size(0) == n && tloc.is_contiguous(), op, "tloc", "must be a contiguous [n] = [",
            n, "], got shape ", tloc.sizes());
  check_state(op, "rows", rows, {n, 4}, z.device());
  const at::Tensor ztd = zt.to(at::kDouble);
  const double* ztp = ztd.data_ptr<double>();
  const int64_t* tp = tloc.data_ptr<int64_t>();
  double* out = rows.data_ptr<double>();
  const bool vec = nll_vec_ok();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "linear_logits_block_cpu", [&] {
    const scalar_t* zp = z.data_ptr<scalar_t>();
    at::parallel_for(0, n, std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(c, 1)), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        block_row(zp + i * c, c, c0, ztp[i], tp[i] - c0, sumexp, vec, out + 4 * i);
      }
    });
  });
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) { m.impl("linear_logits_block", &d9d::linear_logits_block_cpu); }
