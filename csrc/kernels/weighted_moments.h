// Per-element math of weighted_moments (d9d_kernels.reference.weighted_moments),
// shared by csrc/cpu/weighted_moments.cpp and csrc/cuda/weighted_moments.cu.
#pragma once

#include <cfloat>

#include "common.h"

namespace d9d {

constexpr int kMomentsSize = 9;  // slots of reference.MOMENTS

// Partial sums of one chunk/block; `v` is laid out like the state, bad apart.
struct Moments {
  double v[kMomentsSize];
  double bad;
};

D9D_HD inline void moments_zero(Moments& m) {
  for (int i = 0; i < kMomentsSize; ++i) m.v[i] = 0.0;
  m.bad = 0.0;
}

D9D_HD inline void moments_merge(Moments& a, const Moments& b) {
  for (int i = 0; i < kMomentsSize; ++i) a.v[i] += b.v[i];
  a.bad += b.bad;
}

// Element with finite x, y (if any) and w: the ones that may set a pivot.
template <bool HasY>
D9D_HD inline bool moments_good(double x, double y, double w) {
  return is_finite(x) && is_finite(w) && (!HasY || is_finite(y));
}

// A pivot as used in the sums: torch.nan_to_num(p, nan=0.0) (unset -> 0,
// +-Inf -> +-DBL_MAX).
D9D_HD inline double pivot_value(double p) {
  if (is_nan(p)) return 0.0;
  if (p == INFINITY) return DBL_MAX;
  if (p == -INFINITY) return -DBL_MAX;
  return p;
}

// Adds one valid element (mask already applied). Products are formed in the
// reference's order ((w * dx) * dx, ...) so results agree to rounding.
template <bool HasY>
D9D_HD inline void moments_add(Moments& m, double x, double y, double w, bool skip_bad, double px, double py) {
  if (!moments_good<HasY>(x, y, w)) {
    m.bad += 1.0;
    if (skip_bad) return;
  }
  const double dx = x - px;
  const double wdx = w * dx;
  m.v[0] += w;
  m.v[1] += wdx;
  m.v[2] += wdx * dx;
  if (HasY) {
    const double dy = y - py;
    const double wdy = w * dy;
    const double d = x - y;
    const double wd = w * d;
    m.v[3] += wdy;
    m.v[4] += wdy * dy;
    m.v[5] += wdx * dy;
    m.v[6] += w * fabs(d);
    m.v[7] += wd * d;
  }
  m.v[8] += 1.0;
}

}  // namespace d9d
