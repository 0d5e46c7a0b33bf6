// Argument checks of moments_recenter and moments_center, shared by the CPU
// and CUDA entry points. They run before any write.
#pragma once

#include "checks.h"
#include "weighted_moments.h"

namespace d9d {

// moments [..., 9] and pivots [..., 2] of B entries, float64, contiguous, on one device; returns B.
inline int64_t check_moments_pivot(const char* op, const at::Tensor& moments, const at::Tensor& pivot,
                                   const at::Tensor& other, const char* other_arg) {
  const int64_t b = moments.numel() / kMomentsSize;
  D9D_CHECK(moments.dim() >= 1 && moments.size(-1) == kMomentsSize, op, "moments", "must be [..., 9], got shape ",
            moments.sizes());
  check_state(op, "moments", moments, moments.sizes(), moments.device());
  for (auto [arg, t] : {std::pair{"pivot", &pivot}, std::pair{other_arg, &other}}) {
    D9D_CHECK(t->numel() == 2 * b, op, arg, "must hold 2 values per moment vector (", 2 * b, "), got shape ",
              t->sizes());
    check_state(op, arg, *t, t->sizes(), moments.device());
  }
  return b;
}

inline void check_off(const at::Tensor& off, const at::Tensor& moments) {
  D9D_CHECK_TYPE(off.scalar_type() == at::kBool && off.numel() == 1 && off.device() == moments.device(),
                 "moments_center", "off", "must be bool [1] on ", moments.device());
}

}  // namespace d9d
