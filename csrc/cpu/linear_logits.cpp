// linear_logits_rows on CPU: the per-row reductions of the logits
// z = hidden @ weight.T (+ bias, soft-cap) without materialising them, into
// rows [N, 4] float64 = (max, Σ exp(z - max), columns ranked ahead of the
// target, argmax). Each row's logits are formed block by block, columns
// [c0, c0 + cols) in order: at::cpu::mm_out / addmm_out (torch.mm's CPU
// kernel, so torch.mm's rounding) into a block [rows, cols] of hidden's
// dtype, soft-capped in place as softcapped() in d9d_kernels/ops/linear_logits.py
// does, then folded into the row's state in one read of each block row.
// d9d_kernels/ops/linear_logits.py calls it; its torch ops on each block
// (_rows_torch's fallback there) are the specification:
//   max / argmax: the first maximum, a NaN makes the max NaN (the row is bad);
//   ahead: z_j > z_t, or z_j == z_t with j < t (class_stats' tie rule), the
//   target's own column never; z_t (zt [N], float32 / float64) is the
//   target's logit and t = tloc its column in the shard;
//   Σ exp: online, re-scaled to the new max (zero while it is -inf).
//
// Parallelism: ONE parallel region per call. Its threads take tasks of `rows`
// rows from a shared counter and run each task's whole vocabulary (every
// block's matmul and pass) alone, in a private block of the scratch. A thread
// that the OS deschedules (another process on its core) delays only the task
// it holds, and the others take the remaining tasks; a region per block would
// make every thread wait for it at every block. The matmul inside a task runs
// on its thread alone (a BLAS call inside a parallel region does not fork).
// The block ops are at::cpu:: calls, the CPU kernels without the dispatcher:
// the region's other threads do not carry the caller's thread-local modes
// (inference mode, no_grad), which the dispatcher's autograd layer reads.
// Internal (CPU only, not in d9d_kernels._extension.OPS).
#include <array>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ScalarOps.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/div_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <ATen/ops/mul_cpu_dispatch.h>
#include <ATen/ops/tanh_cpu_dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
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

// The arguments both row ops share: hidden [N, D], weight [V, D] and bias [V] of one floating dtype
// on one device; returns {N, D, V}.
static std::array<int64_t, 3> check_hidden_weight_bias(const char* op, const at::Tensor& hidden,
                                                      const at::Tensor& weight,
                                                      const std::optional<at::Tensor>& bias) {
  check_floating(op, "hidden", hidden);
  D9D_CHECK(hidden.dim() == 2, op, "hidden", "must be [N, D], got shape ", hidden.sizes());
  const int64_t N = hidden.size(0), D = hidden.size(1);
  D9D_CHECK_TYPE(weight.scalar_type() == hidden.scalar_type(), op, "weight", "must have hidden's dtype ",
                 hidden.scalar_type(), ", got ", weight.scalar_type());
  D9D_CHECK(weight.dim() == 2 && weight.size(1) == D, op, "weight", "must be [V, D] with D = ", D, ", got shape ",
            weight.sizes());
  check_device(op, "weight", weight, hidden.device());
  const int64_t V = weight.size(0);
  if (bias.has_value()) {
    D9D_CHECK_TYPE(bias->scalar_type() == hidden.scalar_type(), op, "bias", "must have hidden's dtype ",
                   hidden.scalar_type(), ", got ", bias->scalar_type());
    D9D_CHECK(bias->dim() == 1 && bias->size(0) == V, op, "bias", "must be [V] = [", V, "], got shape ",
              bias->sizes());
    check_device(op, "bias", *bias, hidden.device());
  }
  return {N, D, V};
}

void linear_logits_rows_cpu(const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                            const at::Tensor& zt, const at::Tensor& tloc, int64_t cols, int64_t rows,
                            std::optional<double> softcap, bool sumexp, const at::Tensor& out) {
  const char* op = "linear_logits_rows";
  const auto [N, D, V] = check_hidden_weight_bias(op, hidden, weight, bias);
  check_floating(op, "zt", zt);
  D9D_CHECK(zt.dim() == 1 && zt.size(0) == N, op, "zt", "must be [N] = [", N, "], got shape ", zt.sizes());
  check_index(op, "tloc", tloc);
  D9D_CHECK(tloc.dim() == 1 && tloc.size(0) == N && tloc.is_contiguous(), op, "tloc", "must be a contiguous [N] = [",
            N, "], got shape ", tloc.sizes());
  D9D_CHECK(cols >= 1, op, "cols", "must be >= 1, got ", cols);
  D9D_CHECK(rows >= 1, op, "rows", "must be >= 1, got ", rows);
  D9D_CHECK(!softcap.has_value() || *softcap > 0, op, "softcap", "must be None or > 0, got ", *softcap);
  check_state(op, "out", out, {N, 4}, hidden.device());
  if (N == 0) return;
  const at::Tensor ztd = zt.to(at::kDouble).contiguous();
  const double* ztp = ztd.data_ptr<double>();
  const int64_t* tp = tloc.data_ptr<int64_t>();
  double* st = out.data_ptr<double>();
  const bool vec = nll_vec_ok();
  const int64_t task_rows = std::min(rows, N), c_max = std::min(cols, std::max<int64_t>(V, 1));
  const int64_t tasks = (N + task_rows - 1) / task_rows;
  const int64_t slots = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  // one private block per thread of the region, allocated here (the calling thread's mode and allocator)
  const at::Tensor scratch = at::empty({slots, task_rows * c_max}, hidden.options());
  const at::Tensor wt = weight.t();
  // softcapped()'s z.div_(softcap): the Python float as a wrapped-number tensor, as torch passes it
  const at::Tensor cap = softcap.has_value() ? at::native::wrapped_scalar_tensor(*softcap) : at::Tensor();
  std::atomic<int64_t> next{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hidden.scalar_type(), "linear_logits_rows_cpu", [&] {
    at::parallel_for(0, slots, 1, [&](int64_t slot, int64_t) {
      at::Tensor buf = scratch[slot];
      for (int64_t k = next.fetch_add(1); k < tasks; k = next.fetch_add(1)) {
        const int64_t r0 = k * task_rows, n = std::min(task_rows, N - r0);
        const at::Tensor h = hidden.narrow(0, r0, n);
        for (int64_t i = r0; i < r0 + n; ++i) {
          st[4 * i] = -std::numeric_limits<double>::infinity();
          st[4 * i + 1] = st[4 * i + 2] = st[4 * i + 3] = 0.0;
        }
        for (int64_t c0 = 0; c0 < V; c0 += c_max) {
          const int64_t c = std::min(c_max, V - c0);
          at::Tensor z = buf.narrow(0, 0, n * c).view({n, c});
          if (bias.has_value()) {
            at::cpu::addmm_out(z, bias->narrow(0, c0, c), h, wt.narrow(1, c0, c));
          } else {
            at::cpu::mm_out(z, h, wt.narrow(1, c0, c));
          }
          if (softcap.has_value()) {
            at::cpu::div_(z, cap);
            at::cpu::tanh_(z);
            at::cpu::mul_(z, cap);
          }
          const scalar_t* zp = z.const_data_ptr<scalar_t>();
          for (int64_t i = 0; i < n; ++i) {
            block_row(zp + i * c, c, c0, ztp[r0 + i], tp[r0 + i] - c0, sumexp, vec, st + 4 * (r0 + i));
          }
        }
      }
    });
  });
}

// linear_logits_target: out[i] = the logit of row i's target column
// t = target[i] - start before any soft-cap, in the accumulation dtype
// (float32; float64 for float64 inputs), -inf where t is not in [0, V): the
// dot of hidden's row with weight's row t, summed in order in the
// accumulation dtype, + bias, rounded to hidden's dtype. target_logits() in
// d9d_kernels/ops/linear_logits.py calls it on CPU and soft-caps the result
// with the blocks' torch ops; its torch ops are the specification, up to the
// order of the dot's sum (the last bit). One parallel region over the rows.
void linear_logits_target_cpu(const at::Tensor& hidden, const at::Tensor& weight,
                              const std::optional<at::Tensor>& bias, const at::Tensor& target, int64_t start,
                              const at::Tensor& out) {
  const char* op = "linear_logits_target";
  const auto [N, D, V] = check_hidden_weight_bias(op, hidden, weight, bias);
  check_index(op, "target", target);
  D9D_CHECK(target.dim() == 1 && target.size(0) == N, op, "target", "must be [N] = [", N, "], got shape ",
            target.sizes());
  const at::ScalarType acc_t = hidden.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  D9D_CHECK_TYPE(out.scalar_type() == acc_t, op, "out", "must be ", acc_t, ", got ", out.scalar_type());
  D9D_CHECK(out.dim() == 1 && out.size(0) == N && out.is_contiguous(), op, "out", "must be a contiguous [N] = [", N,
            "], got shape ", out.sizes());
  check_device(op, "out", out, hidden.device());
  if (N == 0) return;
  const at::Tensor h = hidden.contiguous(), tg = target.contiguous();
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  const int64_t ws0 = weight.stride(0), ws1 = weight.stride(1);
  const int64_t* tp = tg.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, hidden.scalar_type(), "linear_logits_target_cpu", [&] {
    using Acc = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    const scalar_t* hp = h.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    const scalar_t* bp = bias.has_value() ? b.const_data_ptr<scalar_t>() : nullptr;
    Acc* op_out = out.data_ptr<Acc>();
    // chunks of at least 2^15 multiply-adds (the library's parallel grain)
    at::parallel_for(0, N, std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(D, 1)), [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) {
        const int64_t j = tp[i] - start;
        if (j < 0 || j >= V) {
          op_out[i] = -std::numeric_limits<Acc>::infinity();
          continue;
        }
        const scalar_t* x = hp + i * D;
        const scalar_t* w = wp + j * ws0;
        Acc z = 0;
        for (int64_t k = 0; k < D; ++k) {
          z += static_cast<Acc>(x[k]) * static_cast<Acc>(w[k * ws1]);
        }
        if (bp != nullptr) z += static_cast<Acc>(bp[j]);
        op_out[i] = static_cast<Acc>(static_cast<scalar_t>(z));
      }
    });
  });
}

}  // namespace
}  // namespace d9d

TORCH_LIBRARY_IMPL(d9d_kernels, CPU, m) {
  m.impl("linear_logits_rows", &d9d::linear_logits_rows_cpu);
  m.impl("linear_logits_target", &d9d::linear_logits_target_cpu);
}
