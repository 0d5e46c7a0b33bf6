// Argument checks of moments_recenter and moments_center, shared by the CPU
// and CUDA entry points. They run before any write.
#pragma once

#include "checks.h"

namespace d9d {

// sums [n] and pivots [p] (float64, 1-D, contiguous), `other` [p] (new
// pivots or centres) and table int64 [B, 3] on one device; returns B.
inline int64_t check_moments_pivot(const char* op, const at::Tensor& sums, const at::Tensor& pivots,
                                   const at::Tensor& other, const char* other_arg, const at::Tensor& table) {
  const auto dev = sums.device();
  D9D_CHECK(sums.dim() == 1, op, "sums", "must be 1-D (a flat SUM buffer), got shape ", sums.sizes());
  check_state(op, "sums", sums, sums.sizes(), dev);
  D9D_CHECK(pivots.dim() == 1, op, "pivots", "must be 1-D (a flat REPLICA buffer), got shape ", pivots.sizes());
  check_state(op, "pivots", pivots, pivots.sizes(), dev);
  check_state(op, other_arg, other, pivots.sizes(), dev);
  check_index(op, "table", table);
  D9D_CHECK(table.dim() == 2 && table.size(1) == 3 && table.is_contiguous(), op, "table",
            "must be contiguous int64 [B, 3] (sums offset, pivots offset, paired), got shape ", table.sizes());
  check_device(op, "table", table, dev);
  return table.size(0);
}

inline void check_off(const at::Tensor& off, const at::Tensor& sums) {
  D9D_CHECK_TYPE(off.scalar_type() == at::kBool && off.numel() == 1 && off.device() == sums.device(),
                 "moments_center", "off", "must be bool [1] on ", sums.device());
}

}  // namespace d9d
