// Argument checks of running_extrema, shared by the CPU and CUDA entry points.
// They run before any write, so a failing call leaves the state unchanged.
#pragma once

#include "checks.h"

namespace d9d {

inline void check_running_extrema(const at::Tensor& x, const std::optional<at::Tensor>& mask, const at::Tensor& state,
                           const at::Tensor& bad) {
  const char* op = "running_extrema";
  const auto dev = x.device();
  check_floating(op, "x", x);
  D9D_CHECK(x.dim() == 1, op, "x", "must be 1-D [N] (the dk.ops wrapper flattens), got shape ", x.sizes());
  check_mask(op, mask, x.sizes(), dev);
  check_state(op, "state", state, {2}, dev);
  check_state(op, "bad", bad, {1}, dev);
}

}  // namespace d9d
