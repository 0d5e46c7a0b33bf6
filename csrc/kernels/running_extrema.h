// Per-element math of running_extrema (d9d_kernels.reference.running_extrema),
// shared by csrc/cpu/running_extrema.cpp and csrc/cuda/running_extrema.cu.
#pragma once

#include "common.h"

namespace d9d {

// torch.maximum: NaN if either is NaN.
D9D_HD inline double nan_maximum(double a, double b) {
  if (is_nan(a) || is_nan(b)) return NAN;
  return a > b ? a : b;
}

struct Extrema {
  double mx;   // max x
  double nmn;  // -min x
  double bad;
};

D9D_HD inline Extrema extrema_init() { return Extrema{-INFINITY, -INFINITY, 0.0}; }

// One valid element. NaN: skipped (skip_bad) or makes both extrema NaN;
// +-Inf are ordinary values; NaN and +-Inf count as bad.
D9D_HD inline void extrema_add(Extrema& a, double v, bool skip_bad) {
  if (!is_finite(v)) a.bad += 1.0;
  if (skip_bad && is_nan(v)) return;
  a.mx = nan_maximum(a.mx, v);
  a.nmn = nan_maximum(a.nmn, -v);
}

D9D_HD inline void extrema_merge(Extrema& a, const Extrema& b) {
  a.mx = nan_maximum(a.mx, b.mx);
  a.nmn = nan_maximum(a.nmn, b.nmn);
  a.bad += b.bad;
}

}  // namespace d9d
