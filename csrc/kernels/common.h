// Helpers shared by the CPU (csrc/cpu) and CUDA (csrc/cuda) kernels.
// Everything here is inline and host-device, so the CPU path that CI runs
// covers the per-element logic the CUDA path uses.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define D9D_HD __host__ __device__
#else
#define D9D_HD
#endif

namespace d9d {

// input_kind of binary_stats / score_histogram (d9d_kernels.reference).
constexpr int64_t kInputProbs = 0;
constexpr int64_t kInputLogits = 1;
constexpr int64_t kInputAuto = 2;

D9D_HD inline bool is_finite(double v) {
  // v - v is 0 for finite v, NaN for +-Inf and NaN (cheaper than isfinite on both sides).
  return (v - v) == 0.0;
}

D9D_HD inline bool is_nan(double v) { return v != v; }

// torch.sigmoid in float64.
D9D_HD inline double sigmoid(double v) { return 1.0 / (1.0 + exp(-v)); }

// A pred that makes INPUT_AUTO pick logits: outside [0, 1].
D9D_HD inline bool outside_unit(double v) { return v < 0.0 || v > 1.0; }

// Score bin of a probability: clamp(floor(p * B), 0, B - 1); NaN -> bin 0
// (torch.nan_to_num first), which only ever happens for dropped entries.
// No floor(): for 0 <= f < B - 1 the truncating cast is floor, and f >= 0 /
// f >= B - 1 (an integer) decide the clamps as floor(f) would. Without
// -msse4.1 floor is a libm call, a tenth of a 10k-bin histogram update.
D9D_HD inline int64_t bin_of(double p, int64_t n_bins) {
  const double f = p * static_cast<double>(n_bins);
  if (!(f >= 0.0)) return 0;  // also NaN
  if (f >= static_cast<double>(n_bins - 1)) return n_bins - 1;
  return static_cast<int64_t>(f);
}

// Element kept by mask / ignore_index (before the bad-value test).
D9D_HD inline bool kept(bool mask_ok, bool has_ignore, int64_t target, int64_t ignore_index) {
  return mask_ok && !(has_ignore && target == ignore_index);
}

}  // namespace d9d
