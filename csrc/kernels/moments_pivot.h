// Per-entry math of moments_recenter and moments_center
// (d9d_kernels.reference), shared by csrc/cpu/moments_pivot.cpp and
// csrc/cuda/moments_pivot.cu. An entry is one moment vector m[9]
// (reference.MOMENTS) and its pivot p[2] = (px, py), NaN = unset (sums about 0).
#pragma once

#include "weighted_moments.h"

namespace d9d {

// m about pivot `old` re-expressed about `neu` (both as pivot_value reads
// them); then the entry's pivot becomes `neu`. With d = old - new:
// sx' = sx + w dx, sxx' = sxx + (2 dx sx + w dx^2) (same for y),
// sxy' = sxy + (dx sy + dy sx) + w dx dy; w, sae, sse, n unchanged.
D9D_HD inline void recenter_entry(double* m, double* p, const double* neu) {
  const double n0 = neu[0], n1 = neu[1];
  const double dx = pivot_value(p[0]) - pivot_value(n0);
  const double dy = pivot_value(p[1]) - pivot_value(n1);
  const double w = m[0], sx = m[1], sy = m[3];
  m[1] = sx + w * dx;
  m[2] = m[2] + (2.0 * dx * sx + w * dx * dx);
  m[3] = sy + w * dy;
  m[4] = m[4] + (2.0 * dy * sy + w * dy * dy);
  m[5] = m[5] + (dx * sy + dy * sx) + w * dx * dy;
  p[0] = n0;
  p[1] = n1;
}

// The centre an entry's sums are most precise about: per component (x, and
// y when `paired`) the weighted mean, written to centre[] where the entry
// has weight and a finite mean (left as is elsewhere). Returns whether a
// written component's sums about the pivot lost more than `threshold` ulps
// that sums about the mean keep: (|d| + |p|) / (|mean| + std), and with
// `paired` also d^2 / (var + (p 2^-40)^2), d = mean - p.
D9D_HD inline bool center_entry(const double* m, const double* p, bool paired, double threshold, double* centre) {
  bool off = false;
  const double w = m[0];
  for (int c = 0; c < (paired ? 2 : 1); ++c) {
    const double pc = pivot_value(p[c]);
    const double d = m[1 + 2 * c] / w;
    double var = m[2 + 2 * c] / w - d * d;
    var = var < 0.0 ? 0.0 : var;  // cancellation can leave it below 0; NaN stays NaN
    const double mean = pc + d;
    if (!(w > 0.0) || !is_finite(mean)) continue;
    double lost = (fabs(d) + fabs(pc)) / (fabs(mean) + sqrt(var));
    if (paired) {
      const double floor = pc * 0x1p-40;
      const double l2 = d * d / (var + floor * floor);
      lost = (is_nan(l2) || l2 > lost) ? l2 : lost;  // NaN propagates, as torch.maximum
    }
    centre[c] = mean;
    off = off || lost > threshold;
  }
  return off;
}

}  // namespace d9d
